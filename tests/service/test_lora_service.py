"""LoRA through the real coordinator, stage servers and trainer (in this process, loopback):

- 2 stages x 2 replicas fine-tune a random Llama with adapters on every linear layer: after
  every global step the replicas of a stage hold bit-identical adapters and AdamW state
  (their digests, taken on the compute worker right after each step, cover exactly that),
  every server trains adapters only, and the frozen base is never changed;
- rank 8 on the query and value projections sends at least 50x fewer bytes in step rounds
  per global step than full fine-tuning of the same model, both measured in one run
  (``bench.lora``), and each stage server's memory is reported for both.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.lora import compare, write_model
from services.stage_server.routes import RUNTIME
from shared.lora import base_fingerprint
from tests.service.test_global_steps import settled, swarm, trainer  # noqa: F401  (swarm: the fixture)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("lora") / "model", d_model=64)


async def test_replicas_hold_identical_adapters_after_every_step_and_the_base_never_changes(
    swarm,  # noqa: F811
    http_session,
    model_dir,
):
    steps, global_batch = 6, 8
    s = await swarm([2, 2], model=str(model_dir), global_batch=global_batch, lr=1e-2, lora_rank=4, warmup_steps=0)
    runtimes = [app[RUNTIME] for group in s.stages for app in group]
    base_before = [base_fingerprint(rt.model) for rt in runtimes]
    assert base_before[0] == base_before[1] and base_before[2] == base_before[3]
    for rt in runtimes:
        assert rt.param_names and all(".lora_" in n for n in rt.param_names)
        assert rt.lora_report.trainable == sum(p.numel() for p in rt.params) < rt.lora_report.frozen / 10

    summary = await trainer(
        http_session, s.urls, steps=steps, global_batch=global_batch, in_flight=2, coordinator=s.coordinator_url
    ).run()
    await settled(s)

    assert summary.microbatches_failed == 0
    assert summary.eval_loss_after < summary.eval_loss_before
    for stage in range(2):
        for step in range(1, steps + 1):
            digests = s.digests[(stage, step)]
            assert len(digests) == 2 and len(set(digests)) == 1, f"stage {stage} step {step}: replicas differ"
    assert [base_fingerprint(rt.model) for rt in runtimes] == base_before
    assert all(rt.optimizer.state and set(rt.optimizer.state) <= set(rt.params) for rt in runtimes)


async def test_rank_8_on_q_and_v_sends_50x_fewer_step_round_bytes_than_full_fine_tuning(tmp_path):
    model = await asyncio.to_thread(write_model, tmp_path / "model", 256)
    result = await compare(model, steps=3, rank=8, targets="q_proj,v_proj")
    full, lora = result["full"], result["lora"]
    for run in (full, lora):
        assert run["stage_steps"] == [[3, 3], [3, 3]] and run["replicas_identical"], run
        assert run["microbatches_failed"] == 0
    assert result["bytes_ratio"] >= 50, result["bytes_ratio"]  # measured 101.6x (d_model 256, 4 layers, int4)
    for a, b in zip(full["servers"], lora["servers"]):
        assert b["trainable_parameters"] * 50 < a["trainable_parameters"]
        assert 0 < b["adam_bytes"] * 50 < a["adam_bytes"]
        assert b["frozen_base_bytes"] == a["trainable_bytes"]  # the same weights, frozen in fp32
        assert b["estimate_bytes"] < a["estimate_bytes"] / 4
