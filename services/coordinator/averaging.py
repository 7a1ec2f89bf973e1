"""Averaging rounds, coordinator side: name a round and tell each member its place; and the
periodic check that the replicas of each stage are one model, with its drift repair.

Control messages only: the members move the tensors among themselves (butterfly
all-reduce, see the stage server's ``averaging.py``; a repair's state goes from one
replica to another). Every member gets the same member list, so a member that refuses or
cannot be reached stays in the list as a failed member: the others leave it out of the
round when it does not answer them, and nobody waits on it past ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

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
    error_feedback: bool = False,
):
    """Start one averaging round of ``stage`` among ``member_urls`` (index = position); return its
    id (``with_accepted``: the id and how many members accepted). ``error_feedback``: a step
    round's members compensate what the codec lost last step (stage server's ``error_feedback.py``).

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
            **({"error_feedback": True} if error_feedback else {}),
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


def plan_repair(digests: Mapping[str, str]) -> tuple[str, list[str]]:
    """(source, targets) of a drift repair among replicas at one step (URL -> digest): the
    source is the first URL of the largest group of identical replicas (ties: the group
    with the first URL); the targets, every replica with another digest, take its state."""
    assert len(set(digests.values())) > 1, "a repair needs replicas that differ"
    groups: dict[str, list[str]] = {}
    for url in sorted(digests):
        groups.setdefault(digests[url], []).append(url)
    source = min(groups.values(), key=lambda urls: (-len(urls), urls[0]))[0]
    return source, sorted(url for url, d in digests.items() if d != digests[source])


@dataclass
class StageRepair:
    """One stage's drift repair in a pass: ``targets`` took ``source``'s whole state at ``step``."""

    stage: int
    step: int
    source: str
    targets: list[str]
    repaired: list[str] = field(default_factory=list)  # the targets that loaded it and then matched the source

    def as_json(self) -> dict:
        return {**asdict(self), "ended": len(self.repaired)}  # ended: what a trainer's log shows


class AveragingScheduler:
    """Runs checks that the replicas of each stage are one model: every ``every_s`` seconds
    (0: only on demand) and when :meth:`average_now` asks (``POST /average``, e.g. a trainer
    before its final evaluation), each stage with two or more live replicas is asked for
    their digests (``GET /digest``: step and SHA-256 of weights and optimizer state).
    Replicas at one step with different digests drifted apart (a bug, a fault, a state
    loaded by hand): they are repaired by copying a whole state (``POST /average/copy``,
    see :func:`plan_repair`): averaging their weights would leave their optimizer states
    apart, and the check would find them drifted forever. The pass waits until each
    target answered; a target that moved on meanwhile is repaired by the next check.
    Replicas caught between two steps are checked next time. In ``SWARM_SYNC=local`` mode a
    replica's digest covers what the replicas share (step, anchor, outer momentum), and
    replicas that have not taken the same number of outer steps yet are between steps too.
    ``codec`` and ``aggregator`` are those of the run's rounds; a repair moves a state
    as it is."""

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
                repairs = await self.average_once()
            except Exception as exc:  # noqa: BLE001 - a pass that broke must not end the loop
                self.log.exception("averaging.pass.failed", error=repr(exc))
                repairs = exc
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(repairs) if isinstance(repairs, Exception) else waiter.set_result(repairs)

    async def average_now(self) -> list[StageRepair]:
        """Ask for a pass and wait for it (the one after any pass now running)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        return await waiter

    async def average_once(self) -> list[StageRepair]:
        """One pass: check every stage with 2+ replicas; repair the drifted ones; their repairs."""
        by_stage: dict[int, list[str]] = {}
        for server in self.live_servers():
            by_stage.setdefault(server.stage, []).append(server.url)
        stages = [(stage, urls) for stage, urls in sorted(by_stage.items()) if len(urls) >= 2]
        if not stages or self.session is None:
            self.checks = []
            return []
        checked = await asyncio.gather(*(self._check(stage, urls) for stage, urls in stages))
        self.checks = [check for check, _ in checked]
        repairs = [
            self._repair(check["stage"], check["steps"][0], digests)
            for check, digests in checked
            if check["verdict"] == "drifted"
        ]
        done = list(await asyncio.gather(*repairs))
        self.passes += 1
        return done

    async def _check(self, stage: int, urls: list[str]) -> tuple[dict, dict[str, str]]:
        """({stage, verdict: identical | drifted | between_steps | unreachable, replicas, steps,
        digests}, URL -> digest of the replicas that answered)."""

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
        return check, {u: str(a["digest"]) for u, a in answered.items()}

    async def _repair(self, stage: int, step: int | tuple[int, int], digests: dict[str, str]) -> StageRepair:
        """Every target of :func:`plan_repair` takes the source's whole state (``POST /average/copy``)."""
        step = step[0] if isinstance(step, tuple) else step  # local mode: (step, outer steps)
        source, targets = plan_repair(digests)
        repair = StageRepair(stage, step, source, targets)
        self.log.warning("averaging.repair.started", stage=stage, step=step, source=source, targets=targets)

        async def copy(url: str) -> None:
            msg = {"stage": stage, "source": source, "step": step, "timeout_s": self.timeout_s}
            try:
                reply = await post_message(
                    self.session, url + "/average/copy", msg, timeout_s=self.timeout_s + START_TIMEOUT_S
                )
            except RemoteError as exc:
                self.log.warning(
                    "averaging.repair.refused",
                    stage=stage,
                    target=url,
                    source=source,
                    status=exc.status,
                    code=exc.code,
                    reason=exc.message,
                )
                return
            if reply.get("digest") == digests[source]:
                repair.repaired.append(url)
            else:  # loaded, yet not the state checked (the source's changed in between): the next check sees
                self.log.warning("averaging.repair.unmatched", stage=stage, target=url, source=source)

        await asyncio.gather(*(copy(url) for url in targets))
        repair.repaired.sort()
        self.log.info(
            "averaging.repair.done", stage=stage, step=step, repaired=len(repair.repaired), targets=len(targets)
        )
        return repair


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
