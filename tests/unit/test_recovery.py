"""Recovering a stage whose every replica died: CheckFree's rebuild from the neighbouring
stages (``services/stage_server/recovery.py``) and the learning rate's warm-up after it."""

from __future__ import annotations

import pytest
import torch

from services.stage_server.recovery import Neighbour, checkfree_weights, neighbour_stages
from services.stage_server.runtime import OptimizerConfig, StageRuntime
from services.stage_server.state import load_stage_state, stage_state
from shared.model import PRESETS, build_stage, partition

CFG = PRESETS["tiny"]  # 4 blocks, tied embeddings


def weights(stage: int, num_stages: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_stage(CFG, stage, num_stages, seed).named_parameters()}


def neighbour(stage: int, grad_norm: float, num_stages: int = 4, seed: int = 1) -> Neighbour:
    return Neighbour(stage, partition(CFG, num_stages)[stage].layers, weights(stage, num_stages, seed), grad_norm)


def test_which_stages_a_rebuild_reads():
    assert neighbour_stages(1, 4) == [0, 2] and neighbour_stages(2, 4) == [1, 3]
    assert neighbour_stages(0, 4) == [1, 3] and neighbour_stages(3, 4) == [2, 0]  # the other end: the tied copy
    assert neighbour_stages(0, 2) == [1] and neighbour_stages(1, 2) == [0]
    assert neighbour_stages(0, 1) == []


def test_a_middle_stage_is_its_neighbours_blocks_weighted_by_their_gradient_norms():
    before, after = neighbour(0, 1.0), neighbour(2, 3.0)
    own = weights(1)
    rebuilt, done = checkfree_weights(own, 1, 4, range(1, 2), [before, after], tied=True)
    assert done["blocks_from"] == {0: 0.25, 2: 0.75} and not done["kept"] and not done["copied"]
    assert set(rebuilt) == set(own)
    for name in own:
        suffix = name.removeprefix("blocks.1.")
        expected = 0.25 * before.tensors[f"blocks.0.{suffix}"] + 0.75 * after.tensors[f"blocks.2.{suffix}"]
        assert torch.allclose(rebuilt[name], expected, atol=1e-7), name
    # no gradient norm known (a neighbour that never stepped here): equal weights
    _, done = checkfree_weights(own, 1, 4, range(1, 2), [neighbour(0, 0.0), neighbour(2, 0.0)], tied=True)
    assert done["blocks_from"] == {0: 0.5, 2: 0.5}


def test_the_first_stage_copies_its_one_neighbour_and_takes_the_tied_head_as_its_embedding():
    second, last = neighbour(1, 2.0), neighbour(3, 5.0)
    own = weights(0)
    rebuilt, done = checkfree_weights(own, 0, 4, range(0, 1), [second, last], tied=True)
    assert done["blocks_from"] == {1: 1.0}
    assert torch.equal(rebuilt["blocks.0.attn.c_attn.weight"], second.tensors["blocks.1.attn.c_attn.weight"])
    assert torch.equal(rebuilt["wte.weight"], last.tensors["lm_head.weight"])
    assert torch.equal(rebuilt["wpe.weight"], own["wpe.weight"]) and done["kept"] == ["wpe.weight"]
    untied, done = checkfree_weights(own, 0, 4, range(0, 1), [second, last], tied=False)
    assert torch.equal(untied["wte.weight"], own["wte.weight"]) and "wte.weight" in done["kept"]


def test_the_last_stage_takes_the_first_stage_s_embedding_as_its_head():
    third, first = neighbour(2, 1.0), neighbour(0, 1.0)
    own = weights(3)
    rebuilt, done = checkfree_weights(own, 3, 4, range(3, 4), [third, first], tied=True)
    assert torch.equal(rebuilt["lm_head.weight"], first.tensors["wte.weight"])
    assert torch.equal(rebuilt["blocks.3.mlp.c_fc.weight"], third.tensors["blocks.2.mlp.c_fc.weight"])
    assert set(done["kept"]) == {"ln_f.weight", "ln_f.bias", "lm_head.bias"}


def test_neighbours_with_another_cut_cannot_rebuild_a_stage():
    # 4 blocks on 3 stages: 1, 2, 1
    own = weights(1, 3)
    with pytest.raises(ValueError, match="equal cuts"):
        checkfree_weights(own, 1, 3, range(1, 3), [neighbour(0, 1.0, 3), neighbour(2, 1.0, 3)], tied=True)


def runtime(warmup: int = 4) -> StageRuntime:
    optim = OptimizerConfig(lr=1e-3, global_batch=10**6, recovery_warmup_steps=warmup)
    return StageRuntime(CFG, 1, 4, seed=0, optim=optim, solo=False)


def test_a_recovery_with_fresh_moments_warms_the_learning_rate_up_again_and_the_state_carries_it():
    rt = runtime()
    rt.catch_up(10)  # no AdamW moments: fresh (or rebuilt) weights
    assert rt.recovered_at == 10
    assert [rt.lr_at(s) for s in (10, 11, 13, 20)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3])
    joiner = runtime()
    load_stage_state(joiner, *stage_state(rt))
    assert joiner.recovered_at == 10 and joiner.lr_at(10) == rt.lr_at(10)  # replicas step alike

    trained = runtime()
    x = torch.randn(2, 8, CFG.d_model)
    trained.backward("mb", 0, x, None, torch.randn(2, 8, CFG.d_model), bucket=0)
    trained.apply_step(trained.take_gradients())
    trained.catch_up(5)  # a survivor with its moments (it missed rounds): not a recovery
    assert trained.recovered_at is None and trained.lr_at(5) == 1e-3
    assert runtime(warmup=0).optim_cfg.recovery_factor(3, 3) == 1.0
