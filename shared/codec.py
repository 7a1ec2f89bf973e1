"""Wire codec: tensors and messages as msgpack, with int8 and int4 blockwise compression.

A message is one msgpack map with a format version ``v``. A tensor travels as::

    {"codec": "fp32"|"fp16"|"bf16"|"int8"|"int4"|"raw", "dtype": "float32", "shape": [B, T, C],
     "data": <bytes>, ...codec fields}

- ``fp32``/``fp16``/``bf16``: the values cast to that type, little-endian bytes.
- ``int8`` with ``"map": "linear"`` (what this peer sends): blockwise absmax quantization.
  The tensor is viewed as ``(rows, width)`` (``width`` travels; a sender uses the last
  dimension when the tensor has at least ``block`` rows, so that a block is one channel
  across ``block`` tokens and outlier channels get scales of their own, else 1: plain
  runs of ``block`` values). Each column is cut into blocks of ``block`` rows (the last
  one may be shorter). ``absmax`` holds one bfloat16 per block, row-major over
  ``(ceil(rows / block), width)``; ``data`` one signed byte per value (-127..127, the
  tensor's order); a code ``c`` decodes to ``c * absmax / 127``.
- ``int8`` without ``map`` (or ``"map": "dynamic"``), as older peers send: bitsandbytes
  blockwise dynamic quantization, one uint8 code per value into bitsandbytes' default
  dynamic map and one float32 ``absmax`` per run of ``block`` values. Still decoded.
- ``int4``: the values, flattened and zero-padded to whole blocks of ``block`` (64), are
  rotated block by block: ``y = x @ R`` with ``R = diag(s) H / sqrt(block)``, ``H`` the
  Sylvester Hadamard matrix and ``s[i] = -1`` where bit ``i`` (little-endian bit order) of
  ``sha256(seed as 8 little-endian bytes)`` is set, else +1. The rotation spreads outliers
  over their block. ``absmax`` holds one bfloat16 per block, ``data`` one 4-bit code per
  rotated value, two per byte (even index in the low nibble): nibble ``q`` decodes to
  ``(q - 8) * absmax / 7`` (the sender writes 1..15), then ``x = y @ R.T``.
- ``raw``: integer tensors (token ids) as they are.

A block whose values are not all finite decodes to non-finite values (receivers refuse
those). ``dtype`` is the dtype the receiver restores. Large byte payloads are written next
to the msgpack framing instead of through msgpack's growing buffer, so packing a 16 MiB
activation costs one memcpy. Every decode validates what it reads and raises
:class:`BadPayload` with a message that says what is wrong.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from functools import lru_cache
from typing import Any

import msgpack
import torch

from shared import WIRE_VERSION
from shared.errors import BadPayload

FLOAT_CODECS = ("fp32", "fp16", "bf16", "int8", "int4")
CODECS = FLOAT_CODECS + ("raw",)
INT8_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_INT8_BLOCK = 128
INT8_MAPS = ("linear", "dynamic")
INT4_BLOCK = 64
INT4_SEED = 0
MAX_NDIM = 8

_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_INT_DTYPES = {
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_CAST_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in {**_FLOAT_DTYPES, **_INT_DTYPES}.items()}

# Byte strings at least this long bypass msgpack's buffer (see module docstring).
_DIRECT_BIN_BYTES = 64 * 1024
# (De)quantization goes about this many values at a time, so its float32 scratch stays in cache.
_STEP_VALUES = 1 << 17
# A block is scaled by at least this absmax, so that levels / absmax stays finite.
_MIN_ABSMAX = 2.0**-120


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    """A zero-copy view of a CPU tensor's bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy())


def warm_up() -> None:
    """Import bitsandbytes now rather than on the first dynamic-map int8 tensor. It takes about
    2 s of CPU here (it imports torch's compiler stack), as much again as a stage server's own
    start, so servers don't: this peer sends linear maps, and only a peer of an older version
    sends dynamic ones, whose first decode in a process pays the import."""
    _dynamic_map("cpu")


@lru_cache(maxsize=8)
def _dynamic_map(device: str) -> torch.Tensor:
    import bitsandbytes.functional as bnbf  # imported lazily: it takes seconds

    return bnbf.create_dynamic_map().to(device)


def encode_tensor(t: torch.Tensor, codec: str, *, int8_block: int = DEFAULT_INT8_BLOCK) -> dict:
    """Encode ``t`` for the wire. Integer and bool tensors always travel ``raw``."""
    if not t.is_floating_point():
        return {"codec": "raw", "dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": _as_bytes_view(t)}
    if codec not in FLOAT_CODECS:
        raise ValueError(f"unknown wire codec {codec!r}; choose one of {FLOAT_CODECS}")
    out: dict[str, Any] = {"codec": codec, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    t = t.detach()
    if codec == "int8":
        if int8_block not in INT8_BLOCK_SIZES:
            raise ValueError(f"int8 block size {int8_block} not in {INT8_BLOCK_SIZES}")
        width = _int8_width(t.shape, int8_block)
        codes, absmax = _quantize_int8(t.reshape(-1, width), int8_block)
        out.update(map="linear", data=_as_bytes_view(codes), absmax=_as_bytes_view(absmax), block=int8_block)
        out["width"] = width
    elif codec == "int4":
        codes, absmax = _quantize_int4(t, INT4_SEED)
        out.update(data=_as_bytes_view(codes), absmax=_as_bytes_view(absmax), block=INT4_BLOCK, seed=INT4_SEED)
    else:
        out["data"] = _as_bytes_view(t.to(_CAST_DTYPE[codec]))
    return out


def encode_int8_dynamic(t: torch.Tensor, block: int = 4096) -> dict:
    """A float tensor as a dynamic-map ``int8`` map (bitsandbytes blockwise dynamic quantization,
    no ``map`` field): what older peers send, decoded by :func:`decode_tensor`."""
    flat = t.detach().reshape(-1).float().contiguous()
    if flat.numel() == 0:
        codes, absmax = flat.to(torch.uint8), torch.empty(0, dtype=torch.float32)
    else:
        import bitsandbytes.functional as bnbf

        codes, state = bnbf.quantize_blockwise(flat, blocksize=block)
        absmax = state.absmax
    out = {"codec": "int8", "dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": _as_bytes_view(codes)}
    return {**out, "absmax": _as_bytes_view(absmax.float()), "block": block}


# --------------------------------------------------------------------------- quantizers


def _int8_width(shape: torch.Size, block: int) -> int:
    """The last dimension when the tensor has at least ``block`` rows of it (a block is then one
    channel across tokens: outlier channels get scales of their own), else 1 (runs of values)."""
    numel = math.prod(shape)
    return shape[-1] if len(shape) >= 2 and shape[-1] and numel // shape[-1] >= block else 1


def _spans(rows: int, block: int, width: int) -> list[tuple[int, int, int]]:
    """``(start, stop, b)`` row ranges of whole blocks of ``b`` rows covering ``rows``: blocks of
    ``block`` rows, about ``_STEP_VALUES`` values a range, then the shorter last block if any."""
    full = rows - rows % block
    step = block * max(1, _STEP_VALUES // (block * width))
    spans = [(start, min(start + step, full), block) for start in range(0, full, step)]
    return spans + ([(full, rows, rows - full)] if full < rows else [])


def _absmax_into(v: torch.Tensor, scratch: torch.Tensor, out: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``out`` = max |v| over ``dim`` (kept), at least ``_MIN_ABSMAX``; NaN stays NaN. ``scratch``: like ``v``."""
    return torch.amax(torch.abs(v, out=scratch), dim, keepdim=True, out=out).clamp_(min=_MIN_ABSMAX)


def _blocks_of(t: torch.Tensor, b: int) -> torch.Tensor:
    """A span of whole blocks of ``b`` rows, ``(n * b, width)``: as it is when it is one block
    (2-D arithmetic is the fast path), else ``(n, b, width)``."""
    return t if t.shape[0] == b else t.view(-1, b, t.shape[1])


def _quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear int8 codes ``(rows, width)`` and bfloat16 absmax ``(ceil(rows / block), width)`` of
    ``x`` ``(rows, width)``, blocks running down the columns."""
    rows, width = x.shape
    codes = torch.empty((rows, width), dtype=torch.int8, device=x.device)
    absmax = torch.empty((-(-rows // block), width), device=x.device)
    spans = _spans(rows, block, width)
    scratch = torch.empty(max((stop - start) * width for start, stop, _ in spans) if spans else 0, device=x.device)
    levels = torch.empty(
        max((stop - start) // b for start, stop, b in spans) * width if spans else 0, device=x.device
    )  # 127 / absmax
    for start, stop, b in spans:
        v = _blocks_of(x[start:stop].float(), b)  # (b, width) or (blocks, b, width)
        q = scratch[: v.numel()].view(v.shape)
        scales = absmax[start // block : start // block + (stop - start) // b]  # (blocks, width)
        a = _absmax_into(v, q, scales if v.dim() == 2 else scales.unsqueeze(1), dim=v.dim() - 2)
        inv = torch.reciprocal(a, out=levels[: a.numel()].view(a.shape)).mul_(127.0)
        _blocks_of(codes[start:stop], b).copy_(torch.mul(v, inv, out=q).round_())
    return codes, absmax.to(torch.bfloat16)


def _dequantize_int8(codes: torch.Tensor, absmax: torch.Tensor, block: int) -> torch.Tensor:
    """Float32 ``(rows, width)`` from linear int8 ``codes`` and float32 ``absmax`` (see ``_quantize_int8``)."""
    rows, width = codes.shape
    out = torch.empty((rows, width), device=codes.device)
    scale = absmax / 127.0  # (blocks, width)
    for start, stop, b in _spans(rows, block, width):
        o = _blocks_of(out[start:stop], b)
        s = scale[start // block : start // block + (stop - start) // b]
        torch.mul(
            _blocks_of(codes[start:stop], b), s if o.dim() == 2 else s.unsqueeze(1), out=o
        )  # int8 x float32: one pass
    return out


@lru_cache(maxsize=8)
def _rotation(seed: int, block: int, device: str) -> torch.Tensor:
    """``diag(s) H / sqrt(block)``: orthogonal, with the signs ``s`` drawn from ``seed`` (module docstring)."""
    bits = int.from_bytes(hashlib.sha256(seed.to_bytes(8, "little")).digest(), "little")
    signs = torch.tensor([-1.0 if bits >> i & 1 else 1.0 for i in range(block)])
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (signs[:, None] * h / math.sqrt(block)).to(device)


def _quantize_int4(t: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 codes ``(blocks, INT4_BLOCK // 2)`` and bfloat16 absmax ``(blocks, 1)`` of ``t``'s
    values, rotated block by block."""
    x = t.reshape(-1)
    if x.numel() % INT4_BLOCK:
        x = torch.nn.functional.pad(x, (0, -x.numel() % INT4_BLOCK))
    x = x.view(-1, INT4_BLOCK)  # (blocks, INT4_BLOCK)
    nblocks, rotation, step = x.shape[0], _rotation(seed, INT4_BLOCK, str(t.device)), _STEP_VALUES // INT4_BLOCK
    codes = torch.empty((nblocks, INT4_BLOCK // 2), dtype=torch.uint8, device=t.device)
    absmax = torch.empty((nblocks, 1), device=t.device)
    scratch = torch.empty((2, min(step, nblocks), INT4_BLOCK), device=t.device)
    for start in range(0, nblocks, step):
        y, tmp = scratch[:, : min(step, nblocks - start)]
        torch.matmul(x[start : start + step].float(), rotation, out=y)
        y.mul_(7.0 / _absmax_into(y, tmp, absmax[start : start + step])).round_()  # -7..7
        pairs = y.view(-1, INT4_BLOCK // 2, 2)
        codes[start : start + step].copy_(torch.add(pairs[..., 0], pairs[..., 1], alpha=16).add_(8 + 16 * 8))
    return codes, absmax.to(torch.bfloat16)


def _dequantize_int4(codes: torch.Tensor, absmax: torch.Tensor, seed: int) -> torch.Tensor:
    """Float32 ``(blocks * INT4_BLOCK,)`` from packed int4 ``codes`` and float32 ``absmax`` (see ``_quantize_int4``)."""
    nblocks, rotation, step = codes.shape[0], _rotation(seed, INT4_BLOCK, str(codes.device)), _STEP_VALUES // INT4_BLOCK
    out = torch.empty((nblocks, INT4_BLOCK), device=codes.device)
    scale = absmax / 7.0  # (blocks, 1)
    scratch = torch.empty((min(step, nblocks), INT4_BLOCK // 2, 2), device=codes.device)
    for start in range(0, nblocks, step):
        packed, y = codes[start : start + step], scratch[: min(step, nblocks - start)]
        y[..., 0].copy_(packed & 15)
        y[..., 1].copy_(packed >> 4)
        y = y.view(-1, INT4_BLOCK).sub_(8).mul_(scale[start : start + step])
        torch.matmul(y, rotation.T, out=out[start : start + step])
    return out.view(-1)


# --------------------------------------------------------------------------- decoding


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise BadPayload(message)


def _frombuffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffer: we never write into it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)


def decode_tensor(
    obj: Any, *, name: str = "tensor", max_numel: int = 1 << 31, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Decode and validate one wire tensor; raises :class:`BadPayload` on anything malformed."""
    _require(isinstance(obj, dict), f"{name}: expected a tensor map, got {type(obj).__name__}")
    codec, dtype_s, shape, data = (obj.get(k) for k in ("codec", "dtype", "shape", "data"))
    _require(isinstance(codec, str) and codec in CODECS, f"{name}: unknown codec {codec!r}")
    _require(isinstance(dtype_s, str), f"{name}: dtype must be a string, got {type(dtype_s).__name__}")
    _require(
        isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape),
        f"{name}: shape must be a list of at most {MAX_NDIM} non-negative ints",
    )
    _require(isinstance(data, bytes), f"{name}: data must be bytes")
    numel = math.prod(shape)
    _require(numel <= max_numel, f"{name}: {numel} values exceed the limit of {max_numel}")
    if codec == "raw":
        _require(dtype_s in _INT_DTYPES, f"{name}: raw tensors carry integers, not {dtype_s!r}")
        dtype = _INT_DTYPES[dtype_s]
        _require(len(data) == numel * dtype.itemsize, f"{name}: {len(data)} bytes for {numel} values of {dtype_s}")
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        return _frombuffer(data, wire_dtype).view(dtype).reshape(shape).to(device, copy=True)
    _require(dtype_s in _FLOAT_DTYPES, f"{name}: codec {codec} carries floats, not {dtype_s!r}")
    dtype = _FLOAT_DTYPES[dtype_s]
    if codec == "int8":
        return _decode_int8(obj, name, numel, device).reshape(shape).to(dtype)
    if codec == "int4":
        return _decode_int4(obj, name, numel, device)[:numel].reshape(shape).to(dtype)
    cast = _CAST_DTYPE[codec]
    _require(len(data) == numel * cast.itemsize, f"{name}: {len(data)} bytes for {numel} values of {codec}")
    return _frombuffer(data, cast).reshape(shape).to(device=device, dtype=dtype, copy=True)


def _read_absmax(obj: dict, count: int, dtype: torch.dtype, name: str, codec: str) -> torch.Tensor:
    """The ``count`` block absmax values of ``obj`` as float32; they must be bytes of ``dtype``, not negative."""
    raw = obj.get("absmax")
    _require(isinstance(raw, bytes), f"{name}: {codec} absmax must be bytes")
    size = dtype.itemsize
    _require(len(raw) == size * count, f"{name}: {len(raw)} absmax bytes for {count} blocks ({size} bytes each)")
    absmax = _frombuffer(raw, dtype).float()
    _require(not bool((absmax < 0).any()), f"{name}: {codec} absmax holds negative values")
    return absmax


def _decode_int8(obj: dict, name: str, numel: int, device) -> torch.Tensor:
    block, kind = obj.get("block"), obj.get("map", "dynamic")
    _require(isinstance(kind, str) and kind in INT8_MAPS, f"{name}: int8 map must be one of {INT8_MAPS}, got {kind!r}")
    _require(type(block) is int and block in INT8_BLOCK_SIZES, f"{name}: int8 block must be one of {INT8_BLOCK_SIZES}")
    _require(len(obj["data"]) == numel, f"{name}: {len(obj['data'])} int8 codes for {numel} values")
    if kind == "linear":
        width = obj.get("width")
        ok = type(width) is int and width >= 1 and numel % width == 0
        _require(ok, f"{name}: int8 width must be a positive int dividing {numel} values")
        rows = numel // width
        absmax = _read_absmax(obj, -(-rows // block) * width, torch.bfloat16, name, "int8").to(device)
        codes = _frombuffer(obj["data"], torch.int8).to(device)
        return _dequantize_int8(codes.view(rows, width), absmax.view(-1, width), block)
    absmax = _read_absmax(obj, -(-numel // block), torch.float32, name, "int8").to(device)
    if numel == 0:
        return torch.empty(0, device=device)
    import bitsandbytes.functional as bnbf

    codes = _frombuffer(obj["data"], torch.uint8).to(device)
    return bnbf.dequantize_blockwise(codes, absmax=absmax, code=_dynamic_map(str(codes.device)), blocksize=block)


def _decode_int4(obj: dict, name: str, numel: int, device) -> torch.Tensor:
    block, seed, data = obj.get("block"), obj.get("seed"), obj["data"]
    _require(type(block) is int and block == INT4_BLOCK, f"{name}: int4 block must be {INT4_BLOCK}, got {block!r}")
    _require(type(seed) is int and 0 <= seed < 2**64, f"{name}: int4 seed must be an int in [0, 2**64)")
    nblocks = -(-numel // block)
    expected = f"{numel} values ({nblocks} blocks of {block})"
    _require(len(data) == nblocks * block // 2, f"{name}: {len(data)} bytes of int4 codes for {expected}")
    absmax = _read_absmax(obj, nblocks, torch.bfloat16, name, "int4").to(device)
    codes = _frombuffer(data, torch.uint8).to(device)
    return _dequantize_int4(codes.view(nblocks, block // 2), absmax.view(nblocks, 1), seed)


def pack_message(msg: dict) -> bytes:
    """Pack a message map (``v`` is set here) into one msgpack body."""
    chunks: list = []
    _pack_into({"v": WIRE_VERSION, **msg}, chunks, msgpack.Packer(use_bin_type=True, autoreset=True))
    return b"".join(chunks)


def _pack_into(obj: Any, chunks: list, packer: msgpack.Packer) -> None:
    if isinstance(obj, dict):
        chunks.append(packer.pack_map_header(len(obj)))
        for key, value in obj.items():
            chunks.append(packer.pack(key))
            _pack_into(value, chunks, packer)
    elif isinstance(obj, (list, tuple)):
        chunks.append(packer.pack_array_header(len(obj)))
        for item in obj:
            _pack_into(item, chunks, packer)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        nbytes = obj.nbytes if isinstance(obj, memoryview) else len(obj)
        if nbytes < _DIRECT_BIN_BYTES:
            chunks.append(packer.pack(bytes(obj)))
        else:  # msgpack bin32: 0xc6, 4-byte big-endian length, then the bytes themselves
            chunks.append(b"\xc6" + nbytes.to_bytes(4, "big"))
            chunks.append(obj)
    else:
        chunks.append(packer.pack(obj))


def unpack_message(body: bytes) -> dict:
    """Unpack and check one message body: a msgpack map with a supported ``v``."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadPayload(f"body is not valid msgpack: {exc}") from None
    _require(isinstance(msg, dict), f"body must be a msgpack map, got {type(msg).__name__}")
    version = msg.get("v")
    _require(
        type(version) is int and version == WIRE_VERSION,
        f"wire version {version!r} not supported (this peer speaks v{WIRE_VERSION})",
    )
    return msg
