"""StageRuntime without HTTP: accumulation, optimizer steps, the backward cache, validation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.stage_server.runtime import Accumulated, OptimizerConfig, StageRuntime, StaleForward
from shared.errors import BadPayload
from shared.model import PRESETS

CFG = PRESETS["tiny"]


def runtime(stage=1, *, global_batch=10**6, cache_size=16, cfg=CFG, warmup_steps=0, solo=True):
    return StageRuntime(
        cfg,
        stage,
        4,
        seed=0,
        optim=OptimizerConfig(global_batch=global_batch, warmup_steps=warmup_steps),
        cache_size=cache_size,
        solo=solo,
    )


def hidden(batch=2, seq=8, seed=0):
    return torch.randn(batch, seq, CFG.d_model, generator=torch.Generator().manual_seed(seed))


def weights(rt):
    return {k: v.clone() for k, v in rt.model.state_dict().items()}


def test_optimizer_steps_after_global_batch_and_changes_the_weights():
    rt = runtime(global_batch=4)
    before = weights(rt)
    rt.backward("a", 0, hidden(batch=2), None, hidden(batch=2, seed=1))
    assert rt.stats.optimizer_steps == 0 and rt.pending_samples == 2
    assert all(torch.equal(v, rt.model.state_dict()[k]) for k, v in before.items())
    rt.backward("b", 0, hidden(batch=2, seed=2), None, hidden(batch=2, seed=3))
    assert rt.stats.optimizer_steps == 1 and rt.pending_samples == 0 and rt.version == 1
    assert any(not torch.equal(v, rt.model.state_dict()[k]) for k, v in before.items())


def test_accumulated_gradient_is_the_sample_weighted_mean():
    """Gradients of a 1-sample and a 3-sample microbatch average as 1/4 and 3/4."""
    x1, g1, x3, g3 = hidden(1, seed=0), hidden(1, seed=1), hidden(3, seed=2), hidden(3, seed=3)
    solo = []
    for x, g in ((x1, g1), (x3, g3)):
        rt = runtime()
        rt.backward("m", 0, x, None, g)
        solo.append(rt.accumulated_gradients())
    rt = runtime()
    rt.backward("m1", 0, x1, None, g1)
    rt.backward("m3", 0, x3, None, g3)
    for name, grad in rt.accumulated_gradients().items():
        assert torch.allclose(grad, 0.25 * solo[0][name] + 0.75 * solo[1][name], atol=1e-7), name


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_cached_and_recomputed_backward_agree_exactly(dropout):
    cfg = replace(CFG, dropout=dropout)
    cached, fresh = runtime(cfg=cfg), runtime(cfg=cfg, cache_size=0)
    x, g = hidden(), hidden(seed=1)
    out_cached = cached.forward("mb", 42, x, None)
    out_fresh = fresh.forward("mb", 42, x, None)
    assert torch.equal(out_cached, out_fresh)
    a = cached.backward("mb", 42, x, None, g)
    b = fresh.backward("mb", 42, x, None, g)
    assert cached.stats.cache_hits == 1 and fresh.stats.cache_hits == 0
    assert torch.equal(a.grad_inputs, b.grad_inputs)
    for name, grad in cached.accumulated_gradients().items():
        assert torch.equal(grad, fresh.accumulated_gradients()[name]), name


def test_dropout_is_seeded_by_the_request():
    rt = runtime(cfg=replace(CFG, dropout=0.2), cache_size=0)
    x = hidden()
    assert torch.equal(rt.forward("a", 1, x, None), rt.forward("b", 1, x, None))
    assert not torch.equal(rt.forward("a", 1, x, None), rt.forward("a", 2, x, None))


def test_a_cached_graph_stays_valid_after_a_step_and_is_not_used_for_another_input():
    rt = runtime(global_batch=2)
    x = hidden()
    rt.forward("a", 0, x, None)
    rt.forward("b", 0, x, None)
    rt.backward("a", 0, x, None, hidden(seed=1), forward_step=0)  # 2 samples: optimizer step, a new version
    assert rt.stats.cache_hits == 1 and rt.version == 1 and rt.versions_kept == 2
    rt.backward("b", 0, x, None, hidden(seed=1), forward_step=0)
    assert rt.stats.cache_hits == 2 and rt.versions_kept == 1  # its forward's weights, kept for it, then let go
    rt.forward("c", 0, x, None)
    rt.backward("c", 0, hidden(seed=5), None, hidden(seed=1), forward_step=rt.step)  # same id, another input
    assert rt.stats.cache_hits == 2 and rt.stats.other_weights_backwards == 0


def test_cache_is_bounded():
    rt = runtime(cache_size=3)
    for i in range(10):
        rt.forward(f"mb{i}", 0, hidden(), None)
    assert len(rt._cache) == 3


def test_eval_forward_keeps_no_graph():
    rt = runtime()
    out = rt.forward("e", 0, hidden(), None, keep_graph=False)
    assert not out.requires_grad and len(rt._cache) == 0


def test_warmup_raises_the_learning_rate_linearly():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=4)
    assert [cfg.lr_at(s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert OptimizerConfig(lr=1e-3).lr_at(0) == 1e-3


def test_last_stage_backward_returns_loss_and_input_gradient():
    rt = runtime(stage=3)
    targets = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    result = rt.backward("m", 0, hidden(), targets, None)
    assert result.loss == pytest.approx(5.55, abs=0.3) and result.grad_inputs.shape == (2, 8, CFG.d_model)


def test_first_stage_backward_returns_no_input_gradient():
    rt = runtime(stage=0)
    result = rt.backward("m", 0, torch.randint(0, 256, (2, 8)), None, hidden())
    assert result.grad_inputs is None and result.loss is None and rt.pending_samples == 2


@pytest.mark.parametrize(
    "stage,inputs,targets,grad,match",
    [
        (0, torch.randn(2, 8), None, None, "integer token ids"),
        (0, torch.full((2, 8), 256), None, None, r"\[0, 256\)"),
        (1, torch.randint(0, 9, (2, 8, 128)), None, None, "float hidden"),
        (1, torch.randn(2, 8, 64), None, None, "128"),
        (1, torch.randn(2, 200, 128), None, None, "seq"),
        (1, torch.full((2, 8, 128), float("nan")), None, None, "non-finite"),
        (3, torch.randn(2, 8, 128), None, None, "targets"),
        (3, torch.randn(2, 8, 128), torch.zeros(2, 7, dtype=torch.long), None, "shape"),
        (3, torch.randn(2, 8, 128), torch.full((2, 8), 300), None, r"\[-1, 256\)"),
    ],
)
def test_validation_refuses_before_touching_the_model(stage, inputs, targets, grad, match):
    rt = runtime(stage=stage)
    before = weights(rt)
    with pytest.raises(BadPayload, match=match):
        rt.forward("m", 0, inputs, targets)
    with pytest.raises(BadPayload):
        rt.backward("m", 0, inputs, targets, grad)
    assert rt.pending_samples == 0 and rt.stats.forwards == rt.stats.backwards == 0
    assert all(torch.equal(v, rt.model.state_dict()[k]) for k, v in before.items())


def test_backward_of_a_middle_stage_needs_a_finite_grad_of_the_right_shape():
    rt = runtime()
    for grad, match in (
        (None, "needs grad_outputs"),
        (hidden(seq=7), "shape"),
        (torch.full((2, 8, 128), float("inf")), "non-finite"),
    ):
        with pytest.raises(BadPayload, match=match):
            rt.backward("m", 0, hidden(), None, grad)
    assert rt.pending_samples == 0


# ---------------------------------------------------------------- global steps
def test_a_duplicate_backward_returns_its_gradient_but_is_accumulated_once():
    rt = runtime()
    x, g = hidden(), hidden(seed=1)
    first = rt.backward("mb", 0, x, None, g)
    again = rt.backward("mb", 0, x, None, g)
    assert first.accumulated and not again.accumulated
    assert torch.equal(first.grad_inputs, again.grad_inputs)
    assert rt.pending_samples == 2 and rt.stats.duplicate_backwards == 1
    assert rt.stats.backwards == 1 and rt.stats.backwards_run == 2  # both answered, one accumulated


def test_a_duplicate_says_which_step_holds_its_microbatch_also_after_that_step_was_applied():
    rt = runtime(solo=False)
    first = rt.backward("mb", 0, hidden(), None, hidden(seed=1), bucket=0)
    assert first.bucket == 0
    rt.apply_step(rt.take_gradients(0))
    again = rt.backward("mb", 0, hidden(), None, hidden(seed=1), bucket=1)  # run again after a stale backward below
    assert not again.accumulated and again.bucket == 0  # its loss belongs to step 0, where its gradient went
    late = rt.backward("other", 0, hidden(), None, hidden(seed=1), bucket=0)  # its step went without it
    assert late.bucket is None and rt.stats.samples_dropped == 2


def test_a_backward_whose_forward_is_too_old_is_refused_before_it_touches_anything():
    rt = runtime(global_batch=2)
    rt.backward("a", 0, hidden(), None, hidden(seed=1))  # step 1
    rt.forward("c", 0, hidden(), None)  # at step 1: its weights are kept for its backward
    rt.backward("b", 0, hidden(seed=2), None, hidden(seed=3))  # step 2
    assert rt.step == 2
    rt.backward("c", 0, hidden(), None, hidden(seed=1), forward_step=1)  # 1 step old: within the bound (and step 3)
    with pytest.raises(StaleForward, match="step 1, this stage is at step 3"):
        rt.backward("d", 0, hidden(), None, hidden(seed=1), forward_step=1)
    assert rt.pending_samples == 0 and rt.stats.stale_backwards == 1 and rt.stats.samples == 6


def test_gradients_go_to_the_bucket_of_their_step_and_a_step_takes_only_its_own():
    rt = runtime(solo=False)
    rt.backward("a", 0, hidden(), None, hidden(seed=1), bucket=0)
    rt.backward("b", 0, hidden(seed=2), None, hidden(seed=3), bucket=1)  # the next step's, computed meanwhile
    solo = runtime(solo=False)
    solo.backward("a", 0, hidden(), None, hidden(seed=1))
    taken = rt.take_gradients(0)
    assert taken.samples == 2 and taken.microbatch_ids == {"a"}
    assert torch.equal(taken.mean, solo.take_gradients().mean)
    rt.apply_step(taken)
    assert rt.step == 1 and rt.pending() == 2  # b waits for step 1
    rt.backward("c", 0, hidden(), None, hidden(seed=1), bucket=0)  # late for a step already taken: dropped
    assert rt.stats.samples_dropped == 2 and rt.pending_samples == 2


def test_replicas_that_apply_the_same_gradient_stay_bit_identical():
    a, b = runtime(solo=False), runtime(solo=False)
    assert a.digest() == b.digest()
    a.backward("x", 0, hidden(), None, hidden(seed=1))
    b.backward("y", 0, hidden(seed=2), None, hidden(seed=3))
    ga, gb = a.take_gradients(), b.take_gradients()
    mean = Accumulated(
        (ga.mean * ga.samples + gb.mean * gb.samples) / (ga.samples + gb.samples),
        4,
        ga.microbatch_ids | gb.microbatch_ids,
    )
    a.apply_step(mean)
    assert a.digest() != b.digest()
    b.apply_step(mean)
    assert a.digest() == b.digest() and a.step == b.step == 1


def test_a_round_that_failed_gives_the_gradient_back():
    rt = runtime(solo=False)
    rt.backward("a", 0, hidden(), None, hidden(seed=1))
    before = rt.accumulated_gradients()
    rt.give_back(rt.take_gradients())
    assert rt.pending_samples == 2
    assert all(torch.allclose(before[k], v) for k, v in rt.accumulated_gradients().items())


def test_cosine_schedule_warms_up_then_decays_to_its_floor():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=12, min_lr_ratio=0.1)
    assert [cfg.lr_at(s) for s in range(2)] == [0.5, 1.0]
    assert cfg.lr_at(2) == pytest.approx(1.0) and cfg.lr_at(7) == pytest.approx(0.55)
    assert cfg.lr_at(12) == pytest.approx(0.1) and cfg.lr_at(50) == pytest.approx(0.1)
    assert OptimizerConfig(lr=1.0, warmup_steps=2).lr_at(50) == 1.0


def test_catching_up_takes_the_step_number_keeps_the_weights_and_drops_what_was_accumulated():
    rt = runtime(solo=False)
    x = hidden()
    rt.forward("a", 0, x, None)
    rt.backward("a", 0, x, None, torch.randn_like(x), bucket=0)
    before, version = weights(rt), rt.version
    assert rt.pending_samples == 2
    rt.catch_up(5)
    assert rt.step == 5 and rt.pending_samples == 0 and rt.version == version  # the weights did not change
    assert all(torch.equal(v, rt.model.state_dict()[k]) for k, v in before.items())
    rt.catch_up(3)  # never backwards
    assert rt.step == 5
