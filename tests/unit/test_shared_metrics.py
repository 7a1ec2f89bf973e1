"""shared.metrics without HTTP: per-app registries, state read at scrape time, tensor bytes by codec."""

from __future__ import annotations

import math

import torch
from prometheus_client.parser import text_string_to_metric_families

from shared.codec import encode_tensor
from shared.metrics import Metrics, counter, gauge, tensor_bytes


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed back from the text format."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_each_app_has_its_own_registry():
    a, b = Metrics("stage_server", stage="0"), Metrics("stage_server", stage="1")  # same names: no clash
    a.observe_request("/forward", "POST", 200, 0.01, 100, 50)
    a.observe_request("/forward", "POST", 200, 0.02, 100, 50)
    b.observe_request("/forward", "POST", 503, 0.001, 100, 0)
    sa, sb = samples(a), samples(b)
    key = ("swarm_http_requests_total", (("endpoint", "/forward"), ("method", "POST"), ("status", "200")))
    assert sa[key] == 2 and key not in sb
    assert sb[("swarm_http_requests_total", (("endpoint", "/forward"), ("method", "POST"), ("status", "503")))] == 1
    assert sa[("swarm_http_request_bytes_total", (("endpoint", "/forward"),))] == 200
    assert sa[("swarm_http_response_bytes_total", (("endpoint", "/forward"),))] == 100
    assert sa[("swarm_http_request_duration_seconds_count", (("endpoint", "/forward"), ("method", "POST")))] == 2
    assert math.isclose(
        sa[("swarm_http_request_duration_seconds_sum", (("endpoint", "/forward"), ("method", "POST")))], 0.03
    )
    assert sa[("swarm_build_info", (("service", "stage_server"), ("stage", "0")))] == 1


def test_state_is_read_at_every_scrape():
    metrics = Metrics("test")
    state = {"queue": 3, "steps": {("0",): 1.0, ("1",): 4.0}}
    metrics.add_state(
        lambda: [
            gauge("swarm_test_queue", "q", state["queue"]),
            counter("swarm_test_steps", "s", state["steps"], ["stage"]),
        ]
    )
    assert samples(metrics)[("swarm_test_queue", ())] == 3
    state["queue"] = 7
    state["steps"] = {("0",): 2.0, ("1",): 5.0}
    after = samples(metrics)
    assert after[("swarm_test_queue", ())] == 7
    assert (
        after[("swarm_test_steps_total", (("stage", "0"),))] == 2
        and after[("swarm_test_steps_total", (("stage", "1"),))] == 5
    )


def test_tensor_bytes_by_codec():
    x = torch.randn(2, 8, 128)
    msg = {
        "inputs": encode_tensor(x, "int8"),
        "targets": encode_tensor(torch.zeros(2, 8, dtype=torch.long), "raw"),
        "grad_outputs": encode_tensor(x, "fp16"),
        "seed": 1,
    }
    counted = tensor_bytes(msg)
    n = x.numel()
    assert counted["fp16"] == 2 * n and counted["raw"] == 8 * 16
    assert n < counted["int8"] < n + n // 8  # one byte per value plus one fp32 scale per block
    assert tensor_bytes({"inputs": {"codec": "zip", "data": b"abc"}, "outputs": "not a tensor"}) == {"other": 3}
