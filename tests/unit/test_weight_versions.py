"""Weights versions: every backward runs on its forward's weights (PipeDream-2BW's stashing,
up to ``max_staleness``), whatever was written to the weights in between."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.stage_server.runtime import (
    NO_BUCKET,
    Accumulated,
    OptimizerConfig,
    StageRuntime,
    StaleForward,
    flat_parameters,
    load_flat_parameters,
)
from services.stage_server.state import load_stage_state, stage_state
from shared.model import PRESETS

CFG = PRESETS["tiny"]


def runtime(stage=1, num_stages=4, *, cfg=CFG, cache_size=16, max_staleness=1, checkpointing=False, outer=None):
    return StageRuntime(
        cfg,
        stage,
        num_stages,
        seed=0,
        optim=OptimizerConfig(global_batch=10**6),
        cache_size=cache_size,
        max_staleness=max_staleness,
        solo=False,
        activation_checkpointing=checkpointing,
        outer=outer,
    )


def hidden(seed=0, batch=2, seq=8):
    return torch.randn(batch, seq, CFG.d_model, generator=torch.Generator().manual_seed(seed))


def step(rt, seed=100):
    """One optimizer step with some gradient of 2 samples."""
    rt.backward(f"step-{seed}", 0, hidden(seed), None, hidden(seed + 1), bucket=rt.step)
    rt.apply_step(rt.take_gradients())


def reference_gradients(x, g, *, cfg=CFG, stage=1, num_stages=4):
    """The input and parameter gradients of (x, g) on the initial weights, in a runtime that never stepped."""
    rt = runtime(stage, num_stages, cfg=cfg)
    result = rt.backward("ref", 0, x, None, g, bucket=0)
    return result.grad_inputs, rt.take_gradients().mean


@pytest.mark.parametrize(
    "cache_size, checkpointing", [(16, False), (0, False), (16, True)], ids=["cached", "recomputed", "checkpointed"]
)
def test_a_backward_after_a_step_runs_on_its_forwards_weights(cache_size, checkpointing):
    """Before weights versions, the step cleared the cached graph and the backward was
    recomputed on the stepped weights: this test failed there (the gradients differ)."""
    rt = runtime(cache_size=cache_size, checkpointing=checkpointing)
    x, g = hidden(1), hidden(2)
    rt.forward("mb", 7, x, None)
    step(rt)
    assert rt.step == 1 and rt.versions_kept == 2 and rt.kept_bytes() > 0
    result = rt.backward("mb", 7, x, None, g, forward_step=0, bucket=1)
    grad_inputs, grads = reference_gradients(x, g)
    assert torch.equal(result.grad_inputs, grad_inputs)
    assert torch.equal(rt.take_gradients(1).mean, grads)
    assert rt.stats.other_weights_backwards == 0 and rt.stats.stale_gradients == 1
    assert rt.stats.recomputes == (1 if cache_size else 2)  # step()'s backward had no forward here
    assert rt.versions_kept == 1 and rt.kept_bytes() == 0  # the old version went with its last backward


def test_a_step_with_no_forward_in_flight_writes_in_place():
    rt = runtime()
    before = [id(p) for p in rt.params]
    step(rt)
    assert [id(p) for p in rt.params] == before and rt.stats.versions_made == 0


def test_the_optimizer_state_moves_with_the_new_version():
    """A step that keeps the old tensors for a forward in flight is the same step as one in place."""
    kept, in_place = runtime(), runtime()
    kept.forward("mb", 0, hidden(1), None)
    for rt in (kept, in_place):
        step(rt, 100)
        step(rt, 200)
    assert kept.stats.versions_made == 1 and in_place.stats.versions_made == 0
    assert kept.digest() == in_place.digest()
    assert torch.equal(flat_parameters(kept.params), flat_parameters(in_place.params))


def test_at_most_max_staleness_plus_one_versions_are_kept():
    rt = runtime(max_staleness=2)
    for i in range(5):  # a forward at every step, none of whose backwards comes
        rt.forward(f"mb{i}", 0, hidden(i), None)
        step(rt, 100 + 10 * i)
        assert rt.versions_kept <= 3
    assert rt.versions_kept == 3
    with pytest.raises(StaleForward):  # its forward's weights (step 0) were let go
        rt.backward("mb0", 0, hidden(0), None, hidden(9), forward_step=0, bucket=rt.step)


def test_a_gradient_never_goes_more_than_max_staleness_steps_after_its_weights():
    rt = runtime(max_staleness=1)
    x = hidden(1)
    rt.forward("mb", 0, x, None)
    step(rt)
    with pytest.raises(StaleForward, match="would go into step 2"):
        rt.backward("mb", 0, x, None, hidden(2), forward_step=0, bucket=2)
    assert rt.pending_samples == 0 and rt.stats.stale_backwards == 1


def test_another_replicas_forward_recomputes_on_this_replicas_version_of_its_step_in_global_mode():
    here, there = runtime(), runtime()
    x, g = hidden(1), hidden(2)
    there.forward("mb", 0, x, None)  # the forward ran on the other replica, at step 0
    here.forward("pin", 0, hidden(3), None)  # a forward of this replica keeps its step-0 weights
    step(here)
    result = here.backward("mb", 0, x, None, g, forward_step=0, bucket=1)
    assert torch.equal(result.grad_inputs, reference_gradients(x, g)[0])
    with pytest.raises(StaleForward, match="not kept here"):  # step 0's weights went with "pin"'s backward... not yet
        fresh = runtime()
        step(fresh)
        fresh.backward("mb", 0, x, None, g, forward_step=0, bucket=1)


def test_a_local_mode_replica_never_recomputes_another_replicas_forward():
    from services.stage_server.local_sync import OuterConfig

    rt = runtime(outer=OuterConfig(every=4))
    with pytest.raises(StaleForward, match="not kept here"):
        rt.backward("elsewhere", 0, hidden(1), None, hidden(2), forward_step=0, bucket=0)
    rt.forward("here", 0, hidden(1), None)
    assert rt.backward("here", 0, hidden(1), None, hidden(2), forward_step=0, bucket=0).accumulated


def test_loaded_and_averaged_weights_are_new_versions_too():
    rt, peer = runtime(), runtime()
    step(peer)
    x, g = hidden(1), hidden(2)
    rt.forward("a", 0, x, None)
    load_stage_state(rt, *stage_state(peer))  # a resync: the peer's weights and step
    assert rt.step == 1 and rt.digest() == peer.digest() and rt.versions_kept == 2
    rt.forward("b", 0, x, None)
    load_flat_parameters(rt, flat_parameters(rt.params) * 0.5)  # a drift repair or an outer step
    assert rt.versions_kept == 3
    a = rt.backward("a", 0, x, None, g, forward_step=0, bucket=1)
    b = rt.backward("b", 0, x, None, g, forward_step=1, bucket=1)
    assert torch.equal(a.grad_inputs, reference_gradients(x, g)[0])
    on_peer = peer.backward("b", 0, x, None, g, bucket=1)
    assert torch.equal(b.grad_inputs, on_peer.grad_inputs)
    assert rt.versions_kept == 1


def test_a_tied_head_stays_tied_across_versions():
    cfg = replace(CFG, tie_embeddings=True)
    rt = runtime(0, 1, cfg=cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    rt.forward("mb", 0, ids, ids)
    rt.backward("s", 0, ids, ids, None, bucket=0)
    rt.apply_step(rt.take_gradients())
    assert rt.stats.versions_made == 1 and rt.model.lm_head.weight is rt.model.wte.weight
    assert rt.model.wte.weight is rt.params[0] or any(p is rt.model.wte.weight for p in rt.params)


def test_a_retry_while_its_step_is_all_reduced_is_not_accumulated_again():
    """Hole 2: the bucket's ids entered the duplicate history only when the step was applied;
    a retry of the same microbatch between the round's start and its end was accumulated again
    (into the next step). This test failed there."""
    rt = runtime()
    x, g = hidden(1), hidden(2)
    rt.backward("mb", 0, x, None, g, bucket=0)
    taken = rt.take_gradients(0)  # the step round starts
    again = rt.backward("mb", 0, x, None, g, bucket=1)  # the trainer's retry, reserved for the next step
    assert not again.accumulated and again.bucket == 0 and rt.pending(1) == 0
    rt.give_back(taken, 0)  # the round failed: the ids are the bucket's again, still held once
    assert not rt.backward("mb", 0, x, None, g, bucket=1).accumulated
    rt.apply_step(rt.take_gradients(0))
    assert not rt.backward("mb", 0, x, None, g, bucket=1).accumulated and rt.pending(1) == 0


def test_a_dropped_round_lets_its_microbatches_be_accumulated_again():
    rt = runtime()
    rt.backward("mb", 0, hidden(1), None, hidden(2), bucket=0)
    rt.drop(rt.take_gradients(0))  # this replica missed the step: its samples are lost, not applied
    assert rt.backward("mb", 0, hidden(1), None, hidden(2), bucket=0).accumulated


def test_a_step_of_no_sample_is_refused():
    """Hole 4's last link: an empty bucket stepped AdamW with a zero gradient (momentum and
    weight decay still moved the weights). This test failed there."""
    rt = runtime()
    before = rt.digest()
    with pytest.raises(AssertionError, match="at least one sample"):
        rt.apply_step(rt.take_gradients(0))
    with pytest.raises(AssertionError, match="at least one sample"):
        rt.apply_step(Accumulated(torch.zeros(sum(p.numel() for p in rt.params)), 0, frozenset()))
    assert rt.digest() == before and rt.step == 0


def test_steady_training_alternates_between_two_sets_of_tensors_and_stays_exact():
    """A forward in flight across every step: each step keeps the forward's tensors, and the
    set a finished backward let go carries the next version (no allocation per step)."""
    rt, in_place = runtime(), runtime()
    ids, x = set(), hidden(1)
    for i in range(4):
        rt.forward(f"mb{i}", 0, x, None)
        step(rt, 100 + 10 * i)
        step(in_place, 100 + 10 * i)
        result = rt.backward(f"mb{i}", 0, x, None, hidden(2), forward_step=i, bucket=NO_BUCKET)  # input gradient only
        assert rt.versions_kept == 1 and result.grad_inputs is not None
        ids.add(id(rt.params[0]))
    assert rt.stats.versions_made == 4 and len(ids) == 2
    assert torch.equal(flat_parameters(rt.params), flat_parameters(in_place.params))
    assert rt.digest() == in_place.digest()


def test_a_caught_up_step_refuses_a_backward_whose_forward_ran_elsewhere_and_the_state_carries_it():
    """``catch_up`` labels the weights with steps they never took: a backward of a forward
    that another replica ran at such a step (on the real weights of that step) must not be
    recomputed here, nor on a replica that took this state; a forward run here at that step
    still runs its backward on its own weights."""
    rt = runtime(max_staleness=1)
    rt.catch_up(3)
    assert rt.step == 3 and rt.caught_up == {2, 3}  # older labels: refused by the staleness bound anyway
    x, g = hidden(1), hidden(2)
    with pytest.raises(StaleForward, match="caught up"):
        rt.backward("elsewhere", 7, x, None, g, forward_step=3, bucket=3)
    rt.forward("here", 7, x, None)
    result = rt.backward("here", 7, x, None, g, forward_step=3, bucket=3)
    assert torch.equal(result.grad_inputs, reference_gradients(x, g)[0])  # the initial weights: never stepped

    tensors, metadata = stage_state(rt)
    assert metadata["caught_up"] == [2, 3]
    joiner = runtime(max_staleness=1)
    load_stage_state(joiner, tensors, metadata)
    assert joiner.step == 3 and joiner.caught_up == {2, 3}
    with pytest.raises(StaleForward, match="caught up"):
        joiner.backward("elsewhere", 7, x, None, g, forward_step=3, bucket=3)
    step(joiner)  # a real step after the catch-up: its weights are every replica's step 4
    joiner.backward("next", 7, x, None, g, forward_step=4, bucket=4)  # not refused

    load_stage_state(joiner, *stage_state(runtime()))  # a state without catch-ups replaces the history
    assert joiner.caught_up == set()
    with pytest.raises(Exception, match="caught_up"):
        load_stage_state(joiner, tensors, {**metadata, "caught_up": "2,3"})


def test_after_a_catch_up_a_forward_run_with_its_backward_goes_into_the_caught_up_step():
    """The churn arena's stall (2026-11-29): a stage recovered from a checkpoint of step 32
    caught up to 35; a chain's last hop runs its forward with its backward (no forward step
    named), and its weights were still labelled with step 32, so every such gradient "would
    go into step 35" past the staleness bound: refused, run again, refused, for minutes.
    The weights are the stage's step 35 now (that is what catching up means): a backward on
    them goes into 35; a forward that ran elsewhere at a caught-up step is still refused."""
    rt = runtime(max_staleness=1)
    rt.catch_up(3)
    x, g = hidden(1), hidden(2)
    result = rt.backward("now", 7, x, None, g, bucket=3)  # the forward runs now, on these weights
    assert torch.equal(result.grad_inputs, reference_gradients(x, g)[0])
    assert rt.pending_samples == x.shape[0]
    with pytest.raises(StaleForward, match="caught up"):
        rt.backward("elsewhere", 7, x, None, g, forward_step=3, bucket=3)
