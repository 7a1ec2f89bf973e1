"""Membership: a stage server's lease at the coordinator.

Registers once the server listens, heartbeats every ``heartbeat_s`` with its measured
throughput and queue length (re-registering if the coordinator forgot it, e.g. after a
restart), and deregisters first thing on shutdown so trainers stop sending to it. While
the coordinator is unreachable it keeps trying with the shared backoff policy; the
server keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Callable

import aiohttp

from shared.errors import RemoteError
from shared.http import post_json
from shared.retry import RetryPolicy

CONTROL_TIMEOUT_S = 5.0
STANDBY_WAIT_S = 20.0  # a standby's /assign is held open this long when no stage needs it
# asking /assign again while the coordinator cannot answer
# (--stage auto: up to SWARM_JOIN_TIMEOUT_S; a standby: while it waits)
ASSIGN_RETRY = RetryPolicy(max_retries=1_000_000, base_delay_s=0.2, max_delay_s=2.0)


async def assign_stage(
    session: aiohttp.ClientSession,
    coordinator: str,
    run_id: str,
    *,
    region: str = "",
    rtt_ms: dict[str, float] | None = None,
    speed_flops: float = 0.0,
    link_mbit: float = 0.0,
    timeout_s: float = 60.0,
    log=None,
) -> int:
    """Ask the coordinator which stage a server started with ``--stage auto`` should serve,
    telling it where the server is (``region``), its round-trip times to the swarm's
    servers (``rtt_ms``, peer URL -> ms), so that it can place the server by the network,
    its compute speed (``speed_flops``, 0: none declared) and its link rate (``link_mbit``,
    Mbit/s; 0: none declared).

    A coordinator not reachable yet (started after the servers, restarting, overloaded) is
    asked again with backoff for up to ``timeout_s``; then, or at once for an answer that
    retrying cannot change (a wrong run id, a bad request), :class:`RemoteError`."""
    body: dict = {"run_id": run_id}
    if region:
        body["region"] = region
    if rtt_ms:
        body["rtt_ms"] = rtt_ms
    if speed_flops > 0:
        body["speed_flops"] = speed_flops
    if link_mbit > 0:
        body["link_mbit"] = link_mbit
    deadline = asyncio.get_running_loop().time() + timeout_s
    failures = 0
    while True:
        try:
            reply = await post_json(session, coordinator + "/assign", body, timeout_s=CONTROL_TIMEOUT_S)
            return int(reply["stage"])
        except RemoteError as err:
            failures += 1
            wait_s = ASSIGN_RETRY.delay_s(failures)
            transient = err.status is None or err.status >= 500  # unreachable, or not able to answer yet
            if not transient or asyncio.get_running_loop().time() + wait_s > deadline:
                raise
            if log is not None:
                log.warning("assign.retry", error=str(err), failures=failures)
            await asyncio.sleep(wait_s)


async def wait_for_stage(
    session: aiohttp.ClientSession,
    coordinator: str,
    run_id: str,
    *,
    region: str = "",
    log=None,
) -> int:
    """A standby server (``--stage standby``): ask the coordinator for a stage until one
    needs this server (each ask is held open up to ``STANDBY_WAIT_S``); returns the stage."""
    body: dict = {"run_id": run_id, "standby": True, "server_id": f"standby-{uuid.uuid4().hex[:12]}"}
    if region:
        body["region"] = region
    body["wait_s"] = STANDBY_WAIT_S
    failures = 0
    while True:
        try:
            reply = await post_json(
                session, coordinator + "/assign", body, timeout_s=STANDBY_WAIT_S + CONTROL_TIMEOUT_S
            )
        except RemoteError as err:
            if not err.retryable:
                raise
            failures += 1
            if log is not None:
                log.warning("standby.ask_failed", error=str(err), failures=failures)
            await asyncio.sleep(ASSIGN_RETRY.delay_s(failures))
            continue
        failures = 0
        if type(reply.get("stage")) is int:
            if log is not None:
                log.info("standby.assigned", stage=reply["stage"], reason=reply.get("reason"))
            return reply["stage"]


class Membership:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        coordinator: str,
        *,
        run_id: str,
        stage: int,
        url: str,
        version: str,
        heartbeat_s: float,
        load: Callable[[], tuple[float, int]],
        log,
        probe=None,
        report: Callable[[], dict] | None = None,
    ):
        self.session, self.coordinator, self.run_id, self.stage = session, coordinator, run_id, stage
        self.probe = probe  # a LatencyProbe: round-trip times to peers, reported in heartbeats
        self.report = (
            report or dict
        )  # {region?, workload}: what placement needs, sent with every registration and heartbeat
        self.url, self.version, self.heartbeat_s, self.load, self.log = url, version, heartbeat_s, load, log
        self.server_id = f"s{stage}-{uuid.uuid4().hex[:12]}"
        self.registered = asyncio.Event()
        self.leaving = False  # set by deregister(): never register again
        self._retry = RetryPolicy(max_retries=1_000_000, base_delay_s=0.2, max_delay_s=max(heartbeat_s, 0.2))

    async def run(self) -> None:
        """Register, then heartbeat until deregistered or cancelled."""
        failures = 0
        while not self.leaving:
            try:
                if not self.registered.is_set():
                    await self._register()
                else:
                    await self._heartbeat()
                failures = 0
                await asyncio.sleep(self.heartbeat_s)
            except RemoteError as err:
                failures += 1
                if err.status == 404:  # the coordinator forgot us (restart, expired lease)
                    self.registered.clear()
                self.log.warning("membership.failed", error=str(err), failures=failures)
                await asyncio.sleep(self._retry.delay_s(failures))

    async def deregister(self) -> None:
        """Leave the registry for good (a draining server must not come back)."""
        self.leaving = True
        if not self.registered.is_set():
            return
        try:
            await post_json(
                self.session,
                self.coordinator + "/deregister",
                {"server_id": self.server_id},
                timeout_s=CONTROL_TIMEOUT_S,
            )
            self.registered.clear()
            self.log.info("membership.deregistered", server_id=self.server_id)
        except RemoteError as err:
            self.log.warning("membership.deregister_failed", error=str(err))

    async def _register(self) -> None:
        if self.leaving:
            return
        throughput, queue_length = self.load()
        body = {
            **self.report(),
            "run_id": self.run_id,
            "server_id": self.server_id,
            "stage": self.stage,
            "url": self.url,
            "version": self.version,
            "throughput": throughput,
            "queue_length": queue_length,
        }
        await post_json(self.session, self.coordinator + "/register", body, timeout_s=CONTROL_TIMEOUT_S)
        self.registered.set()
        if self.leaving:  # deregister() ran while this registration was on its way
            await self.deregister()
            return
        self.log.info("membership.registered", server_id=self.server_id, coordinator=self.coordinator, url=self.url)

    async def _heartbeat(self) -> None:
        throughput, queue_length = self.load()
        body = {**self.report(), "server_id": self.server_id, "throughput": throughput, "queue_length": queue_length}
        if self.probe is not None:
            body["rtt_ms"] = await self.probe.maybe_probe()
        await post_json(self.session, self.coordinator + "/heartbeat", body, timeout_s=CONTROL_TIMEOUT_S)
