"""Averaging rounds, coordinator side: name a round and tell each member its place (and its
part of the vector, :func:`round_shares`); and the periodic check that the replicas of each
stage are one model, with its drift repair.

Control messages only: a repair's state goes from one replica to another. (A step
round is started by ``steps.py``.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import aiohttp

from shared.errors import RemoteError
from shared.http import get_json, post_message

_COPY_GRACE_S = 5.0  # a repair target answers once it loaded the state: its copy timeout plus this

IDLE_SHARE = 0.1  # the part a member with no sample of the step reduces, against 1 for one with samples


def round_shares(samples: list[int]) -> list[float] | None:
    """Each member's part of a step round's vector to reduce, in member order, from the
    samples each holds for the step (the coordinator's count): a member with none sends no
    values (its weight is 0) and reduces a tenth of what one with samples does; None (equal
    parts) where all or none hold samples. Equal parts keep a round's links even: in a round
    of two over full-duplex links each phase lasts as long as its larger transfer, so a
    member that sends and receives a share f of the vector takes ``2 max(f, 1 - f)`` of the
    vector's time on its link, least at a half. A member without samples sends nothing in the
    first phase, and the less it reduces, the less its peer waits for it (a weak replica,
    a fifteenth of a core in the heterogeneous arena, reduced half of stage 0's vector in 0.4
    s). Splitting by declared CPU speed instead was measured and dropped: it makes a weak
    peer on a slow link carry more than half of the vector in a phase."""
    if len(samples) < 2 or all(n > 0 for n in samples) or not any(n > 0 for n in samples):
        return None
    weights = [1.0 if n > 0 else IDLE_SHARE for n in samples]
    return [round(w / sum(weights), 6) for w in weights]


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
                    self.session, url + "/average/copy", msg, timeout_s=self.timeout_s + _COPY_GRACE_S
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
