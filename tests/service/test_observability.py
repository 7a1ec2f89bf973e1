"""Metrics, request logs and the dashboard's data, through the real apps on loopback.

Stage servers and a coordinator run in this process (``aiohttp`` test servers); a
trainer's :class:`PipelineClient` drives microbatches through them with its telemetry on.
Every ``/metrics`` answer is parsed with Prometheus' own parser.
"""

from __future__ import annotations

import logging
import urllib.parse

import aiohttp
import pytest
import structlog
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from services.coordinator.app import create_app as create_coordinator
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import HopTimeouts, PipelineClient
from services.trainer.telemetry import TrainerTelemetry
from services.trainer.trainer import Trainer
from shared.http import MICROBATCH_HEADER
from shared.log import get_logger
from shared.processes import free_port
from shared.retry import RetryPolicy
from tests.conftest import balancer_for, coordinator_settings, stage_settings

RUN_ID = "test"


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    """GET url/metrics -> {(sample name, sorted labels): value}; checks the content type."""
    async with session.get(url.rstrip("/") + "/metrics") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    """The sample ``name`` with exactly ``labels`` (0.0 if absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels) -> float:
    """Sum of the samples ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def client_for(session, urls, telemetry=None, log=None) -> PipelineClient:
    return PipelineClient(
        session,
        balancer_for(urls),
        run_id=RUN_ID,
        codec="fp16",
        timeouts=HopTimeouts(10, 10),
        retry=RetryPolicy(max_retries=2, base_delay_s=0.01),
        log=log,
        telemetry=telemetry,
        client_id="t1",
    )


@pytest.fixture
async def coordinator():
    server = TestServer(create_coordinator(coordinator_settings(run_id=RUN_ID, num_stages=2)), host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


# --------------------------------------------------------------------------- stage servers and trainer


async def test_metrics_of_stage_servers_and_trainer_move_with_training(start_stages, http_session):
    _, urls = await start_stages([[stage_settings(s, num_stages=2, global_batch=4)] for s in range(2)])
    telemetry = TrainerTelemetry(run_id=RUN_ID, trainer_id="t1")
    client = client_for(http_session, urls, telemetry)
    batcher = ByteBatcher(load_corpus(), 16, 2)
    for i in range(4):
        await client.train(batcher.microbatch(i), seed=i)
    first, last = await scrape(http_session, urls[0][0]), await scrape(http_session, urls[1][0])

    for samples in (first, last):
        assert value(samples, "swarm_http_requests_total", endpoint="/backward", method="POST", status="200") == 4
        assert value(samples, "swarm_http_request_duration_seconds_count", endpoint="/backward", method="POST") == 4
        assert value(samples, "swarm_stage_backwards_total") == 4 and value(samples, "swarm_stage_samples_total") == 8
        assert value(samples, "swarm_stage_optimizer_steps_total") == 2  # 8 samples, 4 per step
        assert (
            value(samples, "swarm_stage_queue_depth") == 0
            and value(samples, "swarm_stage_throughput_samples_per_second") > 0
        )
        assert value(samples, "swarm_stage_averaging_rounds_total", outcome="completed") == 0
        assert value(samples, "swarm_http_request_bytes_total", endpoint="/backward") > 0
    assert value(first, "swarm_http_requests_total", endpoint="/forward", method="POST", status="200") == 4
    assert (
        value(first, "swarm_stage_tensor_bytes_total", direction="in", codec="raw") == 2 * 4 * 2 * 16 * 8
    )  # token ids, forward and backward
    assert (
        value(first, "swarm_stage_tensor_bytes_total", direction="out", codec="fp16") == 4 * 2 * 16 * 128 * 2
    )  # hidden states
    assert value(last, "swarm_stage_tensor_bytes_total", direction="in", codec="fp16") == 4 * 2 * 16 * 128 * 2
    assert (
        value(last, "swarm_stage_tensor_bytes_total", direction="out", codec="fp16") == 4 * 2 * 16 * 128 * 2
    )  # grad_inputs

    trainer = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(telemetry.metrics.render().decode())
        for s in f.samples
    }
    assert value(trainer, "swarm_trainer_hops_total", stage="0", kind="forward", outcome="ok") == 4
    assert value(trainer, "swarm_trainer_hops_total", stage="1", kind="backward", outcome="ok") == 4
    assert value(trainer, "swarm_trainer_hop_duration_seconds_count", stage="0", kind="backward") == 4
    assert value(trainer, "swarm_trainer_microbatches_total", outcome="completed") == 4
    assert value(trainer, "swarm_trainer_microbatches_total", outcome="failed") == 0
    assert value(trainer, "swarm_trainer_tokens_total") == 4 * 2 * 16
    assert (
        value(trainer, "swarm_trainer_tensor_bytes_total", direction="received", codec="fp16")
        == 2 * 4 * 2 * 16 * 128 * 2
    )


async def test_refused_and_unknown_requests_are_counted_by_status(start_stages, http_session):
    _, urls = await start_stages([[stage_settings(0, num_stages=2)]])
    url = urls[0][0]
    async with http_session.post(url + "/forward", data=b"{}", headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 415
    for path in ("/no/such/path", "/another/unknown"):
        async with http_session.get(url + path) as resp:
            assert resp.status == 404
    samples = await scrape(http_session, url)
    assert value(samples, "swarm_http_requests_total", endpoint="/forward", method="POST", status="415") == 1
    assert (
        value(samples, "swarm_http_requests_total", endpoint="unmatched", method="GET", status="404") == 2
    )  # raw paths never become labels
    assert total(samples, "swarm_build_info", service="stage_server", run_id=RUN_ID, stage="0") == 1


async def test_a_microbatch_is_followed_from_the_trainer_through_every_stage(start_stages, http_session):
    """With debug logs, the trainer's ``hop.done`` and each server's ``request.done`` carry
    the same microbatch id (the trainer sends it in ``X-Swarm-Microbatch``)."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        _, urls = await start_stages([[stage_settings(s, num_stages=2)] for s in range(2)])
        client = client_for(http_session, urls, log=get_logger(service="trainer", run=RUN_ID))
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            await client.train(ByteBatcher(load_corpus(), 16, 2).microbatch(7), seed=0)
            async with http_session.post(
                urls[1][0] + "/forward",
                data=b"\x80",
                headers={"Content-Type": "application/msgpack", MICROBATCH_HEADER: "test:t1:99"},
            ) as resp:
                assert resp.status == 400
    finally:
        structlog.configure(**saved)
    hops = [
        (e["stage"], e["path"], e["replica"])
        for e in logs
        if e["event"] == "hop.done" and e["microbatch"] == "test:t1:7"
    ]
    served = [
        (e["stage"], e["path"], e["replica"])
        for e in logs
        if e["event"] == "request.done" and e.get("microbatch") == "test:t1:7" and e["status"] == 200
    ]
    assert hops == [(0, "/forward", urls[0][0]), (1, "/backward", urls[1][0]), (0, "/backward", urls[0][0])]
    assert sorted(p for _, p, _ in served) == ["/backward", "/backward", "/forward"] and {s for s, _, _ in served} == {
        0,
        1,
    }
    refused = [e for e in logs if e["event"] == "request.refused"]
    assert [(e["microbatch"], e["status"]) for e in refused] == [("test:t1:99", 400)]


# --------------------------------------------------------------------------- coordinator


def server(n: int, stage: int, throughput: float) -> dict:
    return {
        "run_id": RUN_ID,
        "server_id": f"s{n}",
        "stage": stage,
        "url": f"http://127.0.0.{n + 10}:8100",
        "version": "0.1.0",
        "throughput": throughput,
        "queue_length": n,
    }


async def post(session, url, body, status=200, content_type=None):
    kwargs = {"data": body, "headers": {"Content-Type": content_type}} if content_type else {"json": body}
    async with session.post(url, **kwargs) as resp:
        assert resp.status == status, await resp.text()
        return await resp.json()


async def test_coordinator_metrics_show_replicas_capacity_and_the_weakest_stage(coordinator, http_session):
    for n, stage, throughput in [(1, 0, 4.0), (2, 0, 3.0), (3, 1, 5.0)]:
        await post(http_session, coordinator + "/register", server(n, stage, throughput))
    await post(http_session, coordinator + "/deregister", {"server_id": "s9"})
    samples = await scrape(http_session, coordinator)
    assert (
        value(samples, "swarm_coordinator_replicas", stage="0") == 2
        and value(samples, "swarm_coordinator_replicas", stage="1") == 1
    )
    assert value(samples, "swarm_coordinator_stage_capacity_samples_per_second", stage="0") == 7.0
    assert value(samples, "swarm_coordinator_weakest_stage") == 1
    assert value(samples, "swarm_coordinator_weakest_stage_capacity_samples_per_second") == 5.0
    assert value(samples, "swarm_coordinator_stage_queue_length", stage="0") == 3
    assert value(samples, "swarm_coordinator_live_servers") == 3
    assert value(samples, "swarm_coordinator_events_total", event="registry.registered") == 3
    assert value(samples, "swarm_coordinator_events_total", event="registry.deregistered") == 1
    assert value(samples, "swarm_http_requests_total", endpoint="/register", method="POST", status="200") == 3


async def test_progress_reports_feed_the_dashboard(coordinator, http_session):
    await post(http_session, coordinator + "/register", server(1, 0, 2.0))
    await post(http_session, coordinator + "/register", server(2, 1, 1.0))
    records = [
        {"step": step, "loss": loss, "tokens_per_s": 100.0 * step, "elapsed_s": step}
        for step, loss in [(1, 5.5), (2, 5.25)]
    ]
    assert await post(
        http_session, coordinator + "/progress", {"run_id": RUN_ID, "trainer_id": "t1", "records": records}
    ) == {"recorded": 2, "trainers": 1}
    assert await post(
        http_session, coordinator + "/progress", {"run_id": RUN_ID, "trainer_id": "t1", "records": records[1:]}
    ) == {"recorded": 0, "trainers": 1}
    async with http_session.get(coordinator + "/dashboard.json") as resp:
        assert resp.status == 200
        view = await resp.json()
    assert view["run_id"] == RUN_ID and view["num_stages"] == 2 and view["weakest_stage"] == 1
    assert [[r["url"] for r in s["replicas"]] for s in view["stages"]] == [
        ["http://127.0.0.11:8100"],
        ["http://127.0.0.12:8100"],
    ]
    assert all(r["health"] == "ok" for s in view["stages"] for r in s["replicas"])
    assert [(p["step"], p["loss"], p["tokens_per_s"]) for p in view["trainers"]["t1"]] == [
        (1, 5.5, 100.0),
        (2, 5.25, 200.0),
    ]
    assert [e["event"] for e in view["events"]] == [
        "trainer.joined",
        "registry.registered",
        "registry.registered",
    ]  # newest first
    assert value(await scrape(http_session, coordinator), "swarm_coordinator_trainers_reporting") == 1


@pytest.mark.parametrize(
    "body, content_type, status, code",
    [
        (
            {"run_id": RUN_ID, "trainer_id": "t1", "records": [{"step": "1", "loss": 1.0, "tokens_per_s": 1.0}]},
            None,
            400,
            "bad_payload",
        ),
        (
            {"run_id": RUN_ID, "trainer_id": "t1", "records": [{"step": 1, "loss": 1.0, "tokens_per_s": -1.0}]},
            None,
            400,
            "bad_payload",
        ),
        ({"run_id": RUN_ID, "trainer_id": "t1", "step": 1, "loss": 1.0, "tokens_per_s": 1.0}, None, 400, "bad_payload"),
        (
            {"run_id": "other", "trainer_id": "t1", "records": [{"step": 1, "loss": 1.0, "tokens_per_s": 1.0}]},
            None,
            409,
            "wrong_run",
        ),
        (b"[1, 2]", "application/json", 400, "bad_payload"),
        (b"step=1", "text/plain", 415, "unsupported_media_type"),
        (b"{" + b" " * 70_000 + b"}", "application/json", 413, "payload_too_large"),
    ],
)
async def test_bad_progress_reports_are_refused(coordinator, http_session, body, content_type, status, code):
    assert (await post(http_session, coordinator + "/progress", body, status, content_type))["error"]["code"] == code
    async with http_session.get(coordinator + "/dashboard.json") as resp:
        assert (await resp.json())["trainers"] == {}


async def test_dashboard_page_is_self_contained(coordinator, http_session):
    async with http_session.get(coordinator + "/") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        page = await resp.text()
    assert "dashboard.json" in page and "<canvas" in page
    assert (
        "http://" not in page and "https://" not in page and "<script src" not in page and "<link" not in page
    )  # nothing from elsewhere


async def test_trainer_serves_metrics_and_reports_progress_while_it_trains(start_stages, coordinator, http_session):
    # servers that step on every microbatch (the trainer's global batch), whatever its age: the hops are counted exactly
    _, urls = await start_stages(
        [[stage_settings(s, num_stages=2, global_batch=2, max_staleness=1000)] for s in range(2)]
    )
    telemetry = TrainerTelemetry(run_id=RUN_ID, trainer_id="t1")
    trainer = Trainer(
        client_for(http_session, urls, telemetry),
        ByteBatcher(load_corpus(), 16, 2),
        steps=3,
        global_batch=2,
        in_flight=2,
        eval_microbatches=1,
        on_step=telemetry.step_done,
    )
    port = free_port()
    await telemetry.start(http_session, coordinator=coordinator, host="127.0.0.1", port=port)
    try:
        await trainer.run()
        samples = await scrape(http_session, f"http://127.0.0.1:{port}")
    finally:
        await telemetry.stop()  # sends the last report
    assert value(samples, "swarm_trainer_step") == 3 and value(samples, "swarm_trainer_loss") > 0
    assert value(samples, "swarm_trainer_tokens_per_second") > 0
    assert value(samples, "swarm_trainer_microbatches_total", outcome="completed") == 3
    assert (
        total(samples, "swarm_trainer_hops_total", outcome="ok") == 3 * 3 + 2 * 2
    )  # 3 hops per microbatch; evaluations before and after: a forward per stage
    async with http_session.get(coordinator + "/dashboard.json") as resp:
        assert [p["step"] for p in (await resp.json())["trainers"]["t1"]] == [
            1,
            2,
            3,
        ]  # every step, also those of the last report
    with pytest.raises(aiohttp.ClientConnectionError):  # the endpoint closed with the run
        async with http_session.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=5)):
            pass
    assert urllib.parse.urlsplit(coordinator).hostname == "127.0.0.1"
