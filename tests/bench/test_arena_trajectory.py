"""``bench.arena_trajectory``: the arena's reference run replayed with one of the mesh's
deviations at a time. Its exact replay must be the arena's own reference (else every
figure it gives is off), and each deviation must change the trajectory."""

from __future__ import annotations

import pytest

from bench.arena import FULL, reference_targets
from bench.arena_trajectory import STAGES, parse, run


def test_the_exact_replay_is_the_arena_s_reference_and_each_deviation_moves_it():
    reference = reference_targets(FULL.work, STAGES, {1, 2, 3})
    exact = run("exact", 3)
    assert exact == [reference[1], reference[2], reference[3]]
    for config in ("wire=int8", "wire=fp32,round=int4", "stale=1"):
        assert run(config, 3) != exact, config  # losses to 4 decimals, as the arena reads them


def test_a_config_is_checked_before_anything_runs():
    assert parse("wire=int8,round=int4+ef") == {
        "wire": "int8", "round": "int4", "ef": True, "stale": 0.0, "predict": False
    }  # fmt: skip
    assert parse("stale=0.5+predict")["predict"] is True
    for bad in ("wire=int9", "round=int4+fast", "stale=2", "sideways=1"):
        with pytest.raises(ValueError):
            parse(bad)
