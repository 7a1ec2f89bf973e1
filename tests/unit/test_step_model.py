"""A model of the global steps' counter (``services/coordinator/steps.py``) checked over
random interleavings of reservations, reports (on time, late, given back, unreserved),
replicas vanishing, timeouts and step rounds (hypothesis' stateful testing).

Rules of the model, each a hole found before (see ``test_step_dedup.py``):
- a step counts what is reserved: ``reserved == done + live reservations``, never below 0;
- a step counts at most the global batch plus one microbatch through reservations, late
  reports included, and at most one global batch of unreserved samples;
- a microbatch counts once per stage: not again within ``WINDOW_STEPS`` steps.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.coordinator.steps import WINDOW_STEPS, StepCounter
from shared.step_protocol import DoneReport, ReserveRequest, Verdict

G, MAX_MB = 8, 4
REPLICAS = ("http://a", "http://b", "http://c")
MICROBATCHES = [f"mb{i}" for i in range(10)]


class StepCounting(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.now = 0.0
        self.counter = StepCounter(1, timeout_s=5.0, clock=lambda: self.now)
        self.out: list[tuple[ReserveRequest, int]] = []  # reservations granted, not reported yet
        self.counted: dict[str, list[int]] = {}  # microbatch -> steps its samples were counted in

    @property
    def stage(self):
        return self.counter.stages[0]

    @rule(url=st.sampled_from(REPLICAS), mb=st.sampled_from(MICROBATCHES), samples=st.integers(1, MAX_MB))
    def reserve(self, url, mb, samples):
        req = ReserveRequest(0, url, self.stage.step, samples, G, mb)
        answer = self.counter.reserve(req)
        if answer.verdict.accumulates:
            self.out.append((req, answer.bucket))
        else:
            assert answer.verdict in (Verdict.DUPLICATE, Verdict.WAIT), answer

    @precondition(lambda self: self.out)
    @rule(pick=st.integers(0, 100), accumulated=st.booleans())
    def report(self, pick, accumulated):
        req, bucket = self.out.pop(pick % len(self.out))
        samples = req.samples if accumulated else 0
        before = self.stage.done.get(bucket, 0) if bucket >= self.stage.step else None
        self.counter.done(DoneReport(0, req.url, self.stage.step, bucket, req.samples, samples, G, req.microbatch_id))
        if before is not None and self.stage.done.get(bucket, 0) > before:
            self.counted.setdefault(req.microbatch_id, []).append(bucket)

    @rule(url=st.sampled_from(REPLICAS), samples=st.integers(0, 3 * G))
    def unreserved(self, url, samples):
        self.counter.done(DoneReport(0, url, self.stage.step, self.stage.step, 0, samples, G))

    @rule(dt=st.sampled_from([1.0, 6.0]))
    def time_passes(self, dt):
        self.now += dt

    @rule(live=st.sets(st.sampled_from(REPLICAS)))
    def step_round(self, live):
        """The stage's round starts if the counter says so; its members step with what they hold."""
        if not self.counter.ready(0, sorted(live)):
            return
        self.counter.round_started(0, f"r{self.stage.step}")
        members = sorted(live) or [REPLICAS[0]]
        share = self.stage.done.get(self.stage.step, 0) // len(members)
        self.counter.round_ended(0, {url: self.stage.step + 1 for url in members}, {url: share for url in members})

    @invariant()
    def counts_add_up(self):
        if not hasattr(self, "counter"):
            return
        s = self.stage
        for k, reserved in s.reserved.items():
            live = sum(c.samples for c in s.claims.get(k, {}).values())
            assert reserved == s.done.get(k, 0) + live >= 0, (k, s)

    @invariant()
    def a_step_counts_at_most_its_global_batch(self):
        if not hasattr(self, "counter"):
            return
        s = self.stage
        for k, done in s.done.items():
            assert s.unreserved.get(k, 0) <= G, (k, s)
            assert done - s.unreserved.get(k, 0) < G + MAX_MB, (k, s)

    @invariant()
    def a_microbatch_counts_once(self):
        if not hasattr(self, "counter"):
            return
        for mb, steps in getattr(self, "counted", {}).items():
            assert all(b - a > WINDOW_STEPS for a, b in zip(steps, steps[1:])), (mb, steps)
        claimed = [mb for claims in self.stage.claims.values() for mb in claims]
        assert len(claimed) == len(set(claimed))
        for k, claims in self.stage.claims.items():
            for mb, claim in claims.items():
                assert self.stage.held[mb] == (k, claim.url)


TestStepCounting = StepCounting.TestCase
TestStepCounting.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
