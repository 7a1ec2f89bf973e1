"""Bench 2, hop: one forward+backward hop of a stage over loopback, against the stage's compute.

A stage server (its own process, one thread) holds one transformer block (d_model 256,
the middle stage of a 3-block model). A hop is what the trainer does for one stage:
``POST /forward`` with the stage input, then ``POST /backward`` with the input and the
output gradient (the server reuses its cached forward graph, as with one replica). The
input and gradient are encoded once beforehand: the trainer relays tensors as they came
off the wire. Activations of 64 KiB to 16 MiB (fp32 size) are sent with the int8 and fp32
codecs. The stage's compute per hop is the server's own count (``/health`` stats);
the rest of the hop's latency is what the network path costs: codec on the server,
msgpack, HTTP on loopback, the event loops.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import time

import aiohttp
import torch

from bench.processes import BenchProcesses, run_id
from bench.report import NOT_INSTALLED, BenchResult
from shared.codec import encode_tensor
from shared.http import post_message

DIMS = {"d_model": 256, "n_layer": 3, "n_head": 4}
NUM_STAGES, STAGE = 3, 1
FULL_KIB = (64, 256, 1024, 4096, 16384)
QUICK_KIB = (64, 256)
CONCURRENT = 4
COLUMNS = [
    "KiB",
    "codec",
    "hop ms",
    "compute ms",
    "other ms",
    "other share",
    "hops/s",
    f"hops/s x{CONCURRENT}",
    "hivemind",
]


def shape_of(kib: int) -> tuple[int, int, int]:
    tokens = kib * 1024 // (4 * DIMS["d_model"])
    seq = min(tokens, 128)
    return tokens // seq, seq, DIMS["d_model"]


async def hop(session: aiohttp.ClientSession, url: str, mb_id: str, codec: str, x: dict, g: dict) -> None:
    base = {"stage": STAGE, "microbatch_id": mb_id, "seed": 0, "codec": codec}
    await post_message(session, url + "/forward", {**base, "inputs": x}, timeout_s=120)
    await post_message(session, url + "/backward", {**base, "inputs": x, "grad_outputs": g}, timeout_s=120)


async def compute_s(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return (await resp.json())["stats"]["compute_s"]


async def measure_size(session: aiohttp.ClientSession, url: str, kib: int, codec: str, min_s: float) -> dict:
    gen = torch.Generator().manual_seed(kib)
    shape = shape_of(kib)
    x, g = (encode_tensor(torch.randn(shape, generator=gen) * s, codec) for s in (1.0, 1e-3))
    await hop(session, url, f"warm-{codec}-{kib}", codec, x, g)
    times, computes, started = [], [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - started < min_s and len(times) < 50):
        before = await compute_s(session, url)
        t = time.perf_counter()
        await hop(session, url, f"seq-{codec}-{kib}-{len(times)}", codec, x, g)
        times.append(time.perf_counter() - t)
        computes.append(await compute_s(session, url) - before)
    others = [t - c for t, c in zip(times, computes)]
    per_worker = max(1, len(times) // CONCURRENT)

    async def worker(w: int) -> None:
        for i in range(per_worker):
            await hop(session, url, f"par-{codec}-{kib}-{w}-{i}", codec, x, g)

    t = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(CONCURRENT)))
    concurrent = CONCURRENT * per_worker / (time.perf_counter() - t)
    latency, compute, other = (statistics.median(v) for v in (times, computes, others))
    return {
        "KiB": kib,
        "codec": codec,
        "hop ms": latency * 1e3,
        "compute ms": compute * 1e3,
        "other ms": other * 1e3,
        "other share": statistics.median(o / t for o, t in zip(others, times)),
        "hops/s": 1 / latency,
        f"hops/s x{CONCURRENT}": concurrent,
        "reps": len(times),
    }


async def measure(url: str, sizes, codecs, min_s: float) -> list[dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return [await measure_size(session, url, kib, codec, min_s) for kib in sizes for codec in codecs]


def hivemind_status() -> str:
    if importlib.util.find_spec("hivemind") is None:
        return NOT_INSTALLED
    return "installed; the expert-call comparison is not built yet"


def run(ctx) -> BenchResult:
    sizes, codecs, min_s = (QUICK_KIB, ("int8", "fp32"), 0.2) if ctx.quick else (FULL_KIB, ("int8", "fp32"), 1.0)
    with BenchProcesses(run_id("hop"), ctx.logs("hop")) as procs:
        env = {"SWARM_WIRE_CODEC": "int8", "SWARM_GLOBAL_BATCH": str(10**9), "SWARM_MAX_BODY_MB": "256"}
        name, url = procs.stage_server(STAGE, NUM_STAGES, env, dims=DIMS)
        procs.wait_healthy({name: url})
        rows = asyncio.run(measure(url, sizes, codecs, min_s))
    hivemind = hivemind_status()
    for row in rows:
        row["hivemind"] = hivemind
    at_1mib = next((r for r in rows if r["KiB"] == 1024 and r["codec"] == "int8"), rows[-1])
    notes = [
        (
            f"a hop = POST /forward + POST /backward of one stage holding one block ({DIMS['d_model']} wide) in its "
            f"own process; activation (B, T, {DIMS['d_model']}) of KiB fp32 bytes"
        ),
        (
            "medians over the hops; compute ms: the server's own forward+backward compute in that hop (its /health "
            "stats); other = hop - compute: server codec, msgpack, HTTP on loopback, event loops, client"
        ),
        (
            f"hops/s: one after another; hops/s x{CONCURRENT}: {CONCURRENT} hops in flight at once (the server "
            "computes one at a time, decoding and encoding the others meanwhile)"
        ),
    ]
    summary = {"int8_hop_ms_1MiB": at_1mib["hop ms"], "int8_other_ms_1MiB": at_1mib["other ms"], "hivemind": hivemind}
    return BenchResult(
        "hop",
        "one forward+backward hop over loopback vs the stage's compute",
        COLUMNS,
        rows,
        params={"dims": DIMS, "min_time_s": min_s, "server_threads": 1},
        notes=notes,
        summary=summary,
    )
