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

Where hivemind is installed, the same stage (same module, dimensions, seed and tensors)
is then served by a hivemind ``Server`` in its own process on 127.0.0.1
(:mod:`bench.hivemind_expert`) and called from this process through ``RemoteExpert``
(forward, then backward), as many times per size as the mesh's hop was, with hivemind's
8-bit blockwise compression beside our int8 and none beside our fp32.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import traceback

import aiohttp
import torch

from bench import hivemind_expert
from bench.processes import BenchProcesses, run_id
from bench.report import NOT_INSTALLED, BenchResult
from shared.codec import encode_tensor
from shared.http import post_message
from shared.model import build_stage, config_from_preset

MODEL = "tiny"  # the stage server's preset (SWARM_MODEL unset), whose dimensions DIMS replace
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
]
HIVEMIND_COLUMNS = ["hivemind hop ms", "hivemind other ms", "hivemind / mesh"]
COLUMNS += HIVEMIND_COLUMNS
HIVEMIND_DEADLINE_S = {True: 120.0, False: 600.0}  # quick or not: the hivemind side's whole run, start included


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


def hop_tensors(kib: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage input and output gradient of a hop of ``kib`` KiB: (B, T, C) each."""
    gen = torch.Generator().manual_seed(kib)
    shape = shape_of(kib)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 1e-3


async def measure_size(session: aiohttp.ClientSession, url: str, kib: int, codec: str, min_s: float) -> dict:
    x, g = (encode_tensor(t, codec) for t in hop_tensors(kib))
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


def median_s(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn``, after one to warm up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def hivemind_compute(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    """What hivemind's server computes in one hop: a forward without a graph, then in the
    backward the forward again and the backward through it."""
    with torch.no_grad():
        module(x)
    x = x.detach().requires_grad_(True)
    module(x).backward(g)


def measure_hivemind(procs: BenchProcesses, rows: list[dict], quick: bool) -> str:
    """hivemind's hop beside each row: as many hops as the mesh's on the same stage and
    tensors. ``hivemind other ms`` subtracts what its server computes per hop, measured on
    the same module in this process afterwards. Returns what the summary says of hivemind."""
    if not hivemind_expert.installed():
        for row in rows:
            row.update(dict.fromkeys(HIVEMIND_COLUMNS, NOT_INSTALLED))
        return NOT_INSTALLED
    dims, deadline_s = {"model": MODEL, **DIMS}, HIVEMIND_DEADLINE_S[quick]
    try:
        with hivemind_expert.HivemindHops(procs, dims, STAGE, NUM_STAGES, deadline_s) as hive:
            hops = []
            for row in rows:
                x, g = hop_tensors(row["KiB"])
                hops.append(median_s(lambda c=row["codec"], x=x, g=g: hive.hop(c, x, g), row["reps"]))
    except Exception as exc:  # our rows stand; the columns say why hivemind's are missing
        traceback.print_exc()
        for row in rows:
            row.update(dict.fromkeys(HIVEMIND_COLUMNS, f"failed: {type(exc).__name__}: {exc}"))
        return "failed"
    module = build_stage(config_from_preset(MODEL, **DIMS), STAGE, NUM_STAGES, seed=0)  # the servers' stage
    for row, hop_s in zip(rows, hops):
        x, g = hop_tensors(row["KiB"])
        compute = median_s(lambda x=x, g=g: hivemind_compute(module, x, g), row["reps"])
        row["hivemind hop ms"] = hop_s * 1e3
        row["hivemind other ms"] = (hop_s - compute) * 1e3
        row["hivemind / mesh"] = hop_s * 1e3 / row["hop ms"]
    return "measured"


def hivemind_version() -> str:
    if not hivemind_expert.installed():
        return NOT_INSTALLED
    from importlib.metadata import version

    return version("hivemind")


def run(ctx) -> BenchResult:
    sizes, codecs, min_s = (QUICK_KIB, ("int8", "fp32"), 0.2) if ctx.quick else (FULL_KIB, ("int8", "fp32"), 1.0)
    with BenchProcesses(run_id("hop"), ctx.logs("hop")) as procs:
        env = {"SWARM_WIRE_CODEC": "int8", "SWARM_GLOBAL_BATCH": str(10**9), "SWARM_MAX_BODY_MB": "256"}
        name, url = procs.stage_server(STAGE, NUM_STAGES, env, dims=DIMS)
        procs.wait_healthy({name: url})
        rows = asyncio.run(measure(url, sizes, codecs, min_s))
        procs.stop([name])  # hivemind's side gets the machine to itself too
        hivemind = measure_hivemind(procs, rows, ctx.quick)
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
        (
            "hivemind hop ms: the same stage module, dimensions, seed and tensors served by hivemind's Server (its own "
            "process, 1 connection handler, p2p daemons on 127.0.0.1) and called through RemoteExpert from the bench "
            "process, forward then backward, as many hops as the mesh's row (median, after one to warm up); int8 rows: "
            "hivemind's BLOCKWISE_8BIT compression (bitsandbytes dynamic map, block 4096) on inputs, outputs and "
            "gradients; fp32 rows: no compression. Its client encodes the input and gradient and decodes the output "
            "and input gradient on every call (the mesh's hop relays pre-encoded tensors); its backward recomputes "
            "the forward (the mesh's reuses the forward's graph). hivemind other ms: its hop minus that compute "
            "(a no-grad forward, a forward and a backward of the same module, timed in the bench process, 1 thread); "
            "hivemind / mesh: its hop ms over ours"
        ),
    ]
    if hivemind == "measured":
        notes.append(
            "hivemind's p2p daemons: NAT port mapping, AutoNAT and relays off, no bootstrap peers but the server's; "
            "under numpy >= 2.4 hivemind 1.1.12's 8-bit decode fails on its header read and both sides register the "
            "same decode with that read fixed (bench/hivemind_expert.py)"
        )
    summary = {
        "int8_hop_ms_1MiB": at_1mib["hop ms"],
        "int8_other_ms_1MiB": at_1mib["other ms"],
        "hivemind": hivemind,
        "hivemind_int8_hop_ms_1MiB": at_1mib["hivemind hop ms"],
    }
    return BenchResult(
        "hop",
        "one forward+backward hop over loopback vs the stage's compute",
        COLUMNS,
        rows,
        params={"dims": DIMS, "min_time_s": min_s, "server_threads": 1, "hivemind": hivemind_version()},
        notes=notes,
        summary=summary,
    )
