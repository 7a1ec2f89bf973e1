"""Bench 1, codec: every wire codec's encode+decode speed, error and bytes on the wire.

One round trip is what a hop pays: ``encode_tensor`` + ``pack_message`` on one side,
``unpack_message`` + ``decode_tensor`` on the other. Speed is fp32 megabytes (1e6 bytes)
of activation per second of round trip, one thread, against a plain copy of the same
tensor (``torch.Tensor.copy_``: what moving the bytes costs at least). Tensors are
activation-like: (batch, seq, 1024) Gaussian values with a log-normal scale per channel
and a few outlier channels 20x larger, as transformer hidden states have. Besides every
codec this peer sends, the dynamic-map int8 that older peers send (bitsandbytes blockwise
dynamic quantization) is measured as a row of its own, and hivemind's 8-bit blockwise
serialization the same way where hivemind is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import hivemind_expert
from bench.report import NOT_INSTALLED, BenchResult
from shared.codec import (
    FLOAT_CODECS,
    decode_tensor,
    encode_int8_dynamic,
    encode_tensor,
    pack_message,
    unpack_message,
    warm_up,
)

WIDTH = 1024
FULL_TOKENS = (100, 512, 2048, 4096, 8192)  # x 1024 x 4 bytes: 0.4, 2, 8, 16, 32 MiB of fp32
QUICK_TOKENS = (100, 512)
# glibc keeps freed buffers up to 32 MiB for reuse instead of unmapping them (see run's notes)
RECYCLE_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"
COLUMNS = ["MiB", "codec", "MB/s", "x memcpy", "rel. error", "error if Gaussian", "wire bytes", "fp32/wire"]
DYNAMIC_INT8 = "int8 (bitsandbytes dynamic)"
DYNAMIC_BLOCK = 4096  # what older peers sent by default


def activation_like(tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.6 * torch.randn(WIDTH, generator=gen))
    scale[torch.randperm(WIDTH, generator=gen)[: WIDTH // 200]] *= 20.0  # outlier channels
    seq = min(tokens, 128)
    return torch.randn(tokens // seq, seq, WIDTH, generator=gen) * scale  # (B, T, C)


def timed(fn, min_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of ``fn()`` over at least ``min_reps`` calls and ``min_s`` seconds."""
    fn()  # first call: allocations, lazy imports
    times, started = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - started < min_s and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def round_trip(x: torch.Tensor, codec: str) -> tuple[torch.Tensor, int]:
    body = pack_message({"t": encode_tensor(x, codec)})
    return decode_tensor(unpack_message(body)["t"]), len(body)


def dynamic_int8_round_trip(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    body = pack_message({"t": encode_int8_dynamic(x, DYNAMIC_BLOCK)})
    return decode_tensor(unpack_message(body)["t"]), len(body)


def hivemind_round_trip():
    """hivemind's 8-bit blockwise round trip through bytes, or None where it is not installed."""
    if not hivemind_expert.installed():
        return None
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    hivemind_expert.use_blockwise_decode_fix()

    def trip(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        body = serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT).SerializeToString()
        return deserialize_torch_tensor(runtime_pb2.Tensor.FromString(body)), len(body)

    return trip


def rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y.float()).norm() / x.norm())


def measure(quick: bool) -> list[dict]:
    """The table's rows, measured in this process."""
    torch.set_num_threads(1)
    min_s = 0.05 if quick else 0.4
    warm_up()
    hivemind = hivemind_round_trip()
    rows = []
    for tokens in QUICK_TOKENS if quick else FULL_TOKENS:
        x = activation_like(tokens)
        gaussian = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
        nbytes = x.numel() * 4
        out = torch.empty_like(x)
        copy_s, clone_s = timed(lambda out=out, x=x: out.copy_(x), min_s), timed(lambda x=x: x.clone(), min_s)
        base = {"MiB": round(nbytes / 2**20, 2)}
        rows.append(
            {
                **base,
                "codec": "memcpy",
                "MB/s": nbytes / copy_s / 1e6,
                "x memcpy": 1.0,
                "rel. error": 0.0,
                "error if Gaussian": 0.0,
                "wire bytes": nbytes,
                "fp32/wire": 1.0,
            }
        )
        rows.append(
            {
                **base,
                "codec": "memcpy, new buffer",
                "MB/s": nbytes / clone_s / 1e6,
                "x memcpy": copy_s / clone_s,
                "rel. error": 0.0,
                "error if Gaussian": 0.0,
                "wire bytes": nbytes,
                "fp32/wire": 1.0,
            }
        )
        trips = [(codec, lambda x, c=codec: round_trip(x, c)) for codec in FLOAT_CODECS] + [
            (DYNAMIC_INT8, dynamic_int8_round_trip)
        ]
        trips += [("hivemind 8-bit", hivemind)] if hivemind else []
        for codec, trip in trips:
            seconds = timed(lambda trip=trip, x=x: trip(x), min_s)
            y, wire = trip(x)
            rows.append(
                {
                    **base,
                    "codec": codec,
                    "MB/s": nbytes / seconds / 1e6,
                    "x memcpy": copy_s / seconds,
                    "rel. error": rel_error(x, y),
                    "error if Gaussian": rel_error(gaussian, trip(gaussian)[0]),
                    "wire bytes": wire,
                    "fp32/wire": nbytes / wire,
                }
            )
    if hivemind is None:
        rows.append({"MiB": "all", "codec": "hivemind 8-bit", **{c: NOT_INSTALLED for c in COLUMNS[2:]}})
    return rows


def _measure_in_child(ctx, env: dict[str, str], name: str) -> list[dict]:
    """``measure`` in a fresh process: the allocator's state (which decides whether a large
    buffer is new memory or recycled) then depends on this bench alone, not on what ran before."""
    out = ctx.logs("codec") / f"{name}.json"
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    args = [sys.executable, "-m", "bench.codec", "--measure", str(out)] + (["--quick"] if ctx.quick else [])
    pythonpath = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")) if p
    )
    result = subprocess.run(
        args,
        env={**clean, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"codec measurement ({name}) failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def run(ctx) -> BenchResult:
    rows = _measure_in_child(ctx, {}, "default")
    recycled = {
        (r["MiB"], r["codec"]): r["MB/s"]
        for r in _measure_in_child(ctx, {"GLIBC_TUNABLES": RECYCLE_TUNABLES}, "recycled")
    }
    for row in rows:
        row["MB/s, buffers recycled"] = recycled.get((row["MiB"], row["codec"]))
    int8, int4, dynamic = ([r for r in rows if r["codec"] == codec] for codec in ("int8", "int4", DYNAMIC_INT8))
    summary = {
        "int8_MBps_largest": int8[-1]["MB/s"],
        "int8_MBps_largest_recycled": int8[-1]["MB/s, buffers recycled"],
        "int8_rel_error_max": max(r["rel. error"] for r in int8),
        "int8_fp32_over_wire_min": min(r["fp32/wire"] for r in int8),
        "int8_dynamic_MBps_largest": dynamic[-1]["MB/s"],
        "int8_dynamic_rel_error_max": max(r["rel. error"] for r in dynamic),
        "int4_MBps_largest": int4[-1]["MB/s"],
        "int4_rel_error_max": max(r["rel. error"] for r in int4),
        "int4_fp32_over_wire_min": min(r["fp32/wire"] for r in int4),
        "hivemind": NOT_INSTALLED if any(r["MB/s"] == NOT_INSTALLED for r in rows) else "measured",
    }
    notes = [
        "MB/s: fp32 megabytes (1e6 B) of activation per second of encode+pack+unpack+decode, 1 thread, as the services "
        "run (glibc's default malloc); x memcpy: that speed over a plain tensor copy's into a buffer allocated "
        "beforehand; memcpy, new buffer: the copy into freshly allocated memory (Tensor.clone)",
        f"MB/s, buffers recycled: the same in a process started with GLIBC_TUNABLES={RECYCLE_TUNABLES}, where freed "
        "buffers of up to 32 MiB are reused instead of being returned to the kernel and faulted in again page by page",
        (
            "rel. error: ||x - decoded|| / ||x|| on the activation-like tensor; error "
            "if Gaussian: the same on N(0, 1) values of the same shape; wire bytes: the "
            "whole msgpack body; fp32/wire: how many times fewer bytes than raw fp32"
        ),
        "int8: linear blockwise absmax quantization, one bfloat16 absmax per block of 128 tokens of one channel "
        "(blocks down the columns), or per run of 128 values when the tensor has fewer than 128 rows (the 0.39 MiB "
        "row: 100 tokens); int4: a seeded Hadamard rotation per block of 64 values, then 4-bit absmax quantization "
        "with one bfloat16 absmax per block",
        (
            f"{DYNAMIC_INT8}: the int8 older peers send, still decoded: bitsandbytes blockwise dynamic quantization "
            f"(block {DYNAMIC_BLOCK}, one fp32 absmax per block)"
        ),
    ]
    if hivemind_expert.installed():
        notes.append(
            "hivemind 8-bit: hivemind's serialize_torch_tensor with BLOCKWISE_8BIT (bitsandbytes' dynamic map, block "
            "4096), the protobuf message's bytes, then deserialize_torch_tensor; wire bytes: that message. Under "
            "numpy >= 2.4 hivemind 1.1.12's decode fails on its header read and the bench registers the same decode "
            "with that read fixed (bench/hivemind_expert.py)"
        )
    return BenchResult(
        "codec",
        "wire codecs: encode+decode speed, error, bytes",
        COLUMNS + ["MB/s, buffers recycled"],
        rows,
        params={"width": WIDTH, "threads": 1, "recycle_tunables": RECYCLE_TUNABLES},
        notes=notes,
        summary=summary,
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.codec",
        description="measure the codec table in this process (what 'swarm bench codec' runs in a child)",
    )
    p.add_argument("--measure", required=True, metavar="OUT", help="write the rows here as JSON")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    Path(args.measure).write_text(json.dumps(measure(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
