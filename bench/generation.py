"""Bench, generation: time per new token through the swarm, with inference sessions (KV
caches on the stage servers) against a forward of the whole prefix for every token.

Four stage servers (own processes, one thread each) hold a GPT of ``DIMS`` (block 1024,
byte vocabulary). For each context length the client first sends a prompt of that many
tokens, then generates ``tokens`` more greedily, one step per token, timing each step:

- ``session (KV cache)``: one inference session per stage (``shared.inference.SwarmSession``);
  a step sends one token's hidden state through the four servers and each attends to the
  keys and values it kept: the step's cost does not depend on the context;
- ``no cache (whole prefix)``: what generation costs without sessions: every step sends
  the whole prefix through the four servers (a fresh session each time, so the servers
  keep nothing between steps), and each recomputes every position.

Both ways run the same servers, HTTP path and fp32 wire; the figure is the median step
(one new token), and ``same tokens`` says whether both ways generated the same text.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import torch

from bench.processes import BenchProcesses, run_id
from bench.report import BenchResult
from shared.inference import SamplingParams, SwarmSession, sample
from shared.wiring import ReplicaBalancer

DIMS = {"d_model": 512, "n_layer": 8, "n_head": 8}
MODEL = "base"  # block_size 1024; its other dimensions are replaced by DIMS
NUM_STAGES = 4
COLUMNS = ["context", "way", "ms/token", "tokens/s", "x session"]
GREEDY = SamplingParams()


async def with_session(http, balancer, rid: str, prompt: list[int], tokens: int) -> tuple[list[float], list[int]]:
    times, out = [], []
    async with SwarmSession(http, balancer, run_id=rid, max_length=len(prompt) + tokens) as session:
        logits = await session.step(prompt)
        for _ in range(tokens):
            token = sample(logits, GREEDY, torch.Generator())
            out.append(token)
            started = time.perf_counter()
            logits = await session.step([token])
            times.append(time.perf_counter() - started)
    return times, out


async def without_cache(http, balancer, rid: str, prompt: list[int], tokens: int) -> tuple[list[float], list[int]]:
    times, out, ids = [], [], list(prompt)
    async with SwarmSession(http, balancer, run_id=rid, max_length=len(ids)) as first:
        logits = await first.step(ids)
    for _ in range(tokens):
        token = sample(logits, GREEDY, torch.Generator())
        out.append(token)
        ids.append(token)
        started = time.perf_counter()
        async with SwarmSession(http, balancer, run_id=rid, max_length=len(ids)) as session:
            logits = await session.step(ids)
        times.append(time.perf_counter() - started)
    return times, out


async def measure(urls: list[str], rid: str, contexts: tuple[int, ...], tokens: int) -> list[dict]:
    balancer = ReplicaBalancer(NUM_STAGES)
    for stage, url in enumerate(urls):
        balancer.set_replicas(stage, [url])
    gen = torch.Generator().manual_seed(0)
    rows = []
    async with aiohttp.ClientSession() as http:
        await with_session(http, balancer, rid, [65] * 8, 2)  # warm-up: first requests, allocator
        for context in contexts:
            prompt = torch.randint(32, 127, (context,), generator=gen).tolist()
            cached, cached_tokens = await with_session(http, balancer, rid, prompt, tokens)
            whole, whole_tokens = await without_cache(http, balancer, rid, prompt, tokens)
            per_token = statistics.median(cached)
            rows.append(
                {
                    "context": context,
                    "way": "session (KV cache)",
                    "ms/token": per_token * 1e3,
                    "tokens/s": 1 / per_token,
                    "x session": 1.0,
                    "steps": len(cached),
                }
            )
            slow = statistics.median(whole)
            rows.append(
                {
                    "context": context,
                    "way": "no cache (whole prefix)",
                    "ms/token": slow * 1e3,
                    "tokens/s": 1 / slow,
                    "x session": slow / per_token,
                    "steps": len(whole),
                    "same tokens": cached_tokens == whole_tokens,
                }
            )
    return rows


def run(ctx) -> BenchResult:
    contexts, tokens = ((8, 64), 3) if ctx.quick else ((32, 512), 16)
    rid = run_id("generation")
    with BenchProcesses(rid, ctx.logs("generation")) as procs:
        env = {"SWARM_MODEL": MODEL, "SWARM_WIRE_CODEC": "fp32", "SWARM_GLOBAL_BATCH": str(10**9)}
        servers = dict(procs.stage_server(s, NUM_STAGES, env, dims=DIMS) for s in range(NUM_STAGES))
        procs.wait_healthy(servers)
        rows = asyncio.run(measure(list(servers.values()), rid, contexts, tokens))
    by = {(r["context"], r["way"]): r for r in rows}
    first, last = contexts[0], contexts[-1]
    growth = {
        way: by[(last, way)]["ms/token"] / by[(first, way)]["ms/token"]
        for way in ("session (KV cache)", "no cache (whole prefix)")
    }
    notes = [
        (
            f"a GPT of d_model {DIMS['d_model']}, {DIMS['n_layer']} layers, {DIMS['n_head']} heads, byte vocabulary, "
            f"cut into {NUM_STAGES} stage servers (own processes, 1 thread each) on loopback, fp32 wire"
        ),
        (
            f"per context: a prompt of that many tokens, then {tokens} new tokens greedily, one step each; ms/token: "
            "the median step (all four stages, HTTP included)"
        ),
        (
            "session: the servers keep each layer's keys and values; no cache: every step sends the whole prefix and "
            "every position is computed again"
        ),
        (
            f"from {first} to {last} tokens of context the time per token grows {growth['session (KV cache)']:.2f}x "
            f"with sessions and {growth['no cache (whole prefix)']:.2f}x without"
        ),
    ]
    summary = {f"growth {way}": g for way, g in growth.items()} | {
        f"x session at {last}": by[(last, "no cache (whole prefix)")]["x session"]
    }
    return BenchResult(
        "generation",
        "time per new token: sessions with KV caches vs the whole prefix every token",
        COLUMNS,
        rows,
        params={"dims": DIMS, "model": MODEL, "contexts": list(contexts), "tokens": tokens, "num_stages": NUM_STAGES},
        notes=notes,
        summary=summary,
    )
