"""Round-trip times from this stage server to the peers it works with.

Every ``every`` heartbeats the server reads the registry (``GET /swarm``) and times a
``GET /health`` to each replica of its own stage (averaging partners) and of the stages
next to it (its pipeline neighbours), at most ``MAX_PEERS`` of them. The heartbeat carries
the smoothed times (``rtt_ms``), so the coordinator can place servers by the network, not
by speed alone (``shared/topology``). ``/health`` is open and cheap: a probe costs the peer
no compute and needs no signature.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from shared.errors import RemoteError
from shared.http import get_json

MAX_PEERS = 16
MAX_JOIN_PEERS = 32  # replicas a joining server (``--stage auto``) times before asking for a stage
PROBE_TIMEOUT_S = 2.0
EMA = 0.3  # weight of a new sample in the smoothed round-trip time


def peers_to_probe(view: dict, stage: int, own_url: str, limit: int = MAX_PEERS) -> list[str]:
    """Replicas of ``stage`` and of its neighbour stages in ``view`` (``GET /swarm``), own stage
    first, without ``own_url``; at most ``limit``."""
    by_stage = {int(s["stage"]): [r["url"] for r in s.get("replicas", [])] for s in view.get("stages", [])}
    urls = [
        u for st in (stage, stage - 1, stage + 1) for u in by_stage.get(st, []) if u.rstrip("/") != own_url.rstrip("/")
    ]
    return list(dict.fromkeys(urls))[:limit]


def spread_over_stages(view: dict, limit: int = MAX_JOIN_PEERS) -> list[str]:
    """Replica URLs of ``view`` (``GET /swarm``) taken one per stage in turn, at most ``limit``:
    a joiner that can time only some replicas still sees every stage."""
    queues = [[r["url"] for r in s.get("replicas", [])] for s in view.get("stages", [])]
    urls: list[str] = []
    while len(urls) < limit and any(queues):
        for queue in queues:
            if queue and len(urls) < limit:
                urls.append(queue.pop(0))
    return urls


async def time_health(session: aiohttp.ClientSession, url: str) -> float | None:
    """Milliseconds of one ``GET /health`` of ``url``, or None if it failed."""
    started = time.perf_counter()
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
            await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return round((time.perf_counter() - started) * 1000.0, 3)


async def probe_swarm(
    session: aiohttp.ClientSession, coordinator: str, limit: int = MAX_JOIN_PEERS
) -> dict[str, float]:
    """Round-trip times (peer URL -> ms) from here to up to ``limit`` of the swarm's replicas,
    for a server about to ask the coordinator for a stage; {} if the swarm cannot be read.
    Each replica is timed twice and the second time kept (the first pays the TCP connect)."""
    try:
        view = await get_json(session, coordinator + "/swarm", timeout_s=PROBE_TIMEOUT_S)
    except RemoteError:
        return {}
    urls = spread_over_stages(view, limit)

    async def twice(url: str) -> float | None:
        if await time_health(session, url) is None:
            return None
        return await time_health(session, url)

    samples = await asyncio.gather(*(twice(url) for url in urls))
    return {url: ms for url, ms in zip(urls, samples) if ms is not None}


class LatencyProbe:
    def __init__(self, session: aiohttp.ClientSession, coordinator: str, *, stage: int, own_url: str, every: int = 5):
        self.session, self.coordinator, self.stage, self.own_url, self.every = (
            session,
            coordinator,
            stage,
            own_url,
            every,
        )
        self.rtt_ms: dict[str, float] = {}
        self._beats = 0

    async def maybe_probe(self) -> dict[str, float]:
        """Probe on every ``every``-th call (the first included); the smoothed times so far."""
        self._beats += 1
        if (self._beats - 1) % self.every == 0:
            await self.probe()
        return dict(self.rtt_ms)

    async def probe(self) -> None:
        try:
            view = await get_json(self.session, self.coordinator + "/swarm", timeout_s=PROBE_TIMEOUT_S)
        except RemoteError:
            return  # keep what we measured; the heartbeat itself reports the coordinator's absence
        peers = peers_to_probe(view, self.stage, self.own_url)
        samples = await asyncio.gather(*(time_health(self.session, url) for url in peers))
        for url, ms in zip(peers, samples):
            if ms is not None:
                old = self.rtt_ms.get(url)
                self.rtt_ms[url] = ms if old is None else (1 - EMA) * old + EMA * ms
        self.rtt_ms = {url: ms for url, ms in self.rtt_ms.items() if url in peers}  # peers that left are forgotten
