"""Every service's ``/metrics`` while a real swarm trains: it parses as Prometheus text,
holds the metrics of its service, and its counters move between two scrapes. The swarm
logs JSON lines (``SWARM_LOG_FORMAT=json``), one object per line."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.processes import fixed_port
from tests.e2e.conftest import get_json, wait_until
from tests.e2e.small_swarm import START_S, start_small_swarm, trainer_step

pytestmark = pytest.mark.e2e

STAGE_METRICS = [
    "swarm_http_requests_total",
    "swarm_http_request_duration_seconds_bucket",
    "swarm_http_request_bytes_total",
    "swarm_http_response_bytes_total",
    "swarm_stage_tensor_bytes_total",
    "swarm_stage_samples_total",
    "swarm_stage_queue_depth",
    "swarm_stage_throughput_samples_per_second",
    "swarm_stage_optimizer_steps_total",
    "swarm_stage_averaging_rounds_total",
]
COORDINATOR_METRICS = [
    "swarm_http_requests_total",
    "swarm_coordinator_replicas",
    "swarm_coordinator_stage_capacity_samples_per_second",
    "swarm_coordinator_weakest_stage",
    "swarm_coordinator_weakest_stage_capacity_samples_per_second",
    "swarm_coordinator_events_total",
    "swarm_coordinator_averaging_rounds_started_total",
    "swarm_coordinator_step_rounds_started_total",
]
TRAINER_METRICS = [
    "swarm_trainer_hops_total",
    "swarm_trainer_hop_duration_seconds_bucket",
    "swarm_trainer_tensor_bytes_total",
    "swarm_trainer_microbatches_total",
    "swarm_trainer_tokens_total",
    "swarm_trainer_step",
    "swarm_trainer_loss",
    "swarm_trainer_tokens_per_second",
]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain"), resp.headers["Content-Type"]
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def names(samples: dict) -> set[str]:
    return {n for n, _ in samples}


def test_every_service_exposes_metrics_that_move_while_the_swarm_trains(processes, tmp_path):
    port = fixed_port()
    swarm = start_small_swarm(processes, trainer_env={"SWARM_METRICS_PORT": str(port)}, log_format="json")
    trainer = f"http://127.0.0.1:{port}"
    services = {"coordinator": swarm.coordinator, **{url: url for _, url in swarm.servers}, "trainer": trainer}

    def training() -> bool:
        assert swarm.trainer.poll() is None, f"the trainer exited with status {swarm.trainer.returncode}"
        return trainer_step(swarm.coordinator) >= 2

    wait_until(training, START_S, "the trainer to report step 2", poll_s=0.2)
    before = {name: scrape(url) for name, url in services.items()}
    step = int(total(before["trainer"], "swarm_trainer_step"))
    wait_until(
        lambda: trainer_step(swarm.coordinator) >= step + 3, 60, f"the trainer to pass step {step + 3}", poll_s=0.2
    )
    after = {name: scrape(url) for name, url in services.items()}

    # a hot spare (shared/policy/spares.py: stage 0's two replicas against stage 1's one) holds
    # no samples; it takes every step all the same (a member of every step round)
    spares = {r["url"] for st in get_json(swarm.coordinator + "/swarm")["stages"] for r in st["replicas"] if r["spare"]}
    assert {stage for stage, url in swarm.servers if url in spares} <= {0}, spares
    for stage, url in swarm.servers:
        assert set(STAGE_METRICS) <= names(after[url]), set(STAGE_METRICS) - names(after[url])
        moving = [("swarm_stage_optimizer_steps_total", {})]
        if url not in spares:
            moving += [
                ("swarm_stage_samples_total", {}),
                ("swarm_http_requests_total", {"endpoint": "/chain", "status": "200"}),
                ("swarm_stage_tensor_bytes_total", {"direction": "out"}),
            ]
        for metric, labels in moving:
            assert total(after[url], metric, **labels) > total(before[url], metric, **labels) > 0, (url, metric)
        assert total(after[url], "swarm_build_info", stage=str(stage)) == 1
    assert set(COORDINATOR_METRICS) <= names(after["coordinator"]), set(COORDINATOR_METRICS) - names(
        after["coordinator"]
    )
    coordinator = after["coordinator"]
    assert [total(coordinator, "swarm_coordinator_replicas", stage=str(s)) for s in range(2)] == [2, 1]
    assert total(coordinator, "swarm_coordinator_weakest_stage") == 1  # one replica against two
    heartbeats = {"endpoint": "/heartbeat", "status": "200"}
    assert total(coordinator, "swarm_http_requests_total", **heartbeats) > total(
        before["coordinator"], "swarm_http_requests_total", **heartbeats
    )
    assert total(coordinator, "swarm_http_requests_total", endpoint="/progress", status="200") > total(
        before["coordinator"], "swarm_http_requests_total", endpoint="/progress", status="200"
    )
    assert set(TRAINER_METRICS) <= names(after["trainer"]), set(TRAINER_METRICS) - names(after["trainer"])
    for metric, labels in [
        ("swarm_trainer_tokens_total", {}),
        ("swarm_trainer_hops_total", {"outcome": "ok"}),
        ("swarm_trainer_step", {}),
        ("swarm_trainer_tensor_bytes_total", {"direction": "sent"}),
    ]:
        assert total(after["trainer"], metric, **labels) > total(before["trainer"], metric, **labels) > 0, metric
    # chain routing (the default): the trainer sends token ids and receives no activation or gradient
    assert total(after["trainer"], "swarm_trainer_tensor_bytes_total", direction="received") == 0
    assert 0 < total(after["trainer"], "swarm_trainer_loss") < 10
    print(
        f"metrics: trainer step {step} -> {int(total(after['trainer'], 'swarm_trainer_step'))}, "
        f"{int(total(after['trainer'], 'swarm_trainer_tokens_total'))} tokens, coordinator weakest-stage capacity "
        f"{total(coordinator, 'swarm_coordinator_weakest_stage_capacity_samples_per_second'):.1f} samples/s"
    )

    processes.stop_all()
    for log in sorted(tmp_path.glob("*.log")):  # the coordinator's, every server's and the trainer's
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        assert records and all(isinstance(r, dict) and r.get("event") and r.get("level") for r in records), log.name
    trainer_events = [
        json.loads(line)["event"] for line in (tmp_path / "trainer.log").read_text().splitlines() if line.strip()
    ]
    assert "train.start" in trainer_events and "metrics.serving" in trainer_events
