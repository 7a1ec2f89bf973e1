"""RegistryMirror: the trainer's copy of the coordinator's registry, fed into the balancer.

Refreshed every ``refresh_s`` and at once when a stage has no usable replica. When the
coordinator cannot be reached the last view stays in use: training goes on with the
replicas already known, and failed ones are routed around by the balancer's bans. A stage
the coordinator lists without replicas also keeps the ones last known: a coordinator
restarted after more than a lease lists its servers only as they heartbeat again.
"""

from __future__ import annotations

import asyncio

import aiohttp

from shared.errors import RemoteError
from shared.http import get_json, post_json
from shared.wiring import ReplicaBalancer

REFRESH_TIMEOUT_S = 5.0


class RegistryMirror:
    def __init__(
        self, session: aiohttp.ClientSession, coordinator: str, balancer: ReplicaBalancer, *, refresh_s: float, log=None
    ):
        self.session, self.coordinator, self.balancer = session, coordinator, balancer
        self.refresh_s, self.log = refresh_s, log
        self.refreshes = 0
        self.failures = 0
        self._lock = asyncio.Lock()

    async def refresh(self) -> bool:
        """Fetch GET /swarm and hand every stage's replicas (and which are hot spares) to the
        balancer; False if unreachable."""
        async with self._lock:
            try:
                stages = (await get_json(self.session, self.coordinator + "/swarm", timeout_s=REFRESH_TIMEOUT_S))[
                    "stages"
                ]
            except (RemoteError, KeyError) as exc:
                self.failures += 1
                if self.log:
                    self.log.warning(
                        "registry.unreachable", coordinator=self.coordinator, error=repr(exc), keeping="last view"
                    )
                return False
            for entry in stages[: self.balancer.num_stages]:
                if urls := [r["url"] for r in entry["replicas"]]:  # listed empty: keep the last known
                    spares = [r["url"] for r in entry["replicas"] if r.get("spare") is True]
                    self.balancer.set_replicas(int(entry["stage"]), urls, spares)
            self.refreshes += 1
            return True

    async def average(self, timeout_s: float) -> list[dict] | None:
        """Ask the coordinator for an averaging pass of every stage (``POST /average``) and
        wait for it; the rounds it ran, or None (logged) if it failed or timed out."""
        try:
            rounds = (await post_json(self.session, self.coordinator + "/average", {}, timeout_s=timeout_s))["rounds"]
        except (RemoteError, KeyError) as exc:
            if self.log:
                self.log.warning("averaging.final.failed", coordinator=self.coordinator, error=repr(exc))
            return None
        if self.log:
            self.log.info(
                "averaging.final", stages=[r.get("stage") for r in rounds], ended=[r.get("ended") for r in rounds]
            )
        return rounds

    def replicas(self) -> list[list[str]]:
        return [list(self.balancer.estimates(s)) for s in range(self.balancer.num_stages)]

    async def stage_empty(self, stage: int) -> None:
        """Called by the pipeline when ``stage`` has no usable replica: refresh now."""
        await self.refresh()

    async def wait_complete(self, timeout_s: float) -> bool:
        """Refresh until every stage has at least one replica, or ``timeout_s`` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if await self.refresh() and all(self.replicas()):
                return True
            await asyncio.sleep(min(self.refresh_s, 0.5))
        return False

    async def run(self) -> None:
        """Refresh every ``refresh_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
