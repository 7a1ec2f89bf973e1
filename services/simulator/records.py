"""The simulator's records: a run's configuration (:class:`SimConfig`), what a stage costs
(:class:`StageCost`), a simulated peer (:class:`SimPeer`), one microbatch's trip through the
pipeline (:class:`MicrobatchTrip`) and what a run produced (:class:`Report`). Plain data,
shared by SWARM's simulation (``sim.py``) and the fixed-pipeline baseline (``fixed.py``)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from shared.topology.network import Peer

BACKWARD_COST = 2.5  # backward (with the forward recomputed) over forward, as the balancer assumes
MODES = ("swarm", "fixed")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times in (simulated) seconds."""

    mode: str = "swarm"
    num_peers: int = 1000
    num_stages: int = 8
    model: str = "xl"  # a shared.model preset: sizes of a stage's parameters and activations
    gpu_tflops: tuple[float, ...] = (10.0, 30.0, 80.0)  # effective TFLOP/s of the GPU classes peers draw from
    regions: tuple[str, ...] = ()  # default: every region of the shipped matrix
    microbatch: int = 32  # samples
    microbatches_in_flight: int = 2000  # over the whole swarm
    trainers: int = 64  # swarm mode; fixed mode has one per pipeline
    wire_bytes: float = 1.0  # per activation value (int8 wire)
    duration_s: float = 300.0
    mean_lifetime_s: float = 600.0  # inf: no preemption
    join_rate_per_s: float | None = None  # None: num_peers / mean_lifetime_s
    lease_s: float = 15.0  # the registry (and a fixed pipeline's coordinator) sees a silent peer dead after this
    registry_refresh_s: float = 5.0
    dead_peer_timeout_s: float = 5.0
    max_retries: int = 3
    repair_delay_s: float = 30.0  # fixed mode: a repaired pipeline's restart, besides detection and state download
    average_every_s: float = 60.0
    rebalance_every_s: float = 60.0
    planner_evaluations: float = 1500  # placements the planner may evaluate per call (keeps runs reproducible)
    planner_budget_s: float = 2.0  # and the wall time it may take at most
    max_moves_fraction: float = 0.05  # of the serving peers, per rebalancing
    rebalance_min_gain: float = (
        0.02  # the planner's min_gain: lower than a coordinator's, the simulated measurements are exact
    )
    rebalance_confirmations: int = (
        2  # consecutive checks that must find a replan worth it before servers move (the coordinator's rule)
    )
    windows: int = 10  # tokens/s is also reported per window of the run
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_peers < self.num_stages:
            raise ValueError(f"num_peers ({self.num_peers}) must be >= num_stages ({self.num_stages})")
        if not (self.duration_s > 0 and self.mean_lifetime_s > 0 and self.microbatch >= 1):
            raise ValueError("duration_s, mean_lifetime_s and microbatch must be > 0")
        if self.repair_delay_s < 0 or self.lease_s <= 0 or self.dead_peer_timeout_s <= 0:
            raise ValueError("repair_delay_s must be >= 0, lease_s and dead_peer_timeout_s > 0")


@dataclass(frozen=True)
class StageCost:
    """What one stage weighs: FLOPs per sample (forward + backward), activation and state bytes."""

    flops_per_sample: float
    activation_bytes_per_sample: float
    state_bytes: float
    tokens_per_sample: int

    @classmethod
    def from_preset(cls, name: str, num_stages: int, wire_bytes: float) -> StageCost:
        from shared.model import config_from_preset  # torch: imported only when a run starts

        cfg = config_from_preset(name)
        params = 12 * cfg.n_layer * cfg.d_model**2 + (cfg.vocab_size + cfg.block_size) * cfg.d_model
        per_stage = params / num_stages
        return cls(
            6.0 * per_stage * cfg.block_size, cfg.block_size * cfg.d_model * wire_bytes, 4.0 * per_stage, cfg.block_size
        )

    def samples_per_s(self, tflops: float) -> float:
        return tflops * 1e12 / self.flops_per_sample


@dataclass
class SimPeer:
    peer: Peer
    region: int
    stage: int = -1
    state: str = "idle"  # idle (a fixed-mode spare) | joining | serving | draining | dead
    generation: int = 0  # bumped when the peer dies or changes stage: stale events are ignored
    busy_until: float = 0.0
    uplink_free: float = 0.0
    died_at: float = math.inf
    busy_s: float = 0.0
    serving_since: float = 0.0
    next_stage: int = -1
    queued: deque = field(default_factory=deque)  # (start, end) of the ops accepted, in order


@dataclass(eq=False)
class MicrobatchTrip:
    """One microbatch's way through the pipeline: forward up the stages, backward down.
    A cancelled trip (its fixed pipeline broke) is dropped by every event that carries it."""

    trainer: int
    stage: int = 0
    kind: str = "forward"
    source: str | None = None  # peer whose output this hop carries; None: the trainer
    attempts: int = 0
    tried: list[str] = field(default_factory=list)
    compute_s: float = 0.0
    sent_at: float = 0.0
    cancelled: bool = False


@dataclass
class Report:
    """What a run produced: throughput, where the time went, what was lost."""

    mode: str
    peers: int
    stages: int
    duration_s: float
    tokens_per_s: float
    tokens_per_s_windows: list[float]
    stage_utilisation: list[float]
    stage_replicas_end: list[int]
    lost_work_fraction: float
    lost_microbatches: int
    completed_microbatches: int
    failed_hops: int
    deaths: int
    joins: int
    moves: int
    averaging_rounds: int
    mean_averaging_s: float
    planner_s: float
    wall_s: float
    cpu_s: float
    events: int
    repairs: int = 0  # fixed mode: pipelines restarted with spares (or formed anew)
    mean_detection_s: float = 0.0  # fixed mode: from a member's death to its pipeline's break, mean over repairs
    mean_repair_s: float = 0.0  # fixed mode: from a pipeline's break to its restart, mean over repairs
