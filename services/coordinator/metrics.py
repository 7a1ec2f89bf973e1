"""The coordinator's metrics beyond the HTTP edge (see ``shared.metrics``), read at scrape
time: replicas and capacity per stage, the weakest stage, the swarm's events by name
(joins, leaves, expiries, moves, averaging rounds, checkpoints), trainers reporting and
the bytes its own loops moved."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.coordinator.dashboard import RecentEvents, TrainingProgress
from services.coordinator.registry import Registry
from shared.metrics import Metrics, counter, gauge


class CoordinatorMetrics:
    def __init__(
        self,
        metrics: Metrics,
        registry: Registry,
        events: RecentEvents,
        progress: TrainingProgress,
        traffic: dict,
        step_view: Callable[[], list[dict]] = list,
    ):
        """``step_view``: the global steps' per-stage view (``StepCounter.view``)."""
        self.registry, self.events, self.progress, self.traffic = registry, events, progress, traffic
        self.step_view = step_view
        metrics.add_state(self.collect)

    def collect(self) -> Iterable:
        swarm = self.registry.swarm()  # the placement policy's view: capacities and the weakest stage by its rule
        per_stage = lambda values: {(str(stage),): value for stage, value in enumerate(values)}  # noqa: E731
        yield gauge(
            "swarm_coordinator_replicas", "live replicas per stage", per_stage(swarm.replica_counts()), ["stage"]
        )
        capacities = swarm.capacities()
        yield gauge(
            "swarm_coordinator_stage_capacity_samples_per_second",
            "sum of the replicas' reported throughput, per stage",
            per_stage(capacities),
            ["stage"],
        )
        yield gauge(
            "swarm_coordinator_stage_queue_length",
            "sum of the replicas' reported queue lengths, per stage",
            per_stage(swarm.queue_lengths()),
            ["stage"],
        )
        weakest = swarm.weakest_stage()
        yield gauge(
            "swarm_coordinator_weakest_stage", "the stage with the least capacity (the swarm's speed limit)", weakest
        )
        yield gauge(
            "swarm_coordinator_weakest_stage_capacity_samples_per_second",
            "capacity of the weakest stage: the swarm trains no faster",
            capacities[weakest],
        )
        yield gauge("swarm_coordinator_live_servers", "stage servers whose lease runs", len(swarm.replicas))
        yield counter(
            "swarm_coordinator_events",
            "swarm events since the coordinator started, by name (registry.registered, rebalance.move, "
            "averaging.round.started, step.round.started, ...)",
            {(name,): n for name, n in self.events.counts.items()},
            ["event"],
        )
        yield counter(
            "swarm_coordinator_averaging_rounds_started",
            "averaging rounds (checks and repairs of the replicas' weights) the coordinator started",
            self.events.counts["averaging.round.started"],
        )
        yield counter(
            "swarm_coordinator_step_rounds_started",
            "gradient all-reduce rounds (one per stage per global step) the coordinator started",
            self.events.counts["step.round.started"],
        )
        yield gauge(
            "swarm_coordinator_trainers_reporting", "trainers whose progress reports are kept", len(self.progress)
        )
        loops = {
            (loop, direction): counts[key]
            for loop, counts in self.traffic.items()
            for direction, key in (("sent", "sent"), ("received", "received"))
        }
        yield counter(
            "swarm_coordinator_loop_bytes",
            "bytes the coordinator's own loops (averaging control, checkpoints) moved",
            loops,
            ["loop", "direction"],
        )
        steps = self.step_view()
        if steps:
            by_stage = lambda key: {(str(v["stage"]),): v[key] for v in steps}  # noqa: E731
            yield gauge(
                "swarm_coordinator_global_step", "global steps each stage has taken", by_stage("step"), ["stage"]
            )
            yield counter(
                "swarm_coordinator_steps_lost",
                "global steps whose updates a stage lost: every replica holding them died and a server caught up "
                "(SWARM_RECOVERY says from what)",
                by_stage("steps_lost_total"),
                ["stage"],
            )
            yield counter(
                "swarm_coordinator_samples_dropped",
                "accumulated samples that did not count in their global step, per stage",
                by_stage("samples_dropped"),
                ["stage"],
            )
            yield counter(
                "swarm_coordinator_duplicates_refused",
                "backwards of a microbatch the stage held already, refused (counted once), per stage",
                by_stage("duplicates_refused"),
                ["stage"],
            )
