"""``swarm status``'s table from a GET /swarm view."""

from __future__ import annotations

from services.status import render


def view(duplicates: int) -> dict:
    replica = {"url": "http://127.0.0.1:9001", "server_id": "s0-1", "throughput": 10.0, "queue_length": 0}
    return {
        "run_id": "r",
        "heartbeat_s": 1.0,
        "lease_s": 3.0,
        "stages": [
            {
                "stage": 0,
                "capacity": 10.0,
                "replicas": [{**replica, "lease_age_s": 0.5}],
                "step": {
                    "step": 7,
                    "accumulated": 8,
                    "global_batch": 32,
                    "samples_dropped": 4,
                    "duplicates_refused": duplicates,
                    "steps_lost_total": 12,
                },
            }
        ],
    }


def test_each_stage_shows_its_step_next_batch_dropped_samples_refused_duplicates_and_lost_steps():
    lines = render(view(3)).splitlines()
    header, row = lines[2].split(), lines[3].split()
    assert header[-4:] == ["dropped", "duplicates", "steps", "lost"]
    assert row[3:] == ["7", "8/32", "4", "3", "12"]
    assert render(view(0)).splitlines()[3].split()[-2] == "0"


def test_the_standby_servers_waiting_are_listed():
    assert "standby" not in render(view(0))
    lines = render({**view(0), "standby": [{"server_id": "standby-1", "region": "Tokyo"}]}).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("standby"))
    assert lines[at].endswith(": 1") and lines[at + 1].split() == ["standby-1", "region", "Tokyo"]
