"""The arena's compute bounds and its speed-balanced pipelining split (``bench/arena.py``),
checked on the heterogeneous scenario as issue 28 works them out by hand."""

from __future__ import annotations

from bench.arena import FULL, HETERO, balanced_layers, compute_bounds, layer_splits


def test_every_split_of_the_layers_has_a_layer_a_stage():
    splits = list(layer_splits(8, 4))
    assert len(splits) == 35 and len(set(splits)) == 35  # C(7, 3) compositions
    assert all(sum(s) == 8 and min(s) >= 1 for s in splits)


def test_the_heterogeneous_scenario_s_bounds():
    """CPU units 1:1:2:2:2:4:4:4 on 4 stages of 2 layers: the mesh's weakest stage can hold 4
    of the 20 units (2 a layer); pipelining's 4 strongest servers (2, 4, 4, 4 units) with
    equal splits are bound by the 2-unit rank (1 a layer): 2x; split 1/2/2/3 (or the like)
    by speed, its slowest rank has 4/3 a layer: the mesh's bound is 1.5x that."""
    cores = [cap for _, cap in HETERO.servers]
    unit = min(cores)
    ranks = [int(r[1:]) for r in HETERO.pipeline_ranks()]
    assert [cores[i] / unit for i in ranks] == [2, 4, 4, 4]
    b = compute_bounds(cores, 4, FULL.work, ranks)
    assert round(b["mesh"] / unit, 9) == 2 and round(b["pipelining"] / unit, 9) == 1
    assert round(b["pipelining balanced"] / unit, 9) == round(4 / 3, 9)
    assert round(b["mesh"] / b["pipelining"], 9) == 2 and round(b["mesh"] / b["pipelining balanced"], 9) == 1.5
    assert sum(b["balanced_layers"]) == 8 and b["balanced_layers"][0] == 1  # the 2-unit rank takes one layer


def test_equal_ranks_keep_equal_splits():
    assert balanced_layers([1.0, 1.0, 1.0, 1.0], 8) == (2, 2, 2, 2)
    assert balanced_layers([1.0, 3.0], 8) == (2, 6)
