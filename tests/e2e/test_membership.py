"""Membership as the coordinator sees it: real processes on loopback, leases, drain, auto stage, status, mDNS."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from shared.codec import decode_tensor, encode_tensor, pack_message, unpack_message
from shared.http import MSGPACK
from shared.processes import wait_healthy
from tests.e2e.conftest import SWARM, get_json, processes_of_run, wait_until

pytestmark = pytest.mark.e2e

START_S = 60  # a child imports torch (2-5 s each, more with several starting at once on 2 cores)
FAST = {"SWARM_WIRE_CODEC": "fp32"}  # skips the seconds of bitsandbytes warm-up an int8 server does at start


def replicas(coordinator: str) -> dict[str, int]:
    """URL -> stage of every replica the coordinator lists as live."""
    view = get_json(coordinator + "/swarm")
    return {r["url"]: s["stage"] for s in view["stages"] for r in s["replicas"]}


def wait_registered(coordinator: str, servers: list[tuple[subprocess.Popen, str]], timeout_s: float = START_S) -> None:
    """Wait until every server is listed by the coordinator and answers /health."""

    def all_listed():
        for proc, url in servers:
            assert proc.poll() is None, f"{url} exited with status {proc.returncode}"
        return all(url in replicas(coordinator) for _, url in servers)

    wait_until(all_listed, timeout_s, f"{[u for _, u in servers]} to register")
    for proc, url in servers:  # registration may precede the listener by a moment
        wait_healthy(url, proc, timeout_s)


def forward_body(run_id: str, stage: int, microbatch_id: str) -> bytes:
    inputs = encode_tensor(torch.randn(1, 8, 128), "fp32")
    return pack_message(
        {"run_id": run_id, "stage": stage, "microbatch_id": microbatch_id, "seed": 0, "codec": "fp32", "inputs": inputs}
    )


def post_forward(url: str, body: bytes, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """(status, body) of POST /forward; connection errors raise URLError."""
    req = urllib.request.Request(url + "/forward", data=body, headers={"Content-Type": MSGPACK}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def queue_depth(url: str) -> int:
    try:
        return get_json(url + "/health")["queue_depth"]
    except (urllib.error.URLError, OSError):
        return 0


def test_sigkill_drops_a_replica_within_three_heartbeats(processes):
    heartbeat_s = 0.5
    _, coord = processes.coordinator(heartbeat_s=heartbeat_s)
    proc, url = processes.server(0, coordinator=coord, heartbeat_s=heartbeat_s, extra=FAST)
    wait_registered(coord, [(proc, url)])

    proc.kill()  # SIGKILL: no deregistration, only the lease can remove it
    killed = time.monotonic()
    wait_until(lambda: url not in replicas(coord), 10, f"{url} to leave /swarm", poll_s=0.02)
    elapsed = time.monotonic() - killed
    assert proc.wait(timeout=5) == -signal.SIGKILL

    # The lease ends 3 heartbeats after the last heartbeat, which came at most one period
    # before the kill, so the replica is gone <= 1.5 s after it. Slack 0.6 s: the server's
    # period is heartbeat_s plus the heartbeat's own round trip (it sleeps after each), the
    # 20 ms polling plus each GET's latency, and scheduling on 2 busy cores.
    assert elapsed <= 3 * heartbeat_s + 0.6, f"the killed replica stayed listed {elapsed:.2f} s"


def test_sigterm_deregisters_at_once_and_finishes_accepted_work(processes):
    _, coord = processes.coordinator(heartbeat_s=1.0)  # lease 3 s
    drain_timeout_s = 10.0
    extra = {**FAST, "SWARM_INJECT_DELAY_S": "2", "SWARM_DRAIN_TIMEOUT_S": str(drain_timeout_s)}
    proc, url = processes.server(1, coordinator=coord, heartbeat_s=1.0, extra=extra)
    wait_registered(coord, [(proc, url)])

    thread, result = in_background(post_forward, url, forward_body(processes.run_id, 1, "mb-accepted"))
    wait_until(lambda: queue_depth(url) >= 1, 10, "the forward to be accepted (queue_depth >= 1)")

    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_until(lambda: url not in replicas(coord), 5, f"{url} to leave /swarm", poll_s=0.02)
    gone_after = time.monotonic() - signalled
    assert gone_after < 1.0, f"deregistration took {gone_after:.2f} s (the lease alone would take 3 s)"
    assert thread.is_alive(), "the accepted forward finished before the check: raise SWARM_INJECT_DELAY_S"

    # New work after SIGTERM is refused: aiohttp closes the listener before the drain
    # (which deregisters), so by now a new connection is refused; a 503 would do too.
    try:
        status, body = post_forward(url, forward_body(processes.run_id, 1, "mb-late"), timeout_s=10)
    except urllib.error.URLError as err:
        assert isinstance(err.reason, ConnectionRefusedError), err
    else:
        assert status == 503 and json.loads(body)["error"]["code"] == "draining", (status, body[:200])

    thread.join(timeout=drain_timeout_s)
    assert not thread.is_alive(), "the accepted forward did not complete within the drain timeout"
    assert "error" not in result, result.get("error")
    status, body = result["value"]
    assert status == 200, body[:300]
    reply = unpack_message(body)
    assert reply["microbatch_id"] == "mb-accepted" and reply["stage"] == 1
    assert list(decode_tensor(reply["outputs"]).shape) == [1, 8, 128]
    assert proc.wait(timeout=drain_timeout_s) == 0


def test_a_draining_server_stays_out_of_the_swarm(processes):
    heartbeat_s = 0.5
    _, coord = processes.coordinator(heartbeat_s=heartbeat_s)
    extra = {**FAST, "SWARM_INJECT_DELAY_S": "3"}  # the drain lasts ~3 s: 6 heartbeat periods
    proc, url = processes.server(1, coordinator=coord, heartbeat_s=heartbeat_s, extra=extra)
    wait_registered(coord, [(proc, url)])
    thread, result = in_background(post_forward, url, forward_body(processes.run_id, 1, "mb-draining"))
    wait_until(lambda: queue_depth(url) >= 1, 10, "the forward to be accepted (queue_depth >= 1)")

    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: url not in replicas(coord), 5, f"{url} to leave /swarm", poll_s=0.02)
    seen_again = []

    def drained():
        if url in replicas(coord):
            seen_again.append(time.monotonic())
        return not thread.is_alive()

    wait_until(drained, 15, "the accepted forward to complete", poll_s=0.05)
    assert result.get("value", (None,))[0] == 200, result
    assert proc.wait(timeout=15) == 0
    assert not seen_again, f"the draining server was listed again on {len(seen_again)} polls of /swarm"


def test_stage_auto_joins_the_stage_with_least_capacity(processes):
    _, coord = processes.coordinator(heartbeat_s=1.0, num_stages=4)
    fixed = [processes.server(stage, coordinator=coord, extra=FAST) for stage in (0, 1, 2)]
    wait_registered(coord, fixed)

    auto, auto_url = processes.server("auto", coordinator=coord, extra=FAST)
    wait_registered(coord, [(auto, auto_url)])
    assert replicas(coord)[auto_url] == 3
    assert get_json(auto_url + "/info")["stage"] == 3


def test_swarm_status_prints_the_live_swarm(processes):
    _, coord = processes.coordinator(heartbeat_s=1.0)
    servers = [processes.server(stage, coordinator=coord, extra=FAST) for stage in (0, 1)]
    wait_registered(coord, servers)

    table = subprocess.run(
        [*SWARM, "status", "--coordinator", coord], capture_output=True, text=True, timeout=60, check=False
    )
    assert table.returncode == 0, table.stderr[-2000:]
    out = table.stdout
    for _, url in servers:
        assert url in out, out
    for stage, count in ((0, 1), (1, 1), (2, 0), (3, 0)):  # stage rows: stage, replicas, capacity
        assert re.search(rf"^\s*{stage}\s+{count}\s+\d", out, re.MULTILINE), (stage, out)
    assert "lease age" in out and "weakest" in out, out

    raw = subprocess.run(
        [*SWARM, "status", "--coordinator", coord, "--json"], capture_output=True, text=True, timeout=60, check=False
    )
    assert raw.returncode == 0, raw.stderr[-2000:]
    view = json.loads(raw.stdout)
    listed = {r["url"]: s["stage"] for s in view["stages"] for r in s["replicas"]}
    assert listed == {servers[0][1]: 0, servers[1][1]: 1}

    nobody = subprocess.run(
        [*SWARM, "status", "--coordinator", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert nobody.returncode == 2, (nobody.stdout, nobody.stderr)
    assert "cannot read http://127.0.0.1:9/swarm" in nobody.stderr, nobody.stderr


def test_a_server_or_coordinator_whose_port_is_taken_exits_2_and_says_so(processes):
    """Before a server builds and joins its stage (minutes for a large one), not after: a
    clear line naming SWARM_PORT, exit status 2, no traceback, never registered."""
    _, coord = processes.coordinator(heartbeat_s=1.0)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        for module, env in (
            ("services.stage_server", {"SWARM_STAGE": "1", "SWARM_COORDINATOR": coord}),
            ("services.coordinator", {"SWARM_STATE_DB": str(processes.log_dir / "second.sqlite")}),
        ):
            run = subprocess.run(
                [sys.executable, "-m", module],
                env={**os.environ, **FAST, "SWARM_MDNS": "false", "SWARM_PORT": str(port), **env},
                capture_output=True,
                text=True,
                timeout=START_S,
                check=False,
            )
            assert run.returncode == 2, (module, run.returncode, run.stderr[-2000:])
            assert f"cannot listen on 127.0.0.1:{port}" in run.stderr and "SWARM_PORT" in run.stderr, run.stderr
            assert "Traceback" not in run.stderr, run.stderr
    assert replicas(coord) == {}
    assert not (processes.log_dir / "second.sqlite").exists()


def test_mdns_server_and_trainer_find_the_coordinator(processes, tmp_path):
    # A short run id: with the fixture's (~52 characters) the coordinator cannot announce
    # itself at all, see test_mdns_discovery_works_with_a_long_valid_run_id below.
    run_id = processes.run_id = f"mdns-{os.getpid()}"
    try:
        _, coord = processes.coordinator(heartbeat_s=1.0, mdns=True, num_stages=2)
        discover = {
            "SWARM_COORDINATOR": "",
            "SWARM_MDNS": "true",
            "SWARM_MDNS_INTERFACES": "127.0.0.1",
            "SWARM_NUM_STAGES": "2",
            **FAST,
        }
        servers = [processes.server(stage, extra={**discover, "SWARM_GLOBAL_BATCH": "8"}) for stage in (0, 1)]
        summary_file = tmp_path / "summary.json"
        trainer = processes.start(
            "trainer",
            "services.trainer",
            {
                **discover,
                "SWARM_STEPS": "5",
                "SWARM_MICROBATCH_SIZE": "4",
                "SWARM_SEQ_LEN": "32",
                "SWARM_HEARTBEAT_S": "1.0",
                "SWARM_SUMMARY_FILE": str(summary_file),
            },
        )
        assert trainer.wait(timeout=180) == 0, (tmp_path / "trainer.log").read_text()[-3000:]

        summary = json.loads(summary_file.read_text())
        assert summary["steps"] == 5
        assert (
            summary["microbatches_failed"] == 0
            and summary["microbatches_completed"] == summary["microbatches_scheduled"] > 0
        )
        assert replicas(coord) == {servers[0][1]: 0, servers[1][1]: 1}  # they registered where mDNS led them
        for _, url in servers:
            port = url.rsplit(":", 1)[1]
            log = next(tmp_path.glob(f"server-*-{port}.log")).read_text()
            assert "coordinator.discovered" in log and coord in log, log[-2000:]
        trainer_log = (tmp_path / "trainer.log").read_text()
        assert "coordinator.using" in trainer_log and coord in trainer_log, trainer_log[-2000:]
    finally:
        processes.stop_all()  # the fixture checks for leftovers of its own run id, not of this one
    assert processes_of_run(run_id) == [], "a process of this test outlived it"


def test_mdns_discovery_works_with_a_long_valid_run_id(processes):
    assert 45 < len(processes.run_id) <= 64, (
        processes.run_id
    )  # valid (the fixture's, ~50 characters), too long for the names
    _, coord = processes.coordinator(heartbeat_s=1.0, mdns=True, num_stages=1)
    discover = {
        "SWARM_COORDINATOR": "",
        "SWARM_MDNS": "true",
        "SWARM_MDNS_INTERFACES": "127.0.0.1",
        "SWARM_NUM_STAGES": "1",
        **FAST,
    }
    proc, url = processes.server(0, extra=discover)
    wait_registered(coord, [(proc, url)])
