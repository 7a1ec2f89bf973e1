"""MFU from known tokens, seconds and peaks: the stage server's meter, a stage's figures at
the coordinator, the trainer's figures over a run, and ``swarm status``'s table."""

from __future__ import annotations

import pytest

from services.coordinator.utilisation import UtilisationBoard, check_utilisation, stage_utilisation
from services.stage_server.runtime import StageStats
from services.stage_server.utilisation import StageUtilisation
from services.status import render
from services.trainer.utilisation import run_utilisation
from shared.errors import BadPayload
from shared.flops import StageFlops
from shared.peak_flops import Peak
from tests.conftest import VirtualClock

# a stage of 1000 matmul weights and attention width 10: a forward costs 2000 FLOPs per token and 40 per
# (query, key) pair; 4 sequences of 8 tokens trained: 32 tokens, 256 pairs -> 3 x (64000 + 10240) = 222720
FLOPS = StageFlops(matmul_weights=1000, attention_width=10)
TRAINED = 3 * (2000 * 32 + 40 * 256)
PEAK = Peak(1e6, "setting", "test")


def meter(clock) -> tuple[StageUtilisation, StageStats]:
    stats = StageStats()
    return StageUtilisation(FLOPS, PEAK, stats, window_s=10.0, clock=clock), stats


def test_busy_and_wall_mfu_from_known_tokens_and_seconds():
    clock = VirtualClock()
    u, stats = meter(clock)
    stats.tokens_trained, stats.token_pairs_trained, stats.compute_s = 32, 256, 0.5
    stats.tokens_evaluated, stats.token_pairs_evaluated = 8, 64  # a forward: 2000 x 8 + 40 x 64 = 18560
    clock.now = 2.0
    report = u.report()
    assert report["model_flops"] == TRAINED + 18560 == 241280
    assert report["flops_per_s_busy"] == 241280 / 0.5 and report["mfu_busy"] == pytest.approx(0.48256)
    assert report["window_s"] == 2.0 and report["mfu_wall"] == pytest.approx(241280 / 2.0 / 1e6)
    assert (report["peak_source"], report["peak_flops"]) == ("setting", 1e6)


def test_wall_mfu_covers_the_last_window_only():
    clock = VirtualClock()
    u, stats = meter(clock)
    stats.tokens_trained, stats.token_pairs_trained = 32, 256
    for t in range(1, 13):  # one read a second; the work all came in the first second
        clock.now = float(t)
        report = u.report()
    assert report["window_s"] == 10.0 and report["mfu_wall"] == 0.0  # idle for the last 10 s
    stats.tokens_trained, stats.token_pairs_trained = 64, 512  # as much again
    clock.now = 13.0
    assert u.report()["mfu_wall"] == pytest.approx(TRAINED / 10.0 / 1e6)


def report(model_flops: float, compute_s: float, wall_flops_s: float, peak: float = 1e6) -> dict:
    return check_utilisation(
        {
            "model_flops": model_flops,
            "compute_s": compute_s,
            "peak_flops": peak,
            "peak_source": "probe",
            "peak_device": "cpu fp32 x 1 thread",
            "flops_per_s_wall": wall_flops_s,
            "mfu_busy": model_flops / compute_s / peak,
            "mfu_wall": wall_flops_s / peak,
            "tokens_trained": 32,
            "something_newer": 1,  # unknown fields are dropped
        }
    )


def test_a_stage_sums_its_replicas():
    stage = stage_utilisation([report(4e5, 1.0, 2e5), report(2e5, 1.0, 1e5, peak=2e6)])
    assert stage["replicas"] == 2 and stage["mfu_wall"] == pytest.approx(3e5 / 3e6)
    assert stage["mfu_busy"] == pytest.approx(6e5 / (1.0 * 1e6 + 1.0 * 2e6))
    assert stage["peaks"] == ["probe: cpu fp32 x 1 thread"] and stage_utilisation([]) is None


@pytest.mark.parametrize(
    "bad",
    [None, [], {"model_flops": -1}, {"mfu_busy": float("nan")}, {"tokens_trained": 1.5}, {"peak_source": "x" * 17}],
)
def test_a_bad_report_is_refused(bad):
    with pytest.raises(BadPayload):
        check_utilisation(bad)


def test_the_board_forgets_servers_no_longer_live():
    board = UtilisationBoard()
    board.record("a", report(4e5, 1.0, 2e5))
    board.record("gone", report(4e5, 1.0, 2e5))
    view = {"stages": [{"stage": 0, "replicas": [{"server_id": "a"}, {"server_id": "b"}]}]}
    board.annotate(view)
    assert view["stages"][0]["utilisation"]["replicas"] == 1 and "utilisation" not in view["stages"][0]["replicas"][1]
    board.annotate(view)
    assert "gone" not in board._reports


def test_the_trainer_divides_the_difference_over_the_run():
    def health(stage, flops, compute_s, peak=1e6):
        return {"stage": stage, "model_flops": flops, "compute_s": compute_s, "peak_flops": peak}

    labels = {"peak_source": "probe", "peak_device": "cpu"}
    before = {"a": health(0, 1e5, 0.1) | labels, "restarted": health(1, 9e9, 9.0) | labels}
    after = {
        "a": health(0, 5e5, 0.5) | labels,  # 4e5 FLOPs in 0.4 compute seconds of a 2-second run
        "restarted": health(1, 3e5, 1.0) | labels,  # fewer than before: a new process, counted from 0
        "joined": health(1, 1e5, 0.5, peak=3e6) | labels,
    }
    first, second = run_utilisation(before, after, wall_s=2.0, num_stages=2)
    assert (first["mfu_wall"], first["mfu_busy"]) == (pytest.approx(0.2), pytest.approx(1.0))
    assert second["replicas"] == 2 and second["mfu_wall"] == pytest.approx(4e5 / (2.0 * 4e6))
    assert second["mfu_busy"] == pytest.approx(4e5 / (1.0 * 1e6 + 0.5 * 3e6))


def test_status_shows_each_stage_mfu_with_its_peak():
    stage = {"stage": 0, "capacity": 10.0, "replicas": [], "utilisation": stage_utilisation([report(4e5, 1.0, 2e5)])}
    view = {"run_id": "r", "heartbeat_s": 1.0, "lease_s": 3.0, "stages": [stage, {**stage, "stage": 1}]}
    lines = render(view).splitlines()
    header = next(i for i, line in enumerate(lines) if "MFU busy" in line)
    assert lines[header].split()[:4] == ["stage", "replicas", "MFU", "busy"]
    assert lines[header + 1].split()[:4] == ["0", "1", "40%", "20%"]
    assert lines[header + 1].split()[4:] == [
        "200",
        "kFLOP/s",
        "1",
        "MFLOP/s",
        "probe:",
        "cpu",
        "fp32",
        "x",
        "1",
        "thread",
    ]
    assert "MFU" not in render({**view, "stages": [{**stage, "utilisation": None}]})
