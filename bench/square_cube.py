"""Bench 3, square-cube: mesh tokens/s over one process's as the model grows.

The SWARM paper's square-cube law: a stage's compute grows with d_model squared (per
token) while what it sends grows with d_model, so the share of time lost to
communication falls as the model grows. The mesh: 4 stage servers (one process and one
thread each), one replica per stage, int8 wire, 8 microbatches in flight, driven from
this process. The baseline: the same model and microbatches in one process with as many
torch threads as the machine has cores (the mesh's 4 processes share those cores too).
Both train (forward, backward, AdamW every 32 samples). The shares say where the mesh's
core-seconds went (``bench.workload``): compute = what one process with one thread spends
on the same tokens, comm = the rest of the CPU the mesh used, idle = cores left unused.
"""

from __future__ import annotations

from bench.processes import BenchProcesses, run_id
from bench.report import BenchResult
from bench.workload import Workload, cores, measure_mesh, measure_one_process, time_shares
from shared.flops import model_flops, stage_flops
from shared.model import GPT, partition
from shared.peak_flops import resolve_peak

STAGES, CODEC, IN_FLIGHT = 4, "int8", 8
# d_model -> (warm-up, measured) microbatches of 8 x 128 tokens: about 10-50 s a side at 2 cores
FULL = {256: (4, 24), 512: (4, 12), 1024: (4, 6)}
QUICK_WORK = Workload(d_model=64, n_layer=2, seq_len=32, microbatch_size=4, samples_per_step=8)
COLUMNS = [
    "d_model",
    "params M",
    "mesh tok/s",
    "1 process tok/s",
    "threads",
    "mesh / 1 process",
    "CPU efficiency",
    "compute share",
    "recompute share",
    "comm share",
    "idle share",
    "others share",
    "stage MFU",
    "mesh MFU",
    "1 process MFU",
]


def plan(quick: bool) -> tuple[list[tuple[Workload, int, int]], int, int]:
    """[(workload, warm-up, measured)], stages, in flight."""
    if quick:
        return [(QUICK_WORK, 2, 6)], 2, 4
    return [(Workload(d_model=d), w, m) for d, (w, m) in FULL.items()], STAGES, IN_FLIGHT


def mesh_figures(ctx, work: Workload, warmup: int, measured: int, stages: int, in_flight: int) -> dict:
    """The mesh's measurement of this workload, made once per invocation (pipelining reuses it)."""
    key = ("mesh", work, stages, CODEC, in_flight)
    if key not in ctx.cache:
        with BenchProcesses(run_id(f"mesh{work.d_model}"), ctx.logs("mesh")) as procs:
            ctx.cache[key] = measure_mesh(
                work, procs, stages=stages, codec=CODEC, in_flight=in_flight, warmup=warmup, measured=measured
            )
    return ctx.cache[key]


def mfu(work: Workload, mesh: dict, single: dict, stages: int) -> dict:
    """MFU of the mesh per stage and together, and of one process, at the tokens/s measured."""
    cfg = work.gpt_config()
    stage_mfu = [
        mesh["tokens_per_s"] * stage_flops(cfg, spec).per_token(work.seq_len) / u["peak_flops"]
        for spec, u in zip(partition(cfg, stages), mesh["utilisation"])
    ]
    whole = model_flops(cfg).per_token(work.seq_len)
    per_thread = resolve_peak("cpu", "fp32", threads=1).flops  # the servers' figure (the same cache)
    return {
        "stage MFU": f"{min(stage_mfu):.3f}-{max(stage_mfu):.3f}",
        "mesh MFU": mesh["tokens_per_s"] * whole / sum(u["peak_flops"] for u in mesh["utilisation"]),
        "1 process MFU": single["tokens_per_s"] * whole / (per_thread * single["threads"]),
        "stage MFUs": stage_mfu,
        "stage busy MFUs": [u["mfu_busy"] for u in mesh["utilisation"]],
        "peak per thread FLOP/s": per_thread,
    }


def run(ctx) -> BenchResult:
    works, stages, in_flight = plan(ctx.quick)
    n_cores = cores()
    rows = []
    for work, warmup, measured in works:
        mesh = mesh_figures(ctx, work, warmup, measured, stages, in_flight)
        # no pipeline to fill: half the mesh's microbatches measure one process as well
        one_thread = measure_one_process(work, threads=1, warmup=1, measured=max(2, measured // 2))
        all_threads = (
            measure_one_process(work, threads=n_cores, warmup=1, measured=max(2, measured // 2))
            if n_cores > 1
            else one_thread
        )
        single = max(one_thread, all_threads, key=lambda m: m["tokens_per_s"])
        params = sum(p.numel() for p in GPT(work.gpt_config()).parameters())
        shares = time_shares(mesh, one_thread["cpu_s_per_token"], n_cores)
        used = shares["compute share"] + shares["recompute share"] + shares["comm share"]
        rows.append(
            {
                "d_model": work.d_model,
                "params M": params / 1e6,
                "mesh tok/s": mesh["tokens_per_s"],
                "1 process tok/s": single["tokens_per_s"],
                "threads": single["threads"],
                "mesh / 1 process": mesh["tokens_per_s"] / single["tokens_per_s"],
                "CPU efficiency": shares["compute share"] / used if used else None,
                **shares,
                **mfu(work, mesh, single, stages),
                "1 process 1 thread tok/s": one_thread["tokens_per_s"],
                f"1 process {n_cores} threads tok/s": all_threads["tokens_per_s"],
                "mesh": mesh,
            }
        )
    w = works[0][0]
    notes = [
        (
            f"{w.n_layer} layers, seq {w.seq_len}, microbatch {w.microbatch_size}, AdamW every {w.samples_per_step} "
            f"samples; mesh: {stages} stages x 1 replica, {CODEC} wire, {in_flight} microbatches in flight"
        ),
        f"1 process: the faster of 1 and {n_cores} torch threads (the machine's cores; the mesh's 4 processes share "
        f"them too): on a busy machine {n_cores} threads can be slower than 1; the one-thread run's CPU per token is "
        "the compute share's yardstick",
        (
            "CPU efficiency: the model's compute over all the CPU the mesh's processes used (1.0 = no overhead); "
            "unlike tokens/s it does not depend on what else runs on the machine"
        ),
        "shares of the mesh's core-seconds (cores x window): compute (model math), recompute (forwards recomputed in "
        "backward, on their own weights version, because the graph was not cached), comm (codec, msgpack, HTTP, Python "
        "around them), idle (stages waiting for work), others (CPU taken by other processes on the machine)",
        "MFU: model FLOPs (shared.flops: matmuls, attention's full square, backward = 2 forwards) per second over the "
        "peak of the threads in use (one thread's measured fp32 matmul rate, shared.peak_flops, times the threads): "
        "stage MFU (lowest-highest of the stages) = the mesh's tokens/s x the stage's FLOPs per token over its server's"
        " one thread; mesh MFU = the whole model's over the stages' threads together; 1 process MFU over its own "
        f"threads. The mesh's {stages} one-thread servers share {n_cores} cores with the trainer: its MFU cannot pass "
        f"{min(1.0, n_cores / stages):.2f} here; each stage's busy MFU (its model FLOPs over its compute seconds) is "
        "in the JSON rows",
    ]
    summary = {f"ratio_d{r['d_model']}": r["mesh / 1 process"] for r in rows} | {
        f"cpu_efficiency_d{r['d_model']}": r["CPU efficiency"] for r in rows
    }
    return BenchResult(
        "square_cube",
        "mesh vs one process as d_model grows",
        COLUMNS,
        rows,
        params={
            "stages": stages,
            "codec": CODEC,
            "in_flight": in_flight,
            "cores": n_cores,
            "microbatches": {r[0].d_model: {"warmup": r[1], "measured": r[2]} for r in works},
        },
        notes=notes,
        summary=summary,
    )
