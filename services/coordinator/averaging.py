"""Averaging rounds, coordinator side: name a round and tell each member its place.

Control messages only: the members move the tensors among themselves (butterfly
all-reduce, see the stage server's ``averaging.py``). Every member gets the same member
list, so a member that refuses or cannot be reached stays in the list as a failed member:
the others leave it out of the round when it does not answer them, and nobody waits on it
past ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import aiohttp

from shared.codec import FLOAT_CODECS
from shared.errors import RemoteError
from shared.http import get_json, post_message
from shared.log import get_logger

START_TIMEOUT_S = 5.0  # cap on each /average/start call (a member answers it at once)


async def start_round(
    session: aiohttp.ClientSession,
    stage: int,
    member_urls: list[str],
    *,
    codec: str,
    timeout_s: float,
    log=None,
    with_accepted: bool = False,
    aggregator: str = "mean",
    kind: str = "params",
    step: int = 0,
):
    """Start one averaging round of ``stage`` among ``member_urls`` (index = position); return its
    id (``with_accepted``: the id and how many members accepted).

    Posts ``/average/start`` to every member at once; members that refuse (e.g. 409: busy
    with a round, or another stage now) or cannot be reached are logged
    (``averaging.start.refused``) and left out of the round.
    """
    if not member_urls:
        raise ValueError("an averaging round needs at least one member")
    if codec not in FLOAT_CODECS:
        raise ValueError(f"averaging codec must be one of {FLOAT_CODECS}, got {codec!r}")
    if not timeout_s > 0:
        raise ValueError(f"averaging timeout_s must be > 0, got {timeout_s}")
    log = log or get_logger(service="coordinator")
    members = [url.rstrip("/") for url in member_urls]
    round_id = f"{'step' if kind == 'step' else 'avg'}-s{stage}-{uuid.uuid4().hex[:12]}"

    async def tell(index: int, url: str) -> bool:
        msg = {
            "round_id": round_id,
            "stage": stage,
            "members": members,
            "index": index,
            "codec": codec,
            "timeout_s": timeout_s,
            "aggregator": aggregator,
            "kind": kind,
            "step": step,
        }
        try:
            await post_message(session, url + "/average/start", msg, timeout_s=min(START_TIMEOUT_S, timeout_s))
            return True
        except RemoteError as exc:
            log.warning(
                "averaging.start.refused",
                round_id=round_id,
                stage=stage,
                member=url,
                index=index,
                status=exc.status,
                code=exc.code,
                reason=exc.message,
            )
            return False

    accepted = await asyncio.gather(*(tell(i, url) for i, url in enumerate(members)))
    if kind != "step":  # a step round is logged by its scheduler, with its step (step.round.started)
        log.info(
            "averaging.round.started",
            round_id=round_id,
            kind=kind,
            stage=stage,
            members=len(members),
            accepted=sum(accepted),
            codec=codec,
            aggregator=aggregator,
            timeout_s=timeout_s,
        )
    return (round_id, sum(accepted)) if with_accepted else round_id


STATUS_POLL_S = 0.05  # how often a pass asks members whether their round ended (first wait; doubles to 0.5)


@dataclass
class StageRound:
    """One stage's round in a pass, as the coordinator saw it."""

    stage: int
    round_id: str
    members: list[str]
    accepted: int
    ended: int = 0  # members seen done with the round (or gone) before the pass gave up

    def as_json(self) -> dict:
        return asdict(self)


class AveragingScheduler:
    """Runs checks that the replicas of each stage are one model: every ``every_s`` seconds
    (0: only on demand) and when :meth:`average_now` asks (``POST /average``, e.g. a trainer
    before its final evaluation), each stage with two or more live replicas is asked for
    their digests (``GET /digest``: step and SHA-256 of weights and optimizer state).
    Replicas at one step with different digests drifted apart (a bug, a fault, a state
    loaded by hand): they are repaired by a params round (their weights averaged), and the
    pass waits until the members report it ended. Replicas caught between two steps are
    checked next time. In ``SWARM_SYNC=local`` mode a replica's digest covers what the
    replicas share (step, anchor, outer momentum), and replicas that have not taken the same
    number of outer steps yet are between steps too."""

    def __init__(
        self,
        live_servers: Callable[[], Iterable],
        *,
        every_s: float,
        codec: str,
        timeout_s: float,
        log,
        aggregator: str = "mean",
    ):
        self.live_servers, self.every_s, self.codec, self.timeout_s, self.log = (
            live_servers,
            every_s,
            codec,
            timeout_s,
            log,
        )
        self.aggregator = aggregator
        self.session: aiohttp.ClientSession | None = None
        self.passes = 0
        self.checks: list[dict] = []  # the last pass's checks, one per stage checked
        self._wake = asyncio.Event()
        self._waiters: list[asyncio.Future] = []

    async def run(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        while True:
            if self.every_s > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.every_s)
            else:
                await self._wake.wait()
            self._wake.clear()
            waiters, self._waiters = self._waiters, []  # a request arriving now waits for the next pass
            try:
                rounds = await self.average_once()
            except Exception as exc:  # noqa: BLE001 - a pass that broke must not end the loop
                self.log.exception("averaging.pass.failed", error=repr(exc))
                rounds = exc
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(rounds) if isinstance(rounds, Exception) else waiter.set_result(rounds)

    async def average_now(self) -> list[StageRound]:
        """Ask for a pass and wait for it (the one after any pass now running)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        return await waiter

    async def average_once(self) -> list[StageRound]:
        """One pass: check every stage with 2+ replicas; repair the drifted ones; their rounds."""
        by_stage: dict[int, list[str]] = {}
        for server in self.live_servers():
            by_stage.setdefault(server.stage, []).append(server.url)
        stages = [(stage, urls) for stage, urls in sorted(by_stage.items()) if len(urls) >= 2]
        if not stages or self.session is None:
            self.checks = []
            return []
        self.checks = list(await asyncio.gather(*(self._check(stage, urls) for stage, urls in stages)))
        drifted = [(c["stage"], c["replicas"]) for c in self.checks if c["verdict"] == "drifted"]
        started = await asyncio.gather(*(self._start(stage, urls) for stage, urls in drifted))
        await asyncio.gather(*(self._wait_ended(r) for r in started))
        self.passes += 1
        return list(started)

    async def _check(self, stage: int, urls: list[str]) -> dict:
        """{stage, verdict: identical | drifted | between_steps | unreachable, replicas, steps, digests}."""

        async def digest(url: str) -> dict | None:
            try:
                return await get_json(self.session, url + "/digest", timeout_s=self.timeout_s)
            except RemoteError as exc:
                self.log.warning("averaging.check.unreachable", stage=stage, replica=url, error=str(exc))
                return None

        answers = dict(zip(urls, await asyncio.gather(*(digest(u) for u in urls))))
        answered = {u: a for u, a in answers.items() if isinstance(a, dict) and "step" in a and "digest" in a}
        steps = sorted(
            {(a["step"], a.get("outer_steps", 0)) if "outer_steps" in a else a["step"] for a in answered.values()},
            key=str,
        )  # local mode: (step, outer steps)
        digests = sorted({a["digest"] for a in answered.values()})
        if len(answered) < 2:
            verdict = "unreachable"
        elif len(steps) > 1:
            verdict = "between_steps"
        else:
            verdict = "identical" if len(digests) == 1 else "drifted"
        check = {
            "stage": stage,
            "verdict": verdict,
            "replicas": sorted(answered),
            "steps": steps,
            "digests": len(digests),
        }
        level = "warning" if verdict == "drifted" else "info"
        getattr(self.log, level)(
            f"averaging.check.{verdict}", stage=stage, replicas=len(answered), steps=steps, digests=len(digests)
        )
        return check

    async def _start(self, stage: int, urls: list[str]) -> StageRound:
        round_id, accepted = await start_round(
            self.session,
            stage,
            urls,
            codec=self.codec,
            timeout_s=self.timeout_s,
            log=self.log,
            with_accepted=True,
            aggregator=self.aggregator,
        )
        return StageRound(stage, round_id, [u.rstrip("/") for u in urls], accepted)

    async def _wait_ended(self, rnd: StageRound) -> None:
        await wait_round_ended(self.session, rnd, self.timeout_s)


async def wait_round_ended(session: aiohttp.ClientSession, rnd: StageRound, timeout_s: float) -> dict[str, dict]:
    """Until every member's round ``rnd`` ended (its status no longer runs it) or it cannot
    be asked, bounded by the round's timeout plus a grace period; sets ``rnd.ended`` and
    returns the last status of each member that answered (URL -> ``/average/status``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s + START_TIMEOUT_S
    pending, delay, statuses = set(rnd.members), STATUS_POLL_S, {}

    async def ask(url: str) -> None:  # a member answers once the round ended there (or its wait ran out)
        left = max(0.1, deadline - loop.time())
        try:
            status = await get_json(
                session,
                f"{url}/average/status?wait={rnd.round_id}&wait_s={min(left, 10.0):.3f}",
                timeout_s=min(left, 10.0) + START_TIMEOUT_S,
            )
        except RemoteError:
            pending.discard(url)  # gone: its peers leave it out
            return
        statuses[url] = status
        if status.get("running") != rnd.round_id:
            pending.discard(url)

    while pending and loop.time() < deadline:
        await asyncio.gather(*(ask(url) for url in list(pending)))
        if pending:  # an older member that does not wait: poll
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(0.5, delay * 2)
    rnd.ended = len(rnd.members) - len(pending)
    return statuses
