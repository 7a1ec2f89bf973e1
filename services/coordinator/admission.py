"""Admission: which global step each microbatch is trained for, and when it may start.

Plain logic, no I/O; the clock is passed in. Before a trainer starts a microbatch it asks
the coordinator to admit it (``POST /step/admit``); the answer names the global step whose
batch the microbatch is for, or says to wait. Steps are counted over the whole swarm: the
swarm's step is the lowest step of its stages (every stage has taken the steps below it).
A step admits the run's global batch in samples; step ``k`` admits only while the swarm's
step is at least ``k - lookahead``:

- ``SWARM_SCHEDULE=sync`` (``lookahead`` 0): no microbatch of step ``k + 1`` starts before
  every stage took step ``k``. Every stage then computes each step's whole batch on the
  weights that step updates, exactly as one process would (GPipe/1F1B semantics).
- ``async`` (the default, ``lookahead`` = ``SWARM_MAX_STALENESS``): at most
  ``lookahead + 1`` global batches are in flight, so the samples in flight stay within what
  the stages' staleness bound admits, and a stale refusal is a rare fault, not the way the
  pipeline is throttled.

An admission holds its samples in its step until the step is taken (the microbatch's
re-runs keep it: asking again for the same id renews it), the trainer releases it (the
microbatch failed for good), or it is not renewed for ``lease_s`` (its trainer died): then
another microbatch takes its place in the step. A trainer renews the admissions of its
microbatches in flight every fraction of the lease (:meth:`renew`): a microbatch slower than
the lease (weak peers, slow links) keeps its place, where a replacement would fill its step
at every stage and leave its own gradient a step or two late. A microbatch that completed
is renewed no more: if a stage lost its samples (a replica that died or moved holding
them), its place goes to another after the lease, and the stage's step fills again.
Invariants (checked by the unit tests): a step never admits more than the global batch
plus one microbatch short of it (the last microbatch may overfill when the microbatch size
does not divide the batch); a step is admitted only within ``lookahead`` of the swarm's
step; one id holds one admission. A trainer is told ``complete`` (start no more
microbatches) once every step it trains for is admitted and taken by every stage: its
final evaluation then sees the run's last step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

SCHEDULES = ("async", "sync")
HISTORY_STEPS = 64  # steps whose admitted microbatch ids are kept for the run's view (and the sync test)


class Admit(str, Enum):
    """The answer to an admission."""

    ADMITTED = "admitted"  # train it for ``step`` (None: no window is known yet, the stages reserve its step)
    WAIT = "wait"  # the window is full: ask again once the swarm stepped
    COMPLETE = "complete"  # every step the trainer trains for is admitted and taken: no more microbatches


@dataclass
class _Held:
    step: int
    samples: int
    renewed_at: float


@dataclass
class Admission:
    global_batch: int  # samples of a global step (0: not known yet, no server said it: nothing is bounded)
    lookahead: int  # steps past the swarm's step that admit microbatches (0: the sync schedule)
    lease_s: float
    clock: Callable[[], float]
    swarm_step: int = 0
    admitted: dict[int, int] = field(default_factory=dict)  # step -> samples admitted
    expired: int = 0  # admissions whose trainer stopped renewing them (their samples admitted again)
    released: int = 0  # admissions given back by their trainer (a microbatch that failed for good)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))  # (step, [ids in admission order])
    _held: dict[str, _Held] = field(default_factory=dict)
    _order: dict[int, list[str]] = field(default_factory=dict)  # step -> ids admitted into it, in order

    def admit(self, microbatch_id: str, samples: int, until_step: int | None = None) -> tuple[Admit, int | None]:
        """Admit ``microbatch_id`` (``samples`` samples) for a step; ``until_step``: the trainer
        trains steps below it only."""
        if self.global_batch <= 0:
            return Admit.ADMITTED, None  # no window yet: the stages reserve its step
        now = self.clock()
        held = self._held.get(microbatch_id)
        if held is not None:
            held.renewed_at = now  # a re-run of an admitted microbatch: the same step
            return Admit.ADMITTED, held.step
        self._expire(now)
        k = self.swarm_step
        while self.admitted.get(k, 0) >= self.global_batch:
            k += 1
        if until_step is not None and k >= until_step:  # complete once the last of them is taken everywhere
            return (Admit.COMPLETE, None) if self.swarm_step >= until_step else (Admit.WAIT, None)
        if k > self.swarm_step + self.lookahead:
            return Admit.WAIT, None
        self.admitted[k] = self.admitted.get(k, 0) + samples
        self._held[microbatch_id] = _Held(k, samples, now)
        self._order.setdefault(k, []).append(microbatch_id)
        return Admit.ADMITTED, k

    def renew(self, microbatch_ids) -> int:
        """These microbatches are still in flight: their admissions are renewed (ids not held
        are skipped). Returns how many were."""
        now, renewed = self.clock(), 0
        for microbatch_id in microbatch_ids:
            held = self._held.get(microbatch_id)
            if held is not None:
                held.renewed_at, renewed = now, renewed + 1
        return renewed

    def step_of(self, microbatch_id: str) -> int | None:
        """The step ``microbatch_id`` holds an admission in (None: it holds none, or it lapsed)."""
        held = self._held.get(microbatch_id)
        return None if held is None or self.clock() - held.renewed_at > self.lease_s else held.step

    def release(self, microbatch_id: str) -> bool:
        """The microbatch failed for good: its samples leave its step (another takes them)."""
        held = self._held.pop(microbatch_id, None)
        if held is None:
            return False
        self._give_back(microbatch_id, held)
        self.released += 1
        return True

    def stepped(self, swarm_step: int) -> bool:
        """The swarm's step (its stages' lowest) is now ``swarm_step``: the admissions of the
        steps below are done. True if that opened the window further."""
        if swarm_step <= self.swarm_step:
            return False
        for k in [k for k in self.admitted if k < swarm_step]:
            del self.admitted[k]
            self.history.append((k, self._order.pop(k, [])))
        self._held = {mb: h for mb, h in self._held.items() if h.step >= swarm_step}
        self.swarm_step = swarm_step
        return True

    def floor(self, admitted_step: int) -> int:
        """The earliest step a stage may reserve a microbatch admitted for ``admitted_step``
        into: that step, or an earlier one with room left by admissions that expired or were
        released (their trainer died: without this, microbatches admitted further would wait
        for a step that nobody fills any more). An earlier step only shortens the delay."""
        self._expire(self.clock())
        if self.global_batch <= 0:
            return admitted_step
        holes = [k for k in range(self.swarm_step, admitted_step) if self.admitted.get(k, 0) < self.global_batch]
        return min(holes, default=admitted_step)

    def batch(self, step: int) -> list[str]:
        """The microbatch ids admitted into ``step``, in admission order (a step within the history)."""
        return list(self._order.get(step, next((ids for k, ids in self.history if k == step), [])))

    def in_flight(self) -> int:
        """Samples admitted for steps not taken yet."""
        return sum(self.admitted.values())

    def _expire(self, now: float) -> None:
        for mb, held in [(mb, h) for mb, h in self._held.items() if now - h.renewed_at > self.lease_s]:
            del self._held[mb]
            self._give_back(mb, held)
            self.expired += 1

    def _give_back(self, microbatch_id: str, held: _Held) -> None:
        self.admitted[held.step] = self.admitted.get(held.step, 0) - held.samples
        order = self._order.get(held.step, [])
        if microbatch_id in order:
            order.remove(microbatch_id)
