"""Unit tests of the wire codec (shared/codec.py), without HTTP.

Every tensor goes the whole way a request takes: ``encode_tensor`` -> ``pack_message`` ->
bytes -> ``unpack_message`` -> ``decode_tensor``.
"""

from __future__ import annotations

import hashlib
import math
import random

import bitsandbytes.functional as bnbf
import msgpack
import pytest
import torch

from bench.codec import activation_like
from shared import WIRE_VERSION
from shared.codec import (
    DEFAULT_INT8_BLOCK,
    FLOAT_CODECS,
    INT4_BLOCK,
    INT8_BLOCK_SIZES,
    MAX_NDIM,
    decode_tensor,
    dtype_name,
    encode_int8_dynamic,
    encode_tensor,
    pack_message,
    unpack_message,
    warm_up,
)
from shared.errors import BadPayload

# Relative RMS error allowed per codec, on Gaussian float32 data (measured: int8 0.67%, int4 10.8%).
MAX_REL_RMS = {"fp32": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8": 0.01, "int4": 0.125}
# The same on activation-like (B, T, C) tensors with outlier channels (measured: int8 0.67%, int4 8.5%).
MAX_REL_RMS_ACTIVATIONS = {"int8": 0.01, "int4": 0.10}

# 0-d, empty, tiny, a (B, T, C) activation, numels that are no multiple of the default int8
# block (128) nor of the smallest one (64), and enough rows (140) for int8 blocks down the columns.
SHAPES = [(), (0,), (3, 0, 5), (1,), (7,), (2, 3, 128), (4097,), (3, 1000), (2, 70, 16)]


@pytest.fixture(scope="module", autouse=True)
def _bitsandbytes_imported():
    """Import bitsandbytes once up front (about 2 s), so no single test carries that cost."""
    warm_up()


def gaussian(shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def wire(t: torch.Tensor, codec: str, **kw) -> dict:
    """The tensor map exactly as a receiver sees it after packing and unpacking."""
    return unpack_message(pack_message({"t": encode_tensor(t, codec, **kw)}))["t"]


def round_trip(t: torch.Tensor, codec: str, **kw) -> torch.Tensor:
    return decode_tensor(wire(t, codec, **kw))


def rel_rms(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


# --------------------------------------------------------------------------- float codecs


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "0d")
@pytest.mark.parametrize("codec", FLOAT_CODECS)
def test_float_round_trip_within_codec_error_bound(codec, shape):
    x = gaussian(shape)
    obj = wire(x, codec)
    assert obj["codec"] == codec and obj["dtype"] == "float32" and obj["shape"] == list(shape)
    y = decode_tensor(obj)
    assert y.dtype == torch.float32 and tuple(y.shape) == tuple(shape)
    if x.numel() == 0:
        return
    assert bool(torch.isfinite(y).all())
    if codec == "fp32":
        assert torch.equal(y, x)
    else:
        assert rel_rms(y, x) < MAX_REL_RMS[codec], (codec, shape, rel_rms(y, x))


# --------------------------------------------------------------------------- int8 (linear map) and int4


def _bf16(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float()


@pytest.mark.parametrize("block", INT8_BLOCK_SIZES)
def test_int8_every_block_size_on_a_ragged_numel(block):
    x = gaussian((3, 333), seed=block)  # 999 values: no multiple of any block size; 3 rows: runs of values
    obj = wire(x, "int8", int8_block=block)
    assert (obj["map"], obj["block"], obj["width"]) == ("linear", block, 1)
    assert len(obj["data"]) == x.numel()
    assert len(obj["absmax"]) == 2 * math.ceil(x.numel() / block)
    assert rel_rms(decode_tensor(obj), x) < MAX_REL_RMS["int8"]


def test_int8_default_block_and_absmax_per_block():
    x = gaussian((2 * DEFAULT_INT8_BLOCK + 1,))
    obj = wire(x, "int8")
    assert (obj["block"], obj["width"]) == (DEFAULT_INT8_BLOCK, 1)
    absmax = _bf16(obj["absmax"])
    expected = torch.stack([b.abs().max() for b in x.split(DEFAULT_INT8_BLOCK)])
    assert torch.equal(absmax, expected.to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_linear_decodes_by_the_documented_formula(dtype):
    """Blocks run down the columns: (rows, width) = (399, 16), blocks of 64 rows, the last of 15."""
    block, x = 64, gaussian((133, 3, 16)).to(dtype)
    obj = wire(x, "int8", int8_block=block)
    assert (obj["map"], obj["block"], obj["width"], obj["dtype"]) == ("linear", block, 16, dtype_name(dtype))
    rows, x2 = 399, x.float().reshape(399, 16)
    codes = torch.frombuffer(bytearray(obj["data"]), dtype=torch.int8).reshape(rows, 16).float()
    absmax = _bf16(obj["absmax"]).reshape(-1, 16)
    true_absmax = torch.stack([b.abs().amax(0) for b in x2.split(block)])  # (7, 16)
    assert torch.equal(absmax, true_absmax.to(torch.bfloat16).float())
    assert torch.equal(torch.stack([b.abs().amax(0) for b in codes.split(block)]), torch.full((7, 16), 127.0))
    y = decode_tensor(obj)
    assert y.dtype == dtype and y.shape == x.shape
    expected = codes * absmax[torch.arange(rows) // block] / 127
    assert torch.allclose(y.float().reshape(rows, 16), expected.to(dtype).float(), rtol=1e-5, atol=0)
    assert rel_rms(y.float(), x.float()) < MAX_REL_RMS["int8"]


def _reference_int4_decode(obj: dict) -> torch.Tensor:
    """The int4 formula of the module docstring, written out independently."""
    block, seed, numel = obj["block"], obj["seed"], math.prod(obj["shape"])
    bits = int.from_bytes(hashlib.sha256(seed.to_bytes(8, "little")).digest(), "little")
    signs = torch.tensor([-1.0 if (bits >> i) & 1 else 1.0 for i in range(block)])
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < block:
        hadamard = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), hadamard)
    rotation = signs[:, None] * hadamard / math.sqrt(block)
    packed = torch.frombuffer(bytearray(obj["data"]), dtype=torch.uint8).long()
    nibbles = torch.stack([packed % 16, packed // 16], 1).reshape(-1, block)
    assert int(nibbles.min()) >= 1  # the sender writes 1..15
    y = (nibbles - 8).float() * _bf16(obj["absmax"])[:, None] / 7
    return (y @ rotation.T).reshape(-1)[:numel].reshape(obj["shape"])


@pytest.mark.parametrize("shape", [(2, 3, 64), (1001,), (7,), ()], ids=str)
def test_int4_decodes_by_the_documented_formula(shape):
    x = gaussian(shape)
    obj = wire(x, "int4")
    nblocks = math.ceil(x.numel() / INT4_BLOCK)
    assert obj["block"] == INT4_BLOCK and type(obj["seed"]) is int
    assert len(obj["data"]) == nblocks * INT4_BLOCK // 2 and len(obj["absmax"]) == 2 * nblocks
    y = decode_tensor(obj)
    assert torch.allclose(y, _reference_int4_decode(obj), rtol=1e-4, atol=1e-6)
    assert rel_rms(y, x) < MAX_REL_RMS["int4"]


def test_int4_decoder_uses_the_seed_it_is_sent():
    x = gaussian((4, 256))
    obj = wire(x, "int4")
    other = {**obj, "seed": obj["seed"] + 1}
    assert torch.allclose(decode_tensor(other), _reference_int4_decode(other), rtol=1e-4, atol=1e-6)
    assert rel_rms(decode_tensor(other), x) > 0.5  # another rotation undoes nothing


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_error_on_a_16_mib_activation(codec):
    x = activation_like(4096)  # (32, 128, 1024): 16 MiB of float32 with outlier channels
    obj = wire(x, codec)
    if codec == "int8":
        assert obj["width"] == 1024  # one scale per channel per 128 tokens
    assert rel_rms(decode_tensor(obj), x) <= MAX_REL_RMS_ACTIVATIONS[codec]


def test_int8_columns_keep_outlier_channels_to_themselves():
    x = activation_like(512)  # (4, 128, 1024)
    columns = rel_rms(round_trip(x, "int8"), x)
    runs = rel_rms(round_trip(x.reshape(-1), "int8"), x.reshape(-1))  # 1-D: runs of 128 values
    assert columns <= MAX_REL_RMS_ACTIVATIONS["int8"] < runs, (columns, runs)


def test_compressed_wire_bytes_against_fp32():
    x = activation_like(1024)  # 4 MiB of float32
    fp32_bytes = len(pack_message({"t": encode_tensor(x, "fp32")}))
    assert fp32_bytes >= x.numel() * 4
    ratios = {codec: fp32_bytes / len(pack_message({"t": encode_tensor(x, codec)})) for codec in ("int8", "int4")}
    assert ratios["int8"] >= 3.9 and ratios["int4"] >= 7.5, ratios


def test_int8_wire_bytes_are_about_a_quarter_of_fp32():
    x = gaussian((256, 1024))  # 1 MiB of float32
    fp32_bytes = len(pack_message({"t": encode_tensor(x, "fp32")}))
    int8_bytes = len(pack_message({"t": encode_tensor(x, "int8")}))
    assert int8_bytes < 0.27 * fp32_bytes, int8_bytes / fp32_bytes


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1.0, 1e12, 1e30])
def test_scales_keep_the_float32_range(codec, scale):
    """bfloat16 scales: gradients of 1e-12 and activations of 1e30 keep their precision (fp16 scales would not)."""
    x = gaussian((300, 64)) * scale
    y = round_trip(x, codec)
    assert bool(torch.isfinite(y).all()) and rel_rms(y, x) < MAX_REL_RMS[codec]


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_zeros_decode_to_zeros(codec):
    x = torch.zeros(200, 64)
    x[:, :3] = gaussian((200, 3))  # some blocks all zero, others not
    y = round_trip(x, codec)
    assert rel_rms(y, x) < MAX_REL_RMS[codec]
    if codec == "int8":
        assert torch.equal(y[:, 3:], x[:, 3:])
    assert torch.equal(round_trip(torch.zeros(5, 7), codec), torch.zeros(5, 7))


@pytest.mark.parametrize("codec, block", [("int8", 128), ("int4", INT4_BLOCK)])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_spoils_only_its_block(codec, block, bad):
    x = gaussian((4, 256))  # 4 rows: runs of values for int8 too
    x[0, 3] = bad
    y = round_trip(x, codec).reshape(-1)
    assert not bool(torch.isfinite(y[3]))  # receivers refuse non-finite values: it must not turn finite
    assert bool(torch.isfinite(y[block:]).all())
    assert rel_rms(y[block:], x.reshape(-1)[block:]) < MAX_REL_RMS[codec]


@pytest.mark.parametrize("block", [64, 4096])
@pytest.mark.parametrize("shape", [(3, 333), (2, 8, 128), (0,), ()], ids=str)
@pytest.mark.parametrize("map_field", [None, "dynamic"])
def test_dynamic_int8_from_older_peers_still_decodes(block, shape, map_field):
    """An int8 map as peers before the linear map built it (no ``map`` field), and with ``"map": "dynamic"``."""
    x = gaussian(shape)
    flat = x.reshape(-1)
    if flat.numel():
        codes, state = bnbf.quantize_blockwise(flat, blocksize=block)
        absmax, expected = state.absmax, bnbf.dequantize_blockwise(codes, absmax=state.absmax, blocksize=block)
    else:
        codes, absmax, expected = flat.to(torch.uint8), torch.empty(0), flat
    old = {
        "codec": "int8",
        "dtype": "float32",
        "shape": list(shape),
        "data": codes.numpy().tobytes(),
        "absmax": absmax.numpy().tobytes(),
        "block": block,
    }
    assert {k: bytes(v) if isinstance(v, memoryview) else v for k, v in encode_int8_dynamic(x, block).items()} == old
    if map_field:
        old["map"] = map_field
    y = decode_tensor(unpack_message(pack_message({"t": old}))["t"])
    assert y.shape == x.shape and torch.equal(y, expected.reshape(shape))
    if x.numel():
        assert rel_rms(y, x) < 0.02


_INT_CODEC_FIELDS = {
    "map": ["linear", "dynamic", "cubic", "", None, 1, ["linear"]],
    "block": [64, 128, 4096, 32, 100, 0, -64, 2**70, 64.0, True, "64", None],
    "width": [1, 2, 3, 64, 0, -1, 2**62, 1.0, True, "1", None],
    "seed": [0, 1, 2**64 - 1, 2**64, -1, 0.0, False, "0", None],
    "shape": [[300], [3, 100], [0], [], [301], [2**31], [3, 0, 5]],
    "dtype": ["float32", "bfloat16", "int64"],
}


def _garbage_bytes(rng: random.Random, like: bytes) -> bytes:
    n = rng.choice([0, 1, 2, 3, len(like) - 1, len(like), len(like) + 1, 2 * len(like)])
    return bytes(rng.getrandbits(8) for _ in range(max(n, 0)))


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_garbage_int_maps_decode_or_raise_bad_payload(codec):
    """Random fields and bytes (NaN, negative and huge scales, wrong lengths): a tensor or BadPayload, nothing else."""
    rng, base = random.Random(codec), wire(gaussian((3, 100)), codec, **({"int8_block": 64} if codec == "int8" else {}))
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(400):
        obj = dict(base)
        for key in rng.sample(sorted(_INT_CODEC_FIELDS) + ["data", "absmax", "absmax", "data"], rng.randint(1, 3)):
            if key in ("data", "absmax"):
                obj[key] = _garbage_bytes(rng, base[key])
            else:
                obj[key] = rng.choice(_INT_CODEC_FIELDS[key])
        try:
            y = decode_tensor(obj)
        except BadPayload:
            outcomes["refused"] += 1
        else:
            assert list(y.shape) == obj["shape"]
            outcomes["decoded"] += 1
    assert outcomes["decoded"] > 20 and outcomes["refused"] > 100, outcomes


@pytest.mark.parametrize("codec", FLOAT_CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_receiver_restores_the_sender_dtype(codec, dtype):
    x = gaussian((4, 64)).to(dtype)
    y = round_trip(x, codec)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_rms(y.float(), x.float()) < max(MAX_REL_RMS[codec], 1e-2)


def test_decoded_tensor_owns_its_memory():
    x = gaussian((8, 8))
    y = round_trip(x, "fp32")
    y.add_(1.0)  # would fail (read-only buffer) or alias the message if not copied
    assert torch.equal(y, x + 1.0)


# --------------------------------------------------------------------------- integer tensors


INT_TENSORS = {
    "int64_token_ids": torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1)),
    "int64_extremes": torch.tensor([[-(2**63), -1, 0, 2**62, 2**63 - 1]]),
    "int32": torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32),
    "int16": torch.tensor([-5, 7], dtype=torch.int16),
    "uint8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
    "bool": torch.tensor([[True, False, True], [False, False, True]]),
    "int64_empty": torch.empty(0, 5, dtype=torch.int64),
    "int64_0d": torch.tensor(42),
}


@pytest.mark.parametrize("codec", FLOAT_CODECS)
@pytest.mark.parametrize("name", sorted(INT_TENSORS))
def test_integer_tensors_travel_raw_and_exact_whatever_codec(name, codec):
    x = INT_TENSORS[name]
    obj = wire(x, codec)
    assert obj["codec"] == "raw"
    assert obj["shape"] == list(x.shape)
    assert len(obj["data"]) == x.numel() * x.element_size()
    y = decode_tensor(obj)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, x)


# --------------------------------------------------------------------------- message framing


def test_large_tensor_round_trips_and_body_is_plain_msgpack():
    x = gaussian((4 * 2**20,))  # 16 MiB of float32
    body = pack_message({"stage": 2, "microbatch_id": "big", "t": encode_tensor(x, "fp32")})
    assert len(body) > x.numel() * 4
    # The packer writes the large bin itself: it must be ordinary msgpack bin32.
    assert b"\xc6" + (x.numel() * 4).to_bytes(4, "big") in body
    plain = msgpack.unpackb(body, raw=False)
    assert isinstance(plain, dict)
    assert plain["v"] == WIRE_VERSION and plain["stage"] == 2 and plain["microbatch_id"] == "big"
    assert isinstance(plain["t"]["data"], bytes) and len(plain["t"]["data"]) == x.numel() * 4
    assert torch.equal(decode_tensor(plain["t"]), x)
    assert torch.equal(decode_tensor(unpack_message(body)["t"]), x)


@pytest.mark.parametrize("nbytes", [0, 1, 255, 256, 65535, 65536, 65537, 300_000])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_pack_message_is_byte_identical_to_msgpack(nbytes, kind):
    """Around the bin8/bin16/bin32 and direct-write thresholds the body is what msgpack writes."""
    payload = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    msg = {"a": 1, "nested": {"blob": kind(payload), "list": [kind(payload), "s", 2.5, None, True]}}
    expected = msgpack.packb(
        {"v": WIRE_VERSION, "a": 1, "nested": {"blob": payload, "list": [payload, "s", 2.5, None, True]}},
        use_bin_type=True,
    )
    body = pack_message(msg)
    assert body == expected
    assert unpack_message(body)["nested"]["blob"] == payload


def test_pack_message_sets_the_wire_version():
    assert msgpack.unpackb(pack_message({"x": 1})) == {"v": WIRE_VERSION, "x": 1}


# --------------------------------------------------------------------------- encode refusals


def test_encode_refuses_unknown_codec_bad_block_and_float64():
    x = gaussian((4,))
    with pytest.raises(ValueError, match="unknown wire codec"):
        encode_tensor(x, "fp8")
    with pytest.raises(ValueError, match="unknown wire codec"):
        encode_tensor(x, "raw")
    with pytest.raises(ValueError, match="int8 block size 100"):
        encode_tensor(x, "int8", int8_block=100)
    with pytest.raises(ValueError, match="cannot travel"):
        encode_tensor(x.double(), "fp32")


# --------------------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize(
    "body, match",
    [
        pytest.param(b"", "not valid msgpack", id="empty"),
        pytest.param(b"\xc1", "not valid msgpack", id="reserved-byte"),
        pytest.param(b'{"v": 1}', "not valid msgpack", id="json"),
        pytest.param(msgpack.packb({"v": 1, "a": b"x" * 10})[:-3], "not valid msgpack", id="truncated"),
        pytest.param(msgpack.packb({"v": 1}) + msgpack.packb(1), "not valid msgpack", id="trailing-data"),
        pytest.param(msgpack.packb({"v": 1, 5: 2}), "not valid msgpack", id="int-map-key"),
        pytest.param(msgpack.packb([1, 2]), "must be a msgpack map, got list", id="array"),
        pytest.param(msgpack.packb(7), "must be a msgpack map, got int", id="int"),
        pytest.param(msgpack.packb("v"), "must be a msgpack map, got str", id="str"),
        pytest.param(msgpack.packb(None), "must be a msgpack map, got NoneType", id="nil"),
        pytest.param(msgpack.packb({"stage": 1}), "wire version None not supported", id="missing-v"),
        pytest.param(
            msgpack.packb({"v": WIRE_VERSION + 1}), f"wire version {WIRE_VERSION + 1} not supported", id="future-v"
        ),
        pytest.param(msgpack.packb({"v": 0}), "wire version 0 not supported", id="v0"),
        pytest.param(msgpack.packb({"v": str(WIRE_VERSION)}), "wire version '1' not supported", id="v-as-str"),
    ],
)
def test_unpack_message_refuses(body, match):
    with pytest.raises(BadPayload, match=match) as info:
        unpack_message(body)
    assert info.value.status == 400 and info.value.code == "bad_payload"
    assert info.value.to_json() == {"error": {"code": "bad_payload", "message": info.value.message}}


def _good(codec: str = "fp32", shape=(2, 3)) -> dict:
    return wire(gaussian(shape), codec)


def _good_int8(shape=(3, 100), block=64) -> dict:
    return wire(gaussian(shape), "int8", int8_block=block)


def _good_int8_columns(block=64) -> dict:
    obj = wire(gaussian((130, 4)), "int8", int8_block=block)
    assert obj["width"] == 4
    return obj


def _good_dynamic(shape=(3, 100), block=64) -> dict:
    return unpack_message(pack_message({"t": encode_int8_dynamic(gaussian(shape), block)}))["t"]


def _good_int4(shape=(3, 100)) -> dict:
    return wire(gaussian(shape), "int4")


_BF16_MINUS_ONE = torch.tensor([-1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
_FP32_MINUS_ONE = torch.tensor([-1.0]).view(torch.uint8).numpy().tobytes()


def _edit(obj: dict, **changes) -> dict:
    out = dict(obj)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()

BAD_TENSORS = [
    # not a map
    pytest.param(lambda: [1, 2, 3], "expected a tensor map, got list", id="not-a-map-list"),
    pytest.param(lambda: b"\x00" * 8, "expected a tensor map, got bytes", id="not-a-map-bytes"),
    pytest.param(lambda: None, "expected a tensor map, got NoneType", id="not-a-map-nil"),
    # codec
    pytest.param(lambda: _edit(_good(), codec="fp8"), "unknown codec 'fp8'", id="unknown-codec"),
    pytest.param(lambda: _edit(_good(), codec=_DROP), "unknown codec None", id="missing-codec"),
    pytest.param(lambda: _edit(_good(), codec="FP32"), "unknown codec 'FP32'", id="codec-wrong-case"),
    # dtype
    pytest.param(
        lambda: _edit(_good(), dtype="float64"), "codec fp32 carries floats, not 'float64'", id="unknown-float-dtype"
    ),
    pytest.param(lambda: _edit(_good(), dtype="complex64"), "carries floats, not 'complex64'", id="unknown-dtype"),
    pytest.param(lambda: _edit(_good(), dtype=_DROP), "dtype must be a string", id="missing-dtype"),
    pytest.param(
        lambda: _edit(_good("fp16"), dtype="int64"), "codec fp16 carries floats, not 'int64'", id="int-dtype-under-fp16"
    ),
    pytest.param(
        lambda: _edit(_good_int8(), dtype="int32"), "codec int8 carries floats, not 'int32'", id="int-dtype-under-int8"
    ),
    pytest.param(
        lambda: _edit(_good(), codec="raw"), "raw tensors carry integers, not 'float32'", id="float-dtype-under-raw"
    ),
    pytest.param(
        lambda: _edit(_good(), codec="raw", dtype="bfloat16"),
        "raw tensors carry integers, not 'bfloat16'",
        id="bf16-under-raw",
    ),
    pytest.param(
        lambda: _edit(_good(), codec="raw", dtype="uint64"),
        "raw tensors carry integers, not 'uint64'",
        id="unknown-int-dtype",
    ),
    # shape
    pytest.param(lambda: _edit(_good(), shape="2,3"), "shape must be a list", id="shape-str"),
    pytest.param(lambda: _edit(_good(), shape=6), "shape must be a list", id="shape-int"),
    pytest.param(lambda: _edit(_good(), shape=_DROP), "shape must be a list", id="shape-missing"),
    pytest.param(lambda: _edit(_good(), shape={"0": 2}), "shape must be a list", id="shape-map"),
    pytest.param(lambda: _edit(_good(), shape=[-2, -3]), "non-negative ints", id="shape-negative"),
    pytest.param(lambda: _edit(_good(), shape=[2, -1]), "non-negative ints", id="shape-minus-one"),
    pytest.param(lambda: _edit(_good(), shape=[2.0, 3.0]), "non-negative ints", id="shape-floats"),
    pytest.param(lambda: _edit(_good(), shape=[True, 6]), "non-negative ints", id="shape-bool"),
    pytest.param(lambda: _edit(_good(), shape=["2", "3"]), "non-negative ints", id="shape-strs"),
    pytest.param(lambda: _edit(_good(), shape=[1] * (MAX_NDIM + 1)), f"at most {MAX_NDIM}", id="shape-too-many-dims"),
    # data length / type
    pytest.param(lambda: _edit(_good(), shape=[2, 4]), "24 bytes for 8 values of fp32", id="data-short"),
    pytest.param(lambda: _edit(_good(), shape=[5]), "24 bytes for 5 values of fp32", id="data-long"),
    pytest.param(lambda: _edit(_good("fp16"), shape=[3, 3]), "12 bytes for 9 values of fp16", id="data-fp16-mismatch"),
    pytest.param(lambda: _edit(_good(), shape=[]), "24 bytes for 1 values", id="data-0d-mismatch"),
    pytest.param(
        lambda: _edit(wire(torch.arange(6), "fp32"), data=b"\x00" * 47),
        "47 bytes for 6 values of int64",
        id="raw-data-mismatch",
    ),
    pytest.param(lambda: _edit(_good(), data="abcdefgh"), "data must be bytes", id="data-str"),
    pytest.param(lambda: _edit(_good(), data=[0] * 24), "data must be bytes", id="data-list"),
    pytest.param(lambda: _edit(_good(), data=_DROP), "data must be bytes", id="data-missing"),
    pytest.param(lambda: _edit(_good(), data=None), "data must be bytes", id="data-nil"),
    # int8, linear map: (3, 100) in runs of 64 values (5 blocks), (130, 4) in columns (3 x 4 blocks)
    pytest.param(
        lambda: _edit(_good_int8(), map="cubic"), "int8 map must be one of .*got 'cubic'", id="int8-map-unknown"
    ),
    pytest.param(lambda: _edit(_good_int8(), map=1), "int8 map must be one of .*got 1", id="int8-map-int"),
    pytest.param(lambda: _edit(_good_int8(), map=None), "int8 map must be one of .*got None", id="int8-map-nil"),
    pytest.param(lambda: _edit(_good_int8(), block=100), "int8 block must be one of", id="int8-block-100"),
    pytest.param(lambda: _edit(_good_int8(), block=32), "int8 block must be one of", id="int8-block-32"),
    pytest.param(lambda: _edit(_good_int8(), block=_DROP), "int8 block must be one of", id="int8-block-missing"),
    pytest.param(lambda: _edit(_good_int8(), block="64"), "int8 block must be one of", id="int8-block-str"),
    pytest.param(lambda: _edit(_good_int8(), block=True), "int8 block must be one of", id="int8-block-bool"),
    pytest.param(
        lambda: _edit(_good_int8(block=64), block=128), "10 absmax bytes for 3 blocks", id="int8-block-changed"
    ),
    pytest.param(
        lambda: _edit(_good_int8(), width=_DROP),
        "int8 width must be a positive int dividing 300",
        id="int8-width-missing",
    ),
    pytest.param(lambda: _edit(_good_int8(), width=0), "int8 width must be a positive int", id="int8-width-0"),
    pytest.param(lambda: _edit(_good_int8(), width=-1), "int8 width must be a positive int", id="int8-width-negative"),
    pytest.param(
        lambda: _edit(_good_int8(), width=7),
        "int8 width must be a positive int dividing 300",
        id="int8-width-not-dividing",
    ),
    pytest.param(
        lambda: _edit(_good_int8(), width=600),
        "int8 width must be a positive int dividing 300",
        id="int8-width-too-wide",
    ),
    pytest.param(lambda: _edit(_good_int8(), width="1"), "int8 width must be a positive int", id="int8-width-str"),
    pytest.param(lambda: _edit(_good_int8(), width=1.0), "int8 width must be a positive int", id="int8-width-float"),
    pytest.param(lambda: _edit(_good_int8(), width=True), "int8 width must be a positive int", id="int8-width-bool"),
    pytest.param(lambda: _edit(_good_int8(), width=2), "10 absmax bytes for 6 blocks", id="int8-width-changed"),
    pytest.param(
        lambda: _edit(_good_int8_columns(), width=1),
        "24 absmax bytes for 9 blocks",
        id="int8-columns-width-dropped-to-1",
    ),
    pytest.param(
        lambda: _edit(_good_int8_columns(), width=2), "24 absmax bytes for 10 blocks", id="int8-columns-width-changed"
    ),
    pytest.param(
        lambda: _edit(_good_int8(), absmax=_good_int8()["absmax"][:-2]),
        "8 absmax bytes for 5 blocks .2 bytes each",
        id="int8-absmax-short",
    ),
    pytest.param(
        lambda: _edit(_good_int8(), absmax=_good_int8()["absmax"] + b"\0" * 2),
        "12 absmax bytes for 5 blocks",
        id="int8-absmax-long",
    ),
    pytest.param(
        lambda: _edit(_good_int8(), absmax=_good_int8()["absmax"][:-1]),
        "9 absmax bytes for 5 blocks",
        id="int8-absmax-odd-bytes",
    ),
    pytest.param(lambda: _edit(_good_int8(), absmax=b""), "0 absmax bytes for 5 blocks", id="int8-absmax-empty"),
    pytest.param(lambda: _edit(_good_int8(), absmax=[1.0] * 5), "int8 absmax must be bytes", id="int8-absmax-list"),
    pytest.param(lambda: _edit(_good_int8(), absmax=_DROP), "int8 absmax must be bytes", id="int8-absmax-missing"),
    pytest.param(
        lambda: _edit(_good_int8(), absmax=_BF16_MINUS_ONE + _good_int8()["absmax"][2:]),
        "int8 absmax holds negative values",
        id="int8-absmax-negative",
    ),
    pytest.param(lambda: _edit(_good_int8(), shape=[3, 101]), "300 int8 codes for 303 values", id="int8-codes-short"),
    pytest.param(lambda: _edit(_good_int8(), data=b"x"), "1 int8 codes for 300 values", id="int8-codes-wrong"),
    # a linear map read as dynamic (its map field dropped) is refused, not misread
    pytest.param(
        lambda: _edit(_good_int8(), map=_DROP),
        "10 absmax bytes for 5 blocks .4 bytes each",
        id="int8-linear-without-map",
    ),
    pytest.param(
        lambda: _edit(_good_int8_columns(block=64), map=_DROP),
        "24 absmax bytes for 9 blocks .4 bytes each",
        id="int8-columns-without-map",
    ),
    # int8, dynamic map (older peers)
    pytest.param(
        lambda: _edit(_good_dynamic(), block=128),
        "20 absmax bytes for 3 blocks .4 bytes each",
        id="dynamic-block-changed",
    ),
    pytest.param(
        lambda: _edit(_good_dynamic(), absmax=_good_dynamic()["absmax"][:-4]),
        "16 absmax bytes for 5 blocks",
        id="dynamic-absmax-short",
    ),
    pytest.param(
        lambda: _edit(_good_dynamic(), absmax=_good_dynamic()["absmax"][:-1]),
        "19 absmax bytes for 5 blocks",
        id="dynamic-absmax-odd-bytes",
    ),
    pytest.param(
        lambda: _edit(_good_dynamic(), absmax=_FP32_MINUS_ONE + _good_dynamic()["absmax"][4:]),
        "int8 absmax holds negative",
        id="dynamic-absmax-negative",
    ),
    pytest.param(
        lambda: _edit(_good_dynamic(), map="linear", width=1),
        "20 absmax bytes for 5 blocks .2 bytes each",
        id="dynamic-read-as-linear",
    ),
    pytest.param(
        lambda: _edit(_good_dynamic(), data=b"x" * 299), "299 int8 codes for 300 values", id="dynamic-codes-short"
    ),
    # int4: (3, 100) = 300 values in 5 blocks of 64 (the last one padded): 160 bytes of codes, 10 of absmax
    pytest.param(
        lambda: _edit(_good_int4(), dtype="int64"), "codec int4 carries floats, not 'int64'", id="int-dtype-under-int4"
    ),
    pytest.param(lambda: _edit(_good_int4(), block=32), "int4 block must be 64, got 32", id="int4-block-32"),
    pytest.param(lambda: _edit(_good_int4(), block=128), "int4 block must be 64, got 128", id="int4-block-128"),
    pytest.param(lambda: _edit(_good_int4(), block=64.0), "int4 block must be 64, got 64.0", id="int4-block-float"),
    pytest.param(lambda: _edit(_good_int4(), block="64"), "int4 block must be 64", id="int4-block-str"),
    pytest.param(lambda: _edit(_good_int4(), block=_DROP), "int4 block must be 64, got None", id="int4-block-missing"),
    pytest.param(lambda: _edit(_good_int4(), seed=_DROP), "int4 seed must be an int", id="int4-seed-missing"),
    pytest.param(lambda: _edit(_good_int4(), seed=-1), "int4 seed must be an int", id="int4-seed-negative"),
    pytest.param(lambda: _edit(_good_int4(), seed=2**64), "int4 seed must be an int", id="int4-seed-too-big"),
    pytest.param(lambda: _edit(_good_int4(), seed="0"), "int4 seed must be an int", id="int4-seed-str"),
    pytest.param(lambda: _edit(_good_int4(), seed=0.0), "int4 seed must be an int", id="int4-seed-float"),
    pytest.param(lambda: _edit(_good_int4(), seed=False), "int4 seed must be an int", id="int4-seed-bool"),
    pytest.param(
        lambda: _edit(_good_int4(), data=_good_int4()["data"][:-1]),
        "159 bytes of int4 codes for 300 values .5 blocks of 64",
        id="int4-codes-short",
    ),
    pytest.param(
        lambda: _edit(_good_int4(), data=_good_int4()["data"] + b"\x88"),
        "161 bytes of int4 codes for 300 values",
        id="int4-codes-long",
    ),
    pytest.param(lambda: _edit(_good_int4(), data=b""), "0 bytes of int4 codes for 300 values", id="int4-codes-empty"),
    pytest.param(
        lambda: _edit(_good_int4(), shape=[3, 200]),
        "160 bytes of int4 codes for 600 values .10 blocks",
        id="int4-shape-grown",
    ),
    pytest.param(
        lambda: _edit(_good_int4(), shape=[3, 107]),
        "160 bytes of int4 codes for 321 values .6 blocks",
        id="int4-shape-odd-numel",
    ),
    pytest.param(lambda: _edit(_good_int4(), shape=[0]), "160 bytes of int4 codes for 0 values", id="int4-shape-empty"),
    pytest.param(
        lambda: _edit(_good_int4(), absmax=_good_int4()["absmax"][:-2]),
        "8 absmax bytes for 5 blocks .2 bytes each",
        id="int4-absmax-short",
    ),
    pytest.param(
        lambda: _edit(_good_int4(), absmax=_good_int4()["absmax"] + b"\0"),
        "11 absmax bytes for 5 blocks",
        id="int4-absmax-odd-bytes",
    ),
    pytest.param(
        lambda: _edit(_good_int4(), absmax=_good_int4()["absmax"] * 2),
        "20 absmax bytes for 5 blocks",
        id="int4-absmax-long",
    ),
    pytest.param(lambda: _edit(_good_int4(), absmax=[1.0] * 5), "int4 absmax must be bytes", id="int4-absmax-list"),
    pytest.param(lambda: _edit(_good_int4(), absmax=_DROP), "int4 absmax must be bytes", id="int4-absmax-missing"),
    pytest.param(
        lambda: _edit(_good_int4(), absmax=_good_int4()["absmax"][:8] + _BF16_MINUS_ONE),
        "int4 absmax holds negative values",
        id="int4-absmax-negative",
    ),
]


@pytest.mark.parametrize("make, match", BAD_TENSORS)
def test_decode_tensor_refuses(make, match):
    with pytest.raises(BadPayload, match=match) as info:
        decode_tensor(make(), name="inputs")
    assert info.value.message.startswith("inputs: "), info.value.message
    assert info.value.status == 400 and info.value.code == "bad_payload"


def test_decode_tensor_names_the_field_and_enforces_max_numel():
    obj = _good(shape=(4, 4))
    with pytest.raises(BadPayload, match=r"^grad_outputs: 16 values exceed the limit of 15$"):
        decode_tensor(obj, name="grad_outputs", max_numel=15)
    assert decode_tensor(obj, max_numel=16).shape == (4, 4)
    # A huge claimed shape is refused before any allocation.
    with pytest.raises(BadPayload, match="exceed the limit"):
        decode_tensor(_edit(obj, shape=[2**31, 2**31]))


# --------------------------------------------------------------------------- inputs that once crashed the server


@pytest.mark.parametrize("codec", ["fp32", "raw"])
def test_decode_tensor_refuses_unhashable_dtype(codec):
    with pytest.raises(BadPayload):
        decode_tensor(_edit(_good(), codec=codec, dtype=["float32"]), name="inputs")


def test_decode_tensor_refuses_float_int8_block():
    with pytest.raises(BadPayload):
        decode_tensor(_edit(_good_int8(block=64), block=64.0), name="inputs")
