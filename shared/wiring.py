"""Stochastic wiring: which replica of a stage gets the trainer's next request.

Each trainer keeps its own estimate of every replica's speed (seconds per sample, a
bias-corrected EMA of its own calls) and sends each request to the replica that would
finish it first: every replica has a virtual time, when the work this trainer sent it
ends, never earlier than now (an idle replica starts at once, not in the past); a request
on it would finish at that time plus its expected duration; the earliest finish wins and
the replica's virtual time advances by the duration. Load thus spreads in proportion to
measured speed over many requests, and within a burst (a global step's microbatches sent
at once) a replica four times slower gets a request only where it would still finish no
later than the fast one's queue (judged at twice its estimate where it is much slower): a weak
peer is not the step's last microbatch. A replica
that errors is banned with exponential backoff; when every replica of a stage is banned,
bans are ignored. A replica the coordinator marks a hot spare (its stage does not need its
compute: ``shared.policy.spares``) gets no request while another usable replica of its
stage is there, and is the first to take over when none is.

Pure logic: no networking, no sleeping; time comes from ``clock`` and randomness from
``rng``, both injectable for tests.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable

KINDS = ("forward", "backward", "chain")  # chain: the same replica serves the forward and the backward


SLOWER = 1.5  # a replica this many times slower than the fastest is judged at twice its request's duration


class NoReplica(LookupError):
    """The stage has no replicas at all."""

    def __init__(self, stage: int):
        super().__init__(f"stage {stage} has no replicas")
        self.stage = stage


class ThroughputEMA:
    """Exponential moving average of seconds per sample, bias-corrected as in Adam.

    ``value`` is ``ema / (1 - decay**samples)``: the first update of ``x`` gives ``x``,
    not ``(1 - decay) * x``. ``value`` is None before the first update.
    """

    def __init__(self, decay: float = 0.9):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.samples = 0
        self._ema = 0.0

    def update(self, seconds_per_sample: float) -> None:
        self._ema = self.decay * self._ema + (1.0 - self.decay) * seconds_per_sample
        self.samples += 1

    @property
    def value(self) -> float | None:
        if not self.samples:
            return None
        return self._ema / (1.0 - self.decay**self.samples)


@dataclass
class _Replica:
    ema: ThroughputEMA
    virtual_time: float = 0.0
    failures: int = 0  # consecutive; reset by a success
    banned_until: float = float("-inf")
    spare: bool = False  # a hot spare: chosen only when no other usable replica is left


class ReplicaBalancer:
    """Per stage, this trainer's view of the stage's replicas: speed estimates, virtual
    finish times and bans. Reports about URLs the stage no longer has are ignored (the
    replica left while the request was in flight)."""

    def __init__(
        self,
        num_stages: int,
        *,
        ema_decay: float = 0.9,
        backward_cost: float = 2.5,
        ban_base_s: float = 1.0,
        ban_max_s: float = 60.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        if backward_cost <= 0:
            raise ValueError(f"backward_cost must be > 0, got {backward_cost}")
        if not 0 < ban_base_s <= ban_max_s:
            raise ValueError(f"need 0 < ban_base_s <= ban_max_s, got {ban_base_s} and {ban_max_s}")
        ThroughputEMA(ema_decay)  # validates the decay once, here
        self.ema_decay, self.backward_cost = ema_decay, backward_cost
        self.ban_base_s, self.ban_max_s = ban_base_s, ban_max_s
        self.rng = rng or random.Random()
        self.clock = clock
        self._origin = clock()  # virtual times count from here, in the estimates' seconds
        self._stages: list[dict[str, _Replica]] = [{} for _ in range(num_stages)]  # url -> replica, in registry order

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    def set_replicas(self, stage: int, urls: Iterable[str], spares: Iterable[str] = ()) -> None:
        """Make ``urls`` the stage's replicas, those in ``spares`` hot spares. Surviving URLs
        keep their estimate, virtual time and ban; removed ones are forgotten; new ones enter
        at the stage's current minimum virtual time, so they are tried promptly and get measured."""
        urls, spares = list(urls), set(spares)
        old = self._replicas(stage)
        survivors = [old[u].virtual_time for u in urls if u in old]
        entry_time = min(survivors, default=0.0)
        self._stages[stage] = {u: old.get(u) or _Replica(ThroughputEMA(self.ema_decay), entry_time) for u in urls}
        for url, replica in self._stages[stage].items():
            replica.spare = url in spares

    def choose(self, stage: int, *, kind: str = "forward", batch_size: int, exclude: Iterable[str] = ()) -> str:
        """The replica that would finish the request first: its virtual time (at least now)
        plus the request's expected duration on it, ties broken at random; its virtual time
        advances to that finish. A replica more than ``SLOWER`` times slower than the fastest
        is judged as if the request took it twice its estimate: it gets one only where it would
        still finish first, its estimate's error and what it adds to the step (its part of the
        step round) besides. Judged at its estimate, the heterogeneous arena's weak stage-0
        peer (a fifteenth of a core, its service time measured at about a third of the strong
        one's speed) took a microbatch in every other step, and those steps ended a second later.

        Candidates: the replicas not in ``exclude`` (all of them if that leaves none), among
        those the ones not banned (all of them if none), and among those the ones that are not
        hot spares (the spares if only they are left). A banned replica's virtual time keeps
        pace with the chosen one, so it gets no burst of requests on return.
        Raises :class:`NoReplica` if the stage has no replicas.
        """
        _check_kind(kind)
        replicas = self._replicas(stage)
        if not replicas:
            raise NoReplica(stage)
        excluded = set(exclude)
        allowed = [u for u in replicas if u not in excluded] or list(replicas)
        unbanned = [u for u in allowed if not self.is_banned(stage, u)] or allowed
        candidates = [u for u in unbanned if not replicas[u].spare] or unbanned
        now, work = self.clock() - self._origin, batch_size * self._cost(kind)
        per_sample = {u: self._seconds_per_sample(stage, u) for u in candidates}
        finish = {u: max(replicas[u].virtual_time, now) + work * per_sample[u] for u in candidates}
        fastest = min(per_sample.values())
        judged = {  # a much slower replica is judged as if the request took it twice as long
            u: finish[u] + (work * per_sample[u] if per_sample[u] > SLOWER * fastest else 0.0) for u in candidates
        }
        best = min(judged.values())
        url = self.rng.choice([u for u in candidates if judged[u] == best])
        earliest = finish[url]
        start = max(replicas[url].virtual_time, now)
        for other in replicas:
            if self.is_banned(stage, other):
                replicas[other].virtual_time = max(replicas[other].virtual_time, start)
        replicas[url].virtual_time = earliest
        return url

    def alternates(self, stage: int, chosen: str, limit: int) -> list[str]:
        """Up to ``limit`` other usable replicas of the stage, the fastest first (unmeasured
        ones after the measured; hot spares among them: they take over when ``chosen``
        fails): where a chain goes when ``chosen`` fails."""
        others = [u for u in self.usable(stage) if u != chosen]
        return sorted(
            others,
            key=lambda u: (self._replicas(stage)[u].ema.value is None, self._replicas(stage)[u].ema.value or 0.0),
        )[:limit]

    def report_success(self, stage: int, url: str, seconds: float, batch_size: int, kind: str) -> None:
        """A call took ``seconds`` for ``batch_size`` samples: update the replica's speed
        (a backward's time is divided by ``backward_cost``) and clear its failure count."""
        _check_kind(kind)
        replica = self._replicas(stage).get(url)
        if replica is None:
            return
        replica.ema.update(seconds / (batch_size * self._cost(kind)))
        replica.failures = 0

    def report_failure(self, stage: int, url: str) -> None:
        """Ban the replica for ``min(ban_max_s, ban_base_s * 2**(failures - 1))`` seconds,
        ``failures`` counting consecutive failures including this one."""
        replica = self._replicas(stage).get(url)
        if replica is None:
            return
        replica.failures += 1
        ban_s = min(self.ban_max_s, self.ban_base_s * 2.0 ** min(replica.failures - 1, 64))
        replica.banned_until = self.clock() + ban_s

    def is_banned(self, stage: int, url: str) -> bool:
        replica = self._replicas(stage).get(url)
        return replica is not None and self.clock() < replica.banned_until

    def usable(self, stage: int) -> list[str]:
        """The stage's replicas that are not banned, in registry order."""
        return [u for u in self._replicas(stage) if not self.is_banned(stage, u)]

    def has_usable(self, stage: int) -> bool:
        return bool(self.usable(stage))

    def next_usable_in(self, stage: int) -> float | None:
        """Seconds until the stage's first ban runs out (0 if a replica is usable now); None
        if the stage has no replicas."""
        replicas = self._replicas(stage)
        if not replicas:
            return None
        return max(0.0, min(r.banned_until for r in replicas.values()) - self.clock())

    def estimates(self, stage: int) -> dict[str, float | None]:
        """Seconds per sample of each replica of the stage; None where not measured yet."""
        return {u: r.ema.value for u, r in self._replicas(stage).items()}

    def _cost(self, kind: str) -> float:
        """A request's work in forwards of its samples."""
        return {"forward": 1.0, "backward": self.backward_cost, "chain": 1.0 + self.backward_cost}[kind]

    def _replicas(self, stage: int) -> dict[str, _Replica]:
        if not 0 <= stage < len(self._stages):
            raise IndexError(f"stage {stage} out of range: num_stages is {len(self._stages)}")
        return self._stages[stage]

    def _seconds_per_sample(self, stage: int, url: str) -> float:
        """The replica's estimate, else the mean of the stage's measured replicas, else 1.0."""
        own = self._replicas(stage)[url].ema.value
        if own is not None:
            return own
        measured = [v for v in self.estimates(stage).values() if v is not None]
        return sum(measured) / len(measured) if measured else 1.0


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
