"""The pure pieces of averaging: part splitting, the weighted reduction, loading a flat vector
back into a stage, the bytes formula, message validation, and one part's reducer (asyncio,
no sockets)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from services.coordinator.averaging import round_shares
from services.stage_server.aggregation import EPSILON_WEIGHT, centered_clip, sample_weight
from services.stage_server.allreduce import (
    AveragingRound,
    PartMessage,
    PartReducer,
    RoundConflict,
    RoundSpec,
    _parse_reduced,
    _values_sent,
    backup_reducer,
    retry_round_id,
    split_bounds,
    weighted_mean,
)
from services.stage_server.runtime import StageRuntime, apply_average, flat_parameters, load_flat_parameters, snapshot
from shared.codec import unpack_message
from shared.errors import BadPayload, WrongStage
from shared.model import PRESETS


@pytest.mark.parametrize("n, k", [(10, 3), (9, 3), (2, 5), (0, 2), (7, 1), (198272, 7)])
def test_split_bounds_are_contiguous_cover_everything_and_differ_by_at_most_one(n, k):
    bounds = split_bounds(n, k)
    sizes = [stop - start for start, stop in bounds]
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n


@pytest.mark.parametrize(
    "n, shares",
    [(1000, (1.0, 4.0)), (10, (0.2, 0.8)), (3, (0.001, 1.0, 1.0)), (2, (1.0, 1e-9, 1.0)), (0, (1.0, 2.0)), (7, (5.0,))],
)
def test_split_bounds_by_shares_cover_everything_in_proportion_with_no_empty_part(n, shares):
    bounds = split_bounds(n, len(shares), shares)
    sizes = [stop - start for start, stop in bounds]
    assert len(bounds) == len(shares) and bounds[0][0] == 0 and bounds[-1][1] == n and sum(sizes) == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    if n >= len(shares):
        assert min(sizes) >= 1
    if n >= 10 * len(shares):
        exact = [n * x / sum(shares) for x in shares]
        assert all(abs(size - e) <= 1 for size, e in zip(sizes, exact)), (sizes, exact)
    assert split_bounds(n, len(shares), shares) == bounds  # every member computes the same bounds


def test_round_shares_give_a_member_without_samples_a_tenth_and_equal_parts_otherwise():
    assert round_shares([24, 0]) == [0.909091, 0.090909]
    assert round_shares([0, 8, 24]) == [0.047619, 0.47619, 0.47619]
    assert round_shares([8, 24]) is None  # both hold samples: equal parts, even links
    assert round_shares([0, 0]) is None
    assert round_shares([32]) is None


def test_weighted_mean_is_sum_of_w_x_over_sum_of_w():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=gen) for _ in range(3)]
    ws = [1.0, 3.0, 6.0]
    expected = (xs[0] * 0.1 + xs[1] * 0.3 + xs[2] * 0.6).double()
    got = weighted_mean({i: (w, x) for i, (w, x) in enumerate(zip(ws, xs))})
    assert got.dtype == torch.float32 and (got.double() - expected).abs().max() < 1e-6
    # order of arrival does not matter; one contributor is returned exactly
    assert torch.equal(got, weighted_mean({2: (ws[2], xs[2]), 0: (ws[0], xs[0]), 1: (ws[1], xs[1])}))
    assert torch.equal(weighted_mean({4: (7.5, xs[0])}), xs[0])
    assert torch.equal(
        weighted_mean({0: (0.0, xs[0]), 1: (0.0, xs[1])}), torch.zeros_like(xs[0])
    )  # nobody served a sample


def test_sample_weight_counts_samples_since_the_last_round_and_an_idle_replica_barely():
    assert sample_weight(130, 100) == 30.0
    assert sample_weight(100, 100) == EPSILON_WEIGHT
    assert (
        weighted_mean({0: (sample_weight(5, 5), torch.zeros(2)), 1: (sample_weight(10, 0), torch.ones(2))})[0] > 0.999
    )


def test_backup_reducer_is_the_next_member_alive_in_cyclic_order():
    assert backup_reducer(1, 3, {1}) == 2
    assert backup_reducer(2, 3, {2}) == 0
    assert backup_reducer(0, 4, {0, 1}) == 2
    assert backup_reducer(0, 3, {0, 1, 2}) is None
    assert backup_reducer(0, 1, {0}) is None
    assert retry_round_id("r7", 2) == "r7/retry-2"


@pytest.mark.parametrize("P, k", [(198272, 3), (12, 4), (1000, 2), (10, 1)])
def test_values_sent_is_about_2_p_times_k_minus_1_over_k(P, k):
    sent = [_values_sent(P, k, i) for i in range(k)]
    # k-1 parts out, and one's reduced part to k-1 members
    for i, (start, stop) in enumerate(split_bounds(P, k)):
        assert sent[i] == (P - (stop - start)) + (k - 1) * (stop - start)
    assert sum(sent) == 2 * P * (k - 1)  # every value goes out twice, but a member's own part
    assert max(sent) <= 2 * P * (k - 1) / k + k


def test_load_flat_parameters_round_trips_into_a_new_version_and_keeps_the_old_for_the_forward_in_flight():
    rt = StageRuntime(PRESETS["tiny"], 1, 4, seed=0)
    rt.forward("mb", 0, torch.randn(1, 4, PRESETS["tiny"].d_model), None)
    assert rt._cache
    flat, samples = snapshot(rt)
    assert flat.dtype == torch.float32 and flat.numel() == sum(p.numel() for p in rt.params) and samples == 0
    new = torch.arange(flat.numel(), dtype=torch.float32) / flat.numel()
    load_flat_parameters(rt, new)
    assert torch.equal(flat_parameters(rt.params), new)
    assert rt.version == 1 and rt._cache["mb"].version == 0 and rt.versions_kept == 2
    assert torch.equal(flat_parameters(rt._kept[0]), flat)  # the forward's weights, untouched
    assert torch.equal(rt.params[0].reshape(-1), new[: rt.params[0].numel()])
    with pytest.raises(AssertionError):
        load_flat_parameters(rt, new[:-1])


# --------------------------------------------------------------------------- messages
def start(**overrides):
    return {
        "round_id": "r1",
        "stage": 1,
        "members": ["http://a:1", "http://b:2/"],
        "index": 1,
        "codec": "int8",
        "timeout_s": 5,
        **overrides,
    }


def test_round_spec_validates_and_refuses_another_stage():
    spec = RoundSpec.from_message(start(), stage=1)
    assert spec.members == ("http://a:1", "http://b:2") and spec.k == 2 and spec.timeout_s == 5.0
    for bad in [
        start(round_id=""),
        start(round_id="a/b"),
        start(index=2),
        start(index=True),
        start(members="http://a"),
        start(members=["http://a", "http://a"]),
        start(codec="raw"),
        start(timeout_s=-1),
        start(timeout_s=float("nan")),
    ]:
        with pytest.raises(BadPayload):
            RoundSpec.from_message(bad, stage=1)
    with pytest.raises(WrongStage):
        RoundSpec.from_message(start(stage=2), stage=1)
    assert (
        spec.aggregator == "mean"
        and RoundSpec.from_message(start(aggregator="centered_clip"), stage=1).aggregator == "centered_clip"
    )
    for bad in ["median", 1, None]:
        with pytest.raises(BadPayload, match="aggregator"):
            RoundSpec.from_message(start(aggregator=bad), stage=1)


def test_part_message_validates_weight_sender_and_part():
    msg = PartMessage.from_message({"round_id": "r1/retry-2", "from": 0, "part": 2, "weight": 3})
    assert msg == PartMessage("r1/retry-2", 0, 2, 3.0)
    assert (
        PartMessage.from_message({"round_id": "r1", "from": 0, "part": 0, "weight": 0}).weight == 0.0
    )  # a step round's idle replica
    for bad in [
        {"from": 0, "part": 0, "weight": -1},
        {"from": 0, "part": 0, "weight": True},
        {"from": "0", "part": 0, "weight": 1},
        {"from": 0, "weight": 1},
    ]:
        with pytest.raises(BadPayload):
            PartMessage.from_message({"round_id": "r1", **bad})


# --------------------------------------------------------------------------- one part's reducer
def loop_time() -> float:
    return asyncio.get_running_loop().time()


async def test_reducer_reduces_once_every_expected_member_sent():
    reducer = PartReducer("r1", 0, 4, "fp32", 4096, expected={0, 1})
    reducer.add(0, 1.0, torch.zeros(4))
    waiting = asyncio.ensure_future(reducer.reduced(loop_time() + 60))
    await asyncio.sleep(0)
    assert not waiting.done()
    reducer.add(1, 3.0, torch.full((4,), 4.0))
    reduced = await asyncio.wait_for(waiting, 5)
    assert (
        torch.equal(reduced.values, torch.full((4,), 3.0)) and reduced.contributors == (0, 1) and reduced.weight == 4.0
    )
    # The reply every fetcher decodes holds the same values.
    assert torch.equal(_parse_reduced(unpack_message(reduced.body), 4).values, reduced.values)
    with pytest.raises(RoundConflict):
        reducer.add(2, 1.0, torch.zeros(4))


async def test_reducer_at_its_deadline_reduces_what_arrived_and_refuses_bad_parts():
    reducer = PartReducer("r1", 1, 3, "fp32", 4096, expected={0, 1, 2})
    reducer.add(1, 2.0, torch.ones(3))
    with pytest.raises(RoundConflict):
        reducer.add(1, 2.0, torch.ones(3))  # a member sends once
    with pytest.raises(BadPayload):
        reducer.add(0, 2.0, torch.ones(4))  # another part's size
    reduced = await reducer.reduced(loop_time() + 0.05)
    assert reduced.contributors == (1,) and torch.equal(reduced.values, torch.ones(3))


async def test_int8_reducer_serves_exactly_what_it_keeps():
    gen = torch.Generator().manual_seed(1)
    reducer = PartReducer("r1", 0, 5000, "int8", 4096, expected={0, 1})
    xs = [torch.randn(5000, generator=gen) for _ in range(2)]
    reducer.add(0, 1.0, xs[0])
    reducer.add(1, 1.0, xs[1])
    reduced = await reducer.reduced(loop_time() + 5)
    fetched = _parse_reduced(unpack_message(reduced.body), 5000)
    assert torch.equal(fetched.values, reduced.values)
    mean = (xs[0] + xs[1]) / 2
    assert ((reduced.values - mean).norm() / mean.norm()).item() < 0.02


async def test_closed_reducer_wakes_its_waiters_with_a_conflict():
    reducer = PartReducer("r1", 0, 2, "fp32", 4096, expected={0, 1})
    waiting = asyncio.ensure_future(reducer.reduced(loop_time() + 60))
    await asyncio.sleep(0)
    reducer.close()
    with pytest.raises(RoundConflict):
        await asyncio.wait_for(waiting, 5)


async def test_backup_reducer_waits_for_the_members_that_reached_the_main_part():
    spec = RoundSpec.from_message(start(members=["http://a", "http://b", "http://c"], index=0, codec="fp32"), stage=1)
    rnd = AveragingRound(spec, 9, 4096, loop_time())
    flat = torch.arange(9, dtype=torch.float32)
    rnd.set_snapshot(flat, 1.0)
    with pytest.raises(RoundConflict):
        rnd.reducer("r1", 1)  # member 0 reduces part 0 only
    with pytest.raises(RoundConflict):
        rnd.reducer("r1/retry-0", 0)  # nobody retries at the failed reducer itself
    backup, _ = rnd.reducer(retry_round_id("r1", 2), 2)
    assert backup.contributions.keys() == {0}  # our own original part 2, already in
    rnd.accept(PartMessage("r1", 1, 0, 3.0), torch.zeros(3))
    rnd.set_main_contributors((0, 1))  # member 2 never reached us: the backup waits for 0 and 1
    rnd.accept(PartMessage(retry_round_id("r1", 2), 1, 2, 3.0), torch.zeros(3))
    reduced = await asyncio.wait_for(backup.reduced(loop_time() + 60), 5)
    assert reduced.contributors == (0, 1) and torch.equal(reduced.values, flat[6:9] * 0.25)
    with pytest.raises(BadPayload):
        rnd.accept(PartMessage("r1", 0, 0, 1.0), torch.zeros(3))  # from ourselves
    rnd.close()
    with pytest.raises(RoundConflict):
        rnd.reducer("r1", 0)


def test_apply_average_keeps_what_was_learned_during_the_round():
    rt = StageRuntime(PRESETS["tiny"], 1, 4, seed=0)
    before, _ = snapshot(rt)
    averaged = torch.zeros_like(before)
    step = torch.full_like(before, 0.5)
    load_flat_parameters(rt, before + step)  # an optimizer step taken while the round ran
    apply_average(rt, before, averaged)
    assert torch.allclose(flat_parameters(rt.params), averaged + step)


# --------------------------------------------------------------------------- CenteredClip
def honest_and_attacker(attack: str, n: int = 5000, seed: int = 0) -> tuple[dict, torch.Tensor, float]:
    """3 honest members around a common centre (spread ~0.01 per value) and member 3 the
    attacker; returns the contributions, the honest mean and the honest spread (the largest
    distance of an honest member from the honest mean)."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(n, generator=g)
    honest = [centre + 0.01 * torch.randn(n, generator=g) for _ in range(3)]
    attacker = {"sign_flip": -1000 * honest[0], "scale": 1000 * honest[0], "random": 100 * torch.randn(n, generator=g)}[
        attack
    ]
    contributions = {i: (32.0, x) for i, x in enumerate(honest)} | {3: (32.0, attacker)}
    honest_mean = torch.stack(honest).mean(0)
    spread = max(float((x - honest_mean).norm()) for x in honest)
    return contributions, honest_mean, spread


@pytest.mark.parametrize("attack", ["sign_flip", "scale", "random"])
def test_centered_clip_stays_within_the_honest_spread_where_the_mean_does_not(attack):
    contributions, honest_mean, spread = honest_and_attacker(attack)
    clipped, iterations = centered_clip(contributions)
    assert float((clipped - honest_mean).norm()) <= spread, "CenteredClip left the honest members' spread"
    assert iterations < 50, "did not reach its fixed point"
    assert float((weighted_mean(contributions) - honest_mean).norm()) > 100 * spread, (
        "the plain mean should be dragged away"
    )


def test_centered_clip_caps_a_weight_the_attacker_claims():
    contributions, honest_mean, spread = honest_and_attacker("sign_flip")
    contributions[3] = (1e15, contributions[3][1])  # weights are self-reported
    clipped, _ = centered_clip(contributions)
    assert float((clipped - honest_mean).norm()) <= spread


def test_centered_clip_of_honest_members_is_their_mean_or_close_to_it():
    g = torch.Generator().manual_seed(1)
    xs = {i: (1.0, torch.randn(1000, generator=g)) for i in range(2)}
    assert torch.allclose(centered_clip(xs)[0], weighted_mean(xs), atol=1e-6)  # two members: nothing to clip
    same = {i: (float(i + 1), torch.full((10,), 2.5)) for i in range(4)}
    assert torch.equal(centered_clip(same)[0], torch.full((10,), 2.5))
    centre = torch.randn(1000, generator=g)
    close = {i: (1.0, centre + 0.01 * torch.randn(1000, generator=g)) for i in range(4)}
    mean = weighted_mean(close)
    assert float((centered_clip(close)[0] - mean).norm()) < 0.5 * max(
        float((x - mean).norm()) for _, x in close.values()
    )


async def test_reducer_with_centered_clip_serves_the_robust_centre():
    contributions, honest_mean, spread = honest_and_attacker("sign_flip", n=64)
    reducer = PartReducer("r1", 0, 64, "fp32", 4096, expected=set(contributions), aggregator="centered_clip")
    for member, (w, x) in contributions.items():
        reducer.add(member, w, x)
    reduced = await asyncio.wait_for(reducer.reduced(loop_time() + 60), 5)
    assert float((reduced.values - honest_mean).norm()) <= spread and reduced.contributors == (0, 1, 2, 3)
