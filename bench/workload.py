"""One training workload measured three ways: in one process, on the mesh, under
torch.distributed.pipelining (``bench.pipelining``). The same GPT (``shared.model``, same
seed, so the same weights), the same byte-level Shakespeare microbatches, the same
optimizer step every ``samples_per_step`` samples.

Where the mesh's time goes: with ``cores`` cores and a window of ``wall`` seconds the
machine has ``cores * wall`` core-seconds. The model's own compute costs what one process
with one thread spends on the same tokens (``compute``); a stage whose weights changed
(an optimizer step) while a microbatch was in flight recomputes that microbatch's forward
in its backward (``recompute``, estimated from the servers' cache-hit counts); the mesh's
processes (stage servers and the trainer) together use ``used`` CPU seconds; the rest of
``used`` went to communication (codec, HTTP, msgpack, Python around them). Of the rest, what the kernel
counted as idle was idle (stages waiting for work: pipeline bubbles, queueing behind the
slowest stage) and the remainder went to other processes on the machine (zero on a
machine that runs nothing else).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import aiohttp
import torch

from bench.processes import BenchProcesses, machine_idle_seconds
from bench.pump import MeshClient
from services.trainer.data import ByteBatcher, load_corpus
from shared.model import GPTConfig, build_gpt, config_from_preset

PRESET = "tiny"  # vocabulary 256 (bytes), block 128; the dimensions below replace the preset's


@dataclass(frozen=True)
class Workload:
    d_model: int
    n_layer: int = 8
    seq_len: int = 128
    microbatch_size: int = 8
    samples_per_step: int = 32

    @property
    def n_head(self) -> int:
        return max(1, self.d_model // 64)

    @property
    def dims(self) -> dict[str, int]:
        return {"d_model": self.d_model, "n_layer": self.n_layer, "n_head": self.n_head}

    def gpt_config(self) -> GPTConfig:
        return config_from_preset(PRESET, **self.dims)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.seq_len * self.microbatch_size

    @property
    def microbatches_per_step(self) -> int:
        return max(1, self.samples_per_step // self.microbatch_size)

    def batcher(self, seed: int = 0) -> ByteBatcher:
        return ByteBatcher(load_corpus(), self.seq_len, self.microbatch_size, seed=seed)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def measure_one_process(work: Workload, *, threads: int, warmup: int, measured: int) -> dict:
    """Train ``warmup + measured`` microbatches in this process with ``threads`` torch
    threads (gradient accumulation, AdamW step every ``samples_per_step``); tokens/s and
    CPU seconds per token of the measured ones."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_gpt(work.gpt_config(), seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
        batcher = work.batcher()
        per_step = work.microbatches_per_step
        started = cpu_started = 0.0
        for i in range(warmup + measured):
            if i == warmup:
                started, cpu_started = time.perf_counter(), time.process_time()
            mb = batcher.microbatch(i)
            (model(mb.inputs, mb.targets) / per_step).backward()
            if (i + 1) % per_step == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    finally:
        torch.set_num_threads(previous)
    tokens = measured * work.tokens_per_microbatch
    return {"tokens_per_s": tokens / wall, "cpu_s_per_token": cpu / tokens, "wall_s": wall, "threads": threads}


def measure_mesh(
    work: Workload, procs: BenchProcesses, *, stages: int, codec: str, in_flight: int, warmup: int, measured: int
) -> dict:
    """Start ``stages`` stage servers (one replica each) with this workload's model, push
    microbatches through them from this process and measure the window from the end of
    microbatch ``warmup`` to the end of microbatch ``warmup + measured``; the servers are
    stopped before returning. CPU seconds of servers and trainer in that window too."""
    servers = dict(
        procs.stage_server(
            s, stages, {"SWARM_WIRE_CODEC": codec, "SWARM_GLOBAL_BATCH": str(work.samples_per_step)}, dims=work.dims
        )
        for s in range(stages)
    )
    try:
        procs.wait_healthy(servers)
        return asyncio.run(
            _pump_mesh(
                work, procs, servers, stages=stages, codec=codec, in_flight=in_flight, warmup=warmup, measured=measured
            )
        )
    finally:
        procs.stop(list(servers))


async def _pump_mesh(
    work: Workload,
    procs: BenchProcesses,
    servers: dict[str, str],
    *,
    stages: int,
    codec: str,
    in_flight: int,
    warmup: int,
    measured: int,
) -> dict:
    names = list(servers)
    marks: dict[int, tuple[float, float]] = {}  # completed count -> (servers' CPU s, trainer's CPU s)

    def on_complete(log) -> None:
        if log.completed in (warmup, warmup + measured) and log.completed not in marks:
            marks[log.completed] = (procs.cpu_seconds(names), time.process_time(), machine_idle_seconds())

    async with MeshClient(
        run_id=procs.run_id, num_stages=stages, codec=codec, seq_len=work.seq_len, microbatch_size=work.microbatch_size
    ) as mesh:
        mesh.use_urls([[servers[n]] for n in names])
        log = await mesh.pump(
            in_flight=in_flight,
            count=warmup + measured + in_flight,
            stop_after=warmup + measured,
            on_complete=on_complete,
        )
        health = [await _health(mesh.session, servers[n]) for n in names]
    stats = [h["stats"] for h in health[:-1]]  # the last stage never caches: its backward is its forward
    if log.failed:
        raise RuntimeError(f"{log.failed} microbatches failed on the mesh: {log.failures[-1]}")
    start, end, tokens = log.between_completions(warmup, warmup + measured)
    (srv0, trn0, idle0), (srv1, trn1, idle1) = marks[warmup], marks[warmup + measured]
    backwards = sum(st["backwards_run"] for st in stats)  # every backward computed, accumulated or not
    recomputed = sum(st["recomputes"] for st in stats) / backwards if backwards else 0.0
    return {
        "tokens_per_s": tokens / (end - start),
        "wall_s": end - start,
        "tokens": tokens,
        "server_cpu_s": srv1 - srv0,
        "trainer_cpu_s": trn1 - trn0,
        "machine_idle_s": idle1 - idle0,
        "stages": stages,
        "recomputed_fraction": recomputed,
        "utilisation": [h["utilisation"] for h in health],  # each stage server's MFU meter, since its start
    }


async def _health(session, url: str) -> dict:
    async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.json()


def time_shares(mesh: dict, compute_cpu_s_per_token: float, n_cores: int) -> dict:
    """Shares of the mesh's core-seconds: model compute, forwards recomputed in backward,
    communication, idle, other processes (see module doc). A recomputed forward is taken to
    cost a third of its stage's forward+backward, a stage a ``1/stages`` share of the model."""
    capacity = n_cores * mesh["wall_s"]
    used = mesh["server_cpu_s"] + mesh["trainer_cpu_s"]
    compute = min(used, compute_cpu_s_per_token * mesh["tokens"])
    recompute = min(used - compute, compute * mesh["recomputed_fraction"] * (mesh["stages"] - 1) / mesh["stages"] / 3)
    idle = min(max(0.0, capacity - used), mesh["machine_idle_s"])
    return {
        "compute share": compute / capacity,
        "recompute share": recompute / capacity,
        "comm share": (used - compute - recompute) / capacity,
        "idle share": idle / capacity,
        "others share": max(0.0, capacity - used - idle) / capacity,
    }
