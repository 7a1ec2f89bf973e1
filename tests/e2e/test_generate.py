"""Generation through a live swarm of real processes, from a trained and exported model.

A run trains 10 steps with `swarm up` (fp32 wire) and checkpoints; five stage servers
(stage 2 twice) resume from that checkpoint under a coordinator; `swarm export` writes the
same model as one file. Then:

- `swarm generate` (greedy, 64 tokens, fp32 wire) prints the tokens that the exported model
  generates in one process, token for token;
- a generation whose stage-2 server is SIGKILLed after 20 tokens completes through the other
  replica (the session replayed into it) with the same tokens as without the failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import aiohttp
import pytest

from services.export import load_exported
from shared.inference import LocalSession, SamplingParams, SwarmSession, generate
from shared.processes import wait_healthy
from shared.wiring import ReplicaBalancer
from tests.e2e.conftest import SWARM, get_json, processes_of_run, wait_until
from tests.e2e.test_resume_export import swarm_up

pytestmark = pytest.mark.e2e

START_S = 120  # five children import torch at once on 2 cores
PROMPT = "ROMEO:\nWhat light"
TOKENS = 64


async def one_process(model_file, prompt: list[int]) -> list[int]:
    session = LocalSession(load_exported(model_file), len(prompt) + TOKENS)
    return [t async for t in generate(session.step, prompt, SamplingParams(max_tokens=TOKENS))]


async def test_generation_through_the_swarm_equals_the_exported_model_and_survives_a_kill(tmp_path, processes):
    run_dir = tmp_path / f"e2e-gen-{os.getpid()}"
    swarm_up(run_dir, 10)
    model_file = tmp_path / "model.safetensors"
    export = subprocess.run(
        [*SWARM, "export", "--checkpoint-dir", str(run_dir / "checkpoints"), "--out", str(model_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert export.returncode == 0, export.stderr

    common = {"SWARM_NUM_STAGES": "4", "SWARM_WIRE_CODEC": "fp32", "SWARM_CHECKPOINT_DIR": str(run_dir / "checkpoints")}
    _, coordinator = processes.coordinator(heartbeat_s=0.5, extra=common)
    servers = {}
    for stage in (0, 1, 2, 2, 3):
        proc, url = processes.server(stage, coordinator=coordinator, heartbeat_s=0.5, extra=common)
        servers[url] = proc
    for url, proc in servers.items():
        wait_healthy(url, proc, START_S)
    wait_until(
        lambda: sum(len(s["replicas"]) for s in get_json(coordinator + "/swarm")["stages"]) == 5,
        START_S,
        "five servers registered",
        poll_s=0.2,
    )
    assert {get_json(url + "/health")["step"] for url in servers} == {10}  # every server resumed the trained weights

    prompt = list(PROMPT.encode())
    expected = await one_process(model_file, prompt)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    cli = subprocess.run(
        [*SWARM, "generate", "--coordinator", coordinator, "--max-tokens", str(TOKENS), "--json", PROMPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert cli.returncode == 0, cli.stderr
    result = json.loads(cli.stdout)
    assert result["token_ids"] == expected and result["weights_steps"] == [10] and result["failovers"] == 0
    assert result["text"] == bytes(expected).decode("utf-8", errors="replace") or expected.count(0) == 0

    view = get_json(coordinator + "/swarm")["stages"]
    balancer = ReplicaBalancer(4)
    for s in view:
        balancer.set_replicas(s["stage"], [r["url"] for r in s["replicas"]])
    killed = None
    async with aiohttp.ClientSession() as http:
        session = SwarmSession(http, balancer, run_id=processes.run_id, max_length=len(prompt) + TOKENS, timeout_s=30)
        tokens = []
        async for token in generate(session.step, prompt, SamplingParams(max_tokens=TOKENS)):
            tokens.append(token)
            if len(tokens) == 20:
                killed = session.route[2]
                servers[killed].send_signal(signal.SIGKILL)
                servers[killed].wait(timeout=10)
        replaced = session.route[2]
        await session.close()
    assert tokens == expected
    assert session.stats.failovers >= 1 and any(killed in f for f in session.stats.failed)
    assert replaced is not None and replaced != killed
    assert session.stats.replayed_positions == len(prompt) + 19  # stage 2 had seen the prompt and 19 tokens
    assert processes_of_run(run_dir.name) == []
