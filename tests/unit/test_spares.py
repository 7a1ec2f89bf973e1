"""Hot spares (shared/policy/spares.py): a replica whose stage keeps at least the weakest
stage's capacity without it holds no samples, so its step rounds cost little."""

from __future__ import annotations

from shared.policy.spares import spare_replicas
from shared.policy.view import Replica, SwarmView

# The heterogeneous arena as it formed (CPU units; declared speeds in proportion)
ARENA = (
    ("a4", 0, 4.0),
    ("a1", 0, 1.0),
    ("b4", 1, 4.0),
    ("b1", 1, 1.0),
    ("c4", 2, 4.0),
    ("c2", 2, 2.0),
    ("d2", 3, 2.0),
    ("e2", 3, 2.0),
)


def declared(*replicas: tuple[str, int, float], num_stages: int = 4) -> SwarmView:
    return SwarmView(num_stages, tuple(Replica(sid, stage, 0.0, speed=speed) for sid, stage, speed in replicas))


def measured(*replicas: tuple[str, int, float], num_stages: int = 4) -> SwarmView:
    return SwarmView(num_stages, tuple(Replica(sid, stage, tput) for sid, stage, tput in replicas))


def test_the_weak_replicas_of_stages_above_the_weakest_are_spares_and_the_weakest_stage_has_none():
    spares = spare_replicas(declared(*ARENA))
    assert set(spares) == {"a1", "b1", "c2"}  # stages 0-2 keep 4 units, stage 3's 2 + 2 is the weakest
    assert "stage 2 keeps 4 FLOP/s declared without it, about the weakest stage's 4 or more" in spares["c2"]
    assert spare_replicas(measured(*ARENA)) == {  # measured throughputs, the same rule
        sid: why.replace("FLOP/s declared", "samples/s") for sid, why in spares.items()
    }


def test_a_stage_keeps_a_serving_replica_and_loses_no_capacity_below_the_weakest():
    # stage 0: three of 2; the weakest stage has 2: two of them are spares, one serves
    assert set(spare_replicas(measured(("a", 0, 2.0), ("b", 0, 2.0), ("c", 0, 2.0), ("d", 1, 2.0), num_stages=2))) == {
        "a",
        "b",
    }
    # equal peers two a stage: no stage can spare one
    assert spare_replicas(measured(("a", 0, 1.0), ("b", 0, 1.0), ("c", 1, 1.0), ("d", 1, 1.0), num_stages=2)) == {}
    # a lone replica is never a spare, however strong
    assert spare_replicas(measured(("a", 0, 9.0), ("c", 1, 1.0), num_stages=2)) == {}


def test_declared_speeds_within_a_fifth_of_the_weakest_stage_count_as_its_equal():
    """The arena's heterogeneous run as declared (GFLOP/s): stage 2's 4-unit peer alone
    (35.3) read under stage 3's two 2-unit ones (19.3 + 19.8), though their CPU caps are
    equal; its 1-unit partner is a spare all the same. The weakest stage never has one."""
    run = (
        ("a4", 0, 40.1),
        ("a1", 0, 9.1),
        ("b4", 1, 41.3),
        ("b2", 1, 18.2),
        ("c4", 2, 35.3),
        ("c1", 2, 6.8),
        ("d2", 3, 19.3),
        ("e2", 3, 19.8),
    )
    assert set(spare_replicas(declared(*run))) == {"a1", "b2", "c1"}
    # a weak replica on the weakest stage serves, however small its part
    assert spare_replicas(measured(("a", 0, 4.0), ("b", 0, 0.5), ("c", 1, 5.0), num_stages=2)) == {}
    # a stage that would fall clearly under the weakest keeps its replicas serving
    assert spare_replicas(measured(("a", 0, 3.0), ("b", 0, 2.0), ("c", 1, 4.0), num_stages=2)) == {}


def test_no_spares_until_every_stage_has_a_replica_and_every_speed_is_known():
    assert spare_replicas(measured(("a", 0, 4.0), ("b", 0, 1.0), num_stages=2)) == {}  # stage 1 empty
    assert spare_replicas(measured(("a", 0, 4.0), ("b", 0, 0.0), ("c", 1, 1.0), num_stages=2)) == {}  # b unmeasured
    assert spare_replicas(SwarmView(2)) == {}
    # declared speeds where all declared, even when throughputs are not measured yet
    assert set(spare_replicas(declared(("a", 0, 4.0), ("b", 0, 1.0), ("c", 1, 1.0), num_stages=2))) == {"b"}
