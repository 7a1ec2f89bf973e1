"""Unit tests of the wire codec (shared/codec.py), without HTTP.

Every tensor goes the whole way a request takes: ``encode_tensor`` -> ``pack_message`` ->
bytes -> ``unpack_message`` -> ``decode_tensor``.
"""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from shared import WIRE_VERSION
from shared.codec import (
    DEFAULT_INT8_BLOCK,
    FLOAT_CODECS,
    INT8_BLOCK_SIZES,
    MAX_NDIM,
    decode_tensor,
    encode_tensor,
    pack_message,
    unpack_message,
    warm_up,
)
from shared.errors import BadPayload

# Relative RMS error allowed per codec, on Gaussian float32 data.
MAX_REL_RMS = {"fp32": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8": 0.02}

# 0-d, empty, tiny, a (B, T, C) activation, and numels that are no multiple of the
# default int8 block (4096) nor of the smallest one (64).
SHAPES = [(), (0,), (3, 0, 5), (1,), (7,), (2, 3, 128), (4097,), (3, 1000)]


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


@pytest.mark.parametrize("block", INT8_BLOCK_SIZES)
def test_int8_every_block_size_on_a_ragged_numel(block):
    x = gaussian((3, 333), seed=block)  # 999 values: no multiple of any block size
    obj = wire(x, "int8", int8_block=block)
    assert obj["block"] == block
    assert len(obj["data"]) == x.numel()
    assert len(obj["absmax"]) == 4 * math.ceil(x.numel() / block)
    assert rel_rms(decode_tensor(obj), x) < MAX_REL_RMS["int8"]


def test_int8_default_block_and_absmax_per_block():
    x = gaussian((2 * DEFAULT_INT8_BLOCK + 1,))
    obj = wire(x, "int8")
    assert obj["block"] == DEFAULT_INT8_BLOCK
    absmax = torch.frombuffer(bytearray(obj["absmax"]), dtype=torch.float32)
    assert absmax.numel() == 3
    expected = torch.stack([b.abs().max() for b in x.split(DEFAULT_INT8_BLOCK)])
    assert torch.allclose(absmax, expected)


def test_int8_wire_bytes_are_about_a_quarter_of_fp32():
    x = gaussian((256, 1024))  # 1 MiB of float32
    fp32_bytes = len(pack_message({"t": encode_tensor(x, "fp32")}))
    int8_bytes = len(pack_message({"t": encode_tensor(x, "int8")}))
    assert fp32_bytes >= x.numel() * 4
    assert int8_bytes < 0.27 * fp32_bytes, int8_bytes / fp32_bytes


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
        {"v": WIRE_VERSION, "a": 1, "nested": {"blob": payload, "list": [payload, "s", 2.5, None, True]}}, use_bin_type=True
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
        pytest.param(b"{\"v\": 1}", "not valid msgpack", id="json"),
        pytest.param(msgpack.packb({"v": 1, "a": b"x" * 10})[:-3], "not valid msgpack", id="truncated"),
        pytest.param(msgpack.packb({"v": 1}) + msgpack.packb(1), "not valid msgpack", id="trailing-data"),
        pytest.param(msgpack.packb({"v": 1, 5: 2}), "not valid msgpack", id="int-map-key"),
        pytest.param(msgpack.packb([1, 2]), "must be a msgpack map, got list", id="array"),
        pytest.param(msgpack.packb(7), "must be a msgpack map, got int", id="int"),
        pytest.param(msgpack.packb("v"), "must be a msgpack map, got str", id="str"),
        pytest.param(msgpack.packb(None), "must be a msgpack map, got NoneType", id="nil"),
        pytest.param(msgpack.packb({"stage": 1}), "wire version None not supported", id="missing-v"),
        pytest.param(msgpack.packb({"v": WIRE_VERSION + 1}), f"wire version {WIRE_VERSION + 1} not supported", id="future-v"),
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
    pytest.param(lambda: _edit(_good(), dtype="float64"), "codec fp32 carries floats, not 'float64'", id="unknown-float-dtype"),
    pytest.param(lambda: _edit(_good(), dtype="complex64"), "carries floats, not 'complex64'", id="unknown-dtype"),
    pytest.param(lambda: _edit(_good(), dtype=_DROP), "dtype must be a string", id="missing-dtype"),
    pytest.param(lambda: _edit(_good("fp16"), dtype="int64"), "codec fp16 carries floats, not 'int64'", id="int-dtype-under-fp16"),
    pytest.param(lambda: _edit(_good_int8(), dtype="int32"), "codec int8 carries floats, not 'int32'", id="int-dtype-under-int8"),
    pytest.param(lambda: _edit(_good(), codec="raw"), "raw tensors carry integers, not 'float32'", id="float-dtype-under-raw"),
    pytest.param(lambda: _edit(_good(), codec="raw", dtype="bfloat16"), "raw tensors carry integers, not 'bfloat16'", id="bf16-under-raw"),
    pytest.param(lambda: _edit(_good(), codec="raw", dtype="uint64"), "raw tensors carry integers, not 'uint64'", id="unknown-int-dtype"),
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
        lambda: _edit(wire(torch.arange(6), "fp32"), data=b"\x00" * 47), "47 bytes for 6 values of int64", id="raw-data-mismatch"
    ),
    pytest.param(lambda: _edit(_good(), data="abcdefgh"), "data must be bytes", id="data-str"),
    pytest.param(lambda: _edit(_good(), data=[0] * 24), "data must be bytes", id="data-list"),
    pytest.param(lambda: _edit(_good(), data=_DROP), "data must be bytes", id="data-missing"),
    pytest.param(lambda: _edit(_good(), data=None), "data must be bytes", id="data-nil"),
    # int8 specifics
    pytest.param(lambda: _edit(_good_int8(), block=100), "int8 block must be one of", id="int8-block-100"),
    pytest.param(lambda: _edit(_good_int8(), block=32), "int8 block must be one of", id="int8-block-32"),
    pytest.param(lambda: _edit(_good_int8(), block=_DROP), "int8 block must be one of", id="int8-block-missing"),
    pytest.param(lambda: _edit(_good_int8(), block="64"), "int8 block must be one of", id="int8-block-str"),
    pytest.param(lambda: _edit(_good_int8(block=64), block=128), "absmax values for 3 blocks", id="int8-block-changed"),
    pytest.param(lambda: _edit(_good_int8(), absmax=_good_int8()["absmax"][:-4]), "4 absmax values for 5 blocks", id="int8-absmax-short"),
    pytest.param(lambda: _edit(_good_int8(), absmax=_good_int8()["absmax"] + b"\0" * 4), "6 absmax values for 5 blocks", id="int8-absmax-long"),
    pytest.param(lambda: _edit(_good_int8(), absmax=b""), "0 absmax values for 5 blocks", id="int8-absmax-empty"),
    pytest.param(lambda: _edit(_good_int8(), absmax=[1.0] * 5), "int8 absmax must be bytes", id="int8-absmax-list"),
    pytest.param(lambda: _edit(_good_int8(), absmax=_DROP), "int8 absmax must be bytes", id="int8-absmax-missing"),
    pytest.param(lambda: _edit(_good_int8(), shape=[3, 101]), "300 int8 codes for 303 values", id="int8-codes-short"),
    pytest.param(lambda: _edit(_good_int8(), data=b"x"), "1 int8 codes for 300 values", id="int8-codes-wrong"),
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
