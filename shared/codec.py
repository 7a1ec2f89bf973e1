"""Wire codec: tensors and messages as msgpack, with int8 blockwise compression.

A message is one msgpack map with a format version ``v``. A tensor travels as::

    {"codec": "fp32"|"fp16"|"bf16"|"int8"|"raw", "dtype": "float32", "shape": [B, T, C],
     "data": <bytes>, ...codec fields}

- ``fp32``/``fp16``/``bf16``: the values cast to that type, little-endian bytes.
- ``int8``: bitsandbytes blockwise dynamic quantization: one uint8 code per value
  (``data``), one fp32 absmax per block of ``block`` values (``absmax``); the code map is
  bitsandbytes' default dynamic map, so only codes, absmax, block size and shape travel.
- ``raw``: integer tensors (token ids) as they are.

``dtype`` is the dtype the receiver restores. Large byte payloads are written next to the
msgpack framing instead of through msgpack's growing buffer, so packing a 16 MiB
activation costs one memcpy. Every decode validates what it reads and raises
:class:`BadPayload` with a message that says what is wrong.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache
from typing import Any

import msgpack
import torch

from shared import WIRE_VERSION
from shared.errors import BadPayload

FLOAT_CODECS = ("fp32", "fp16", "bf16", "int8")
CODECS = FLOAT_CODECS + ("raw",)
INT8_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_INT8_BLOCK = 4096
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
    """Import bitsandbytes now (it takes seconds) rather than on the first int8 request."""
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
    if codec == "int8":
        if int8_block not in INT8_BLOCK_SIZES:
            raise ValueError(f"int8 block size {int8_block} not in {INT8_BLOCK_SIZES}")
        flat = t.detach().reshape(-1).float().contiguous()
        if flat.numel() == 0:
            codes, absmax = flat.to(torch.uint8), torch.empty(0, dtype=torch.float32)
        else:
            import bitsandbytes.functional as bnbf

            codes, state = bnbf.quantize_blockwise(flat, blocksize=int8_block)
            absmax = state.absmax
        out.update(data=_as_bytes_view(codes), absmax=_as_bytes_view(absmax.float()), block=int8_block)
    else:
        out["data"] = _as_bytes_view(t.detach().to(_CAST_DTYPE[codec]))
    return out


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise BadPayload(message)


def _frombuffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffer: we never write into it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)


def decode_tensor(obj: Any, *, name: str = "tensor", max_numel: int = 1 << 31, device: str | torch.device = "cpu") -> torch.Tensor:
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
        return _decode_int8(obj, name, numel, shape, device).to(dtype)
    cast = _CAST_DTYPE[codec]
    _require(len(data) == numel * cast.itemsize, f"{name}: {len(data)} bytes for {numel} values of {codec}")
    return _frombuffer(data, cast).reshape(shape).to(device=device, dtype=dtype, copy=True)


def _decode_int8(obj: dict, name: str, numel: int, shape: list, device) -> torch.Tensor:
    block, absmax = obj.get("block"), obj.get("absmax")
    _require(type(block) is int and block in INT8_BLOCK_SIZES, f"{name}: int8 block must be one of {INT8_BLOCK_SIZES}")
    _require(isinstance(absmax, bytes), f"{name}: int8 absmax must be bytes")
    _require(len(obj["data"]) == numel, f"{name}: {len(obj['data'])} int8 codes for {numel} values")
    nblocks = -(-numel // block)
    _require(len(absmax) == 4 * nblocks, f"{name}: {len(absmax) // 4} absmax values for {nblocks} blocks")
    if numel == 0:
        return torch.empty(shape, dtype=torch.float32, device=device)
    import bitsandbytes.functional as bnbf

    codes = _frombuffer(obj["data"], torch.uint8).to(device)
    scales = _frombuffer(absmax, torch.float32).to(device)
    out = bnbf.dequantize_blockwise(codes, absmax=scales, code=_dynamic_map(str(codes.device)), blocksize=block)
    return out.reshape(shape)


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
    _require(type(version) is int and version == WIRE_VERSION, f"wire version {version!r} not supported (this peer speaks v{WIRE_VERSION})")
    return msg
