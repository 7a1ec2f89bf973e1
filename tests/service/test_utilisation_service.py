"""MFU through the real apps: a stage server counts the model FLOPs of what it trains and
evaluates and shows MFU on ``/metrics`` and ``/health``; the coordinator takes a server's
report from its heartbeat into ``/swarm``, and ``swarm status`` prints it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp.test_utils import TestServer

from services import status
from services.coordinator.app import create_app as create_coordinator
from services.stage_server.app import create_app
from services.stage_server.metrics import STAGE_METRICS
from services.stage_server.routes import RUNTIME
from services.stage_server.runtime import StageStats
from services.stage_server.utilisation import StageUtilisation
from shared.codec import encode_tensor, pack_message
from shared.flops import stage_flops
from shared.model import PRESETS, partition
from shared.peak_flops import Peak
from tests.conftest import VirtualClock, coordinator_settings, stage_settings
from tests.service.test_observability import scrape, value

MSGPACK = {"Content-Type": "application/msgpack"}
CFG = PRESETS["tiny"]  # d_model 128, 4 heads, 4 layers: stage 1 of 4 holds one block
B, T = 4, 16
# one tiny block, by hand: 12 x 128^2 = 196608 matmul weights (2 FLOPs a token each), attention width
# 4 heads x 32 = 128 (4 FLOPs a (query, key) pair each, q k^T and p v): a forward of B sequences of T tokens
FORWARD = 2 * 196608 * B * T + 4 * 128 * B * T * T  # 25165824 + 524288 = 25690112


async def start(app) -> tuple[TestServer, str]:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def post(session, url: str, path: str, msg: dict) -> None:
    async with session.post(url + path, data=pack_message(msg), headers=MSGPACK) as resp:
        assert resp.status == 200, await resp.text()


async def test_a_stage_server_shows_its_model_flops_and_mfu(http_session):
    assert stage_flops(CFG, partition(CFG, 4)[1]).forward(B * T, B * T * T) == FORWARD
    app = create_app(stage_settings(1))
    server, url = await start(app)
    try:
        gen = torch.Generator().manual_seed(0)
        x, g = (encode_tensor(torch.randn(B, T, CFG.d_model, generator=gen), "fp32") for _ in range(2))
        msg = {"run_id": "test", "stage": 1, "microbatch_id": "mb-1", "seed": 1, "inputs": x}
        await post(http_session, url, "/forward", msg)
        await post(http_session, url, "/backward", {**msg, "grad_outputs": g, "forward_step": 0})
        await post(http_session, url, "/backward", {**msg, "grad_outputs": g, "forward_step": 0})  # a duplicate
        await post(http_session, url, "/forward", {**msg, "microbatch_id": "eval-1", "eval": True})
        async with http_session.get(url + "/health") as resp:
            u = (await resp.json())["utilisation"]
        # one microbatch trained (3 forwards' worth: forward + backward), one evaluated (1); the duplicate: nothing
        assert (u["tokens_trained"], u["tokens_evaluated"], u["model_flops"]) == (B * T, B * T, 4 * FORWARD)
        assert u["peak_source"] == "probe" and u["peak_flops"] > 0  # a CPU: measured (or read from the cache)
        assert u["mfu_busy"] == pytest.approx(u["model_flops"] / u["compute_s"] / u["peak_flops"])
        samples = await scrape(http_session, url)
        assert value(samples, "swarm_stage_model_flops_total") == 4 * FORWARD
        assert value(samples, "swarm_stage_tokens_total", kind="trained") == B * T
        assert value(samples, "swarm_stage_peak_flops", source="probe", device=u["peak_device"]) == u["peak_flops"]

        # known tokens, compute seconds, wall time and peak: the value is exact
        clock = VirtualClock()
        stats = app[RUNTIME].stats
        app[STAGE_METRICS].utilisation = StageUtilisation(
            stage_flops(CFG, partition(CFG, 4)[1]), Peak(1e9, "setting", "test"), stats, clock=clock
        )
        stats.compute_s, clock.now = 0.25, 0.5  # 3 x 25690112 + 25690112 FLOPs in 0.25 s busy, 0.5 s wall
        samples = await scrape(http_session, url)
        assert value(samples, "swarm_stage_mfu", basis="busy") == pytest.approx(4 * FORWARD / 0.25 / 1e9)  # 0.411
        assert value(samples, "swarm_stage_mfu", basis="wall") == pytest.approx(0.0)  # nothing since the meter began
        assert value(samples, "swarm_stage_achieved_flops", basis="busy") == pytest.approx(4 * FORWARD / 0.25)
    finally:
        await server.close()


async def test_swarm_status_shows_the_mfu_a_server_reports(http_session, capsys):
    coordinator_server, coordinator = await start(create_coordinator(coordinator_settings(num_stages=2)))
    try:
        # a server of stage 0 (two blocks) that trained B sequences of T tokens in 0.25 s of compute, 1 s of wall
        clock = VirtualClock()
        stats = StageStats()
        meter = StageUtilisation(
            stage_flops(CFG, partition(CFG, 2)[0]), Peak(1e9, "setting", "test"), stats, clock=clock
        )
        stats.tokens_trained, stats.token_pairs_trained, stats.compute_s, clock.now = B * T, B * T * T, 0.25, 1.0
        report = meter.report()
        assert report["model_flops"] == 3 * 2 * FORWARD  # two blocks, forward and backward
        assert report["mfu_busy"] == pytest.approx(6 * FORWARD / 0.25 / 1e9)  # 0.617
        assert report["mfu_wall"] == pytest.approx(6 * FORWARD / 1.0 / 1e9)
        body = {
            "run_id": "test",
            "server_id": "s0",
            "stage": 0,
            "url": "http://127.0.0.1:9",
            "version": "t",
            "throughput": 1.0,
            "queue_length": 0,
        }
        async with http_session.post(coordinator + "/register", json=body) as resp:
            assert resp.status == 200
        async with http_session.post(
            coordinator + "/heartbeat", json={**body, "utilisation": {"model_flops": -1}}
        ) as r:
            assert r.status == 400  # a bad report is refused
        async with http_session.post(coordinator + "/heartbeat", json={**body, "utilisation": report}) as resp:
            assert resp.status == 200
        async with http_session.get(coordinator + "/swarm") as resp:
            stages = (await resp.json())["stages"]
        assert stages[0]["utilisation"]["mfu_busy"] == pytest.approx(report["mfu_busy"])
        assert stages[0]["replicas"][0]["utilisation"]["peak_source"] == "setting" and stages[1]["utilisation"] is None

        capsys.readouterr()
        assert await asyncio.to_thread(status.main, ["--coordinator", coordinator]) == 0
        out = capsys.readouterr().out.splitlines()
        row = out[next(i for i, line in enumerate(out) if "MFU busy" in line) + 1].split()
        assert row[:4] == ["0", "1", f"{100 * report['mfu_busy']:.3g}%", f"{100 * report['mfu_wall']:.3g}%"]
        assert row[-2:] == ["setting:", "test"]
    finally:
        await coordinator_server.close()
