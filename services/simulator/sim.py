"""A discrete-event simulation of a swarm: many peers across regions, preemption, joins.

What is simulated, and with which code:

- **peers**: a region (latency/bandwidth from :mod:`shared.topology.network`) and a GPU
  class (samples per second through one stage); each serves one stage, computes its
  requests one at a time in arrival order (the stage server's compute worker) and sends
  over one uplink at a time;
- **trainers**: each keeps microbatches in flight and picks the replica of every hop
  with its own :class:`shared.wiring.ReplicaBalancer`, the trainer's real
  stochastic wiring (its clock is the simulation's), reporting successes and failures
  to it, retrying a failed hop on another replica; activations go from the server of
  one stage to the server of the next, gradients back (the hand-off of SWARM and DT-FM);
- **coordinator**: a registry that sees a dead peer only when its lease expires and
  publishes its view to trainers every ``registry_refresh_s``; places joiners with
  :func:`shared.topology.planner.place_joiners`; every ``rebalance_every_s`` asks the
  coordinator's placement policy (:meth:`shared.policy.rebalancing.RebalancingPolicy.check`
  on its :class:`~shared.policy.view.SwarmView`, with the topology rule: moves ordered
  once confirmed on consecutive checks, never emptying a stage; a moved server drains,
  downloads its new stage's state, then serves); starts averaging rounds (each member's
  uplink is busy with its butterfly all-reduce share, which delays its activations);
- **preemption**: every peer lives an exponential time (``mean_lifetime_s``); new peers
  join as a Poisson process (``join_rate_per_s``, by default the rate that keeps the
  swarm's size steady).

``mode="swarm"`` is SWARM (this module's :class:`Simulation`); ``mode="fixed"`` is the
baseline, fixed pipelines that repair themselves with spares as Bamboo, Oobleck or
torchft-style recovery would (:class:`services.simulator.fixed.FixedPipelineSimulation`).
:func:`simulate` runs the one the config names. Simplifications (documented in
docs/topology.md): downlinks and the network core never congest; a request to a dead peer
fails after ``dead_peer_timeout_s``; the backward hop moves one activation-sized gradient.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable

import numpy as np

from shared.policy.rebalancing import RebalancingPolicy
from shared.policy.topology import TopologyRebalancer
from shared.policy.view import PlacementInputs, Replica, SwarmView
from shared.topology.cost import Workload, butterfly_time
from shared.topology.network import Network, Peer, world_network
from shared.topology.planner import place_joiners
from shared.wiring import NoReplica, ReplicaBalancer

from .records import BACKWARD_COST, MicrobatchTrip, Report, SimConfig, SimPeer, StageCost


class Simulation:
    """One run of SWARM: :meth:`run` returns the :class:`Report`. The event loop, the peers'
    compute and uplinks, preemption and averaging are shared with the fixed-pipeline
    baseline, which overrides the placement, the routing and what a join or a failure does."""

    MODE = "swarm"
    REBALANCES = True  # the coordinator replans every rebalance_every_s

    def __init__(self, config: SimConfig, network: Network | None = None, stage_cost: StageCost | None = None):
        if config.mode != self.MODE:
            raise ValueError(f"{type(self).__name__} runs mode={self.MODE!r}, got {config.mode!r}: call simulate()")
        self.cfg = config
        self.net = network or world_network()
        self.stage_cost = stage_cost or StageCost.from_preset(config.model, config.num_stages, config.wire_bytes)
        self.rng = random.Random(config.seed)
        regions = list(config.regions or self.net.regions)
        self.region_names = regions
        rtt, bw = self.net.matrices([Peer(r, r) for r in regions])  # region x region
        self.rtt_s, self.bytes_s = rtt, bw * 1e9 / 8  # seconds; bytes per second
        self.now = 0.0
        self._queue: list = []
        self._seq = 0
        self.peers: dict[str, SimPeer] = {}
        self.balancers: list[ReplicaBalancer] = []
        self.trainer_region: list[int] = []
        self.dirty: set[int] = set()  # stages whose registry view changed
        self.view: list[list[str]] = [[] for _ in range(config.num_stages)]
        self.stats = dict(
            tokens=0,
            completed=0,
            lost_mb=0,
            lost_s=0.0,
            compute_s=0.0,
            deaths=0,
            joins=0,
            moves=0,
            rounds=0,
            round_s=0.0,
            planner_s=0.0,
            events=0,
            failed=0,
        )
        self.window_tokens = [0] * config.windows
        self.stage_busy = [0.0] * config.num_stages
        self.stage_serving = [0.0] * config.num_stages
        self.workload = self._planner_workload()
        self._pending_joiners: list[str] = []
        self._started = False
        self.policy = RebalancingPolicy(
            topology=TopologyRebalancer(
                min_gain=config.rebalance_min_gain,
                max_moves_fraction=config.max_moves_fraction,
                time_budget_s=config.planner_budget_s,
                confirmations=config.rebalance_confirmations,
                max_evaluations=config.planner_evaluations,
                seed=config.seed,
            )
        )

    # --- the event queue -----------------------------------------------------------
    def at(self, when: float, handler: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, self._seq, handler, args))

    def start(self) -> None:
        """Create the peers, place them and put the first microbatches in flight (:meth:`run`
        does it if it was not done: call it first to inject faults at known peers)."""
        if not self._started:
            self._started = True
            self._start()

    def preempt_at(self, when: float, peer_id: str) -> None:
        """Fault injection: ``peer_id`` dies at ``when`` (besides its random lifetime)."""
        self.at(when, self._die, peer_id)

    def join_at(self, when: float) -> None:
        """Fault injection's counterpart: a new peer joins at ``when``."""
        self.at(when, self._join_one)

    def run(self) -> Report:
        wall, cpu = time.perf_counter(), time.process_time()
        self.start()
        while self._queue:
            when, _, handler, args = heapq.heappop(self._queue)
            if when > self.cfg.duration_s:
                break
            self.now = when
            self.stats["events"] += 1
            handler(*args)
        self.now = self.cfg.duration_s
        return self._report(time.perf_counter() - wall, time.process_time() - cpu)

    # --- set-up ----------------------------------------------------------------------
    def _new_peer(self, index: int) -> SimPeer:
        region = self.rng.randrange(len(self.region_names))
        speed = self.stage_cost.samples_per_s(self.rng.choice(self.cfg.gpu_tflops))
        peer = SimPeer(Peer(f"peer-{index}", self.region_names[region], speed), region)
        self.peers[peer.peer.peer_id] = peer
        if math.isfinite(self.cfg.mean_lifetime_s):
            self.at(self.now + self.rng.expovariate(1.0 / self.cfg.mean_lifetime_s), self._die, peer.peer.peer_id)
        return peer

    def _start(self) -> None:
        cfg = self.cfg
        for i in range(cfg.num_peers):
            self._new_peer(i)
        self._joined = cfg.num_peers
        trainers = self._place_initial()
        for _ in range(trainers):
            self._new_trainer()
        self._publish_view()
        self.per_trainer = max(1, cfg.microbatches_in_flight // trainers)
        for t in range(trainers):
            self._start_trainer(t)
        rate = cfg.join_rate_per_s
        if rate is None:
            rate = cfg.num_peers / cfg.mean_lifetime_s if math.isfinite(cfg.mean_lifetime_s) else 0.0
        if rate > 0:
            self.at(self.rng.expovariate(rate), self._join, rate)
        self.at(cfg.registry_refresh_s, self._refresh)
        self.at(cfg.average_every_s, self._average)
        if self.REBALANCES:
            self.at(cfg.rebalance_every_s, self._rebalance)

    def _place_initial(self) -> int:
        """The coordinator's first plan of every peer; returns the number of trainers."""
        from shared.topology.planner import plan

        cfg = self.cfg
        started = time.perf_counter()
        placement = plan(
            [p.peer for p in self.peers.values()],
            self.net,
            self.workload,
            cfg.num_stages,
            time_budget_s=cfg.planner_budget_s,
            max_evaluations=cfg.planner_evaluations,
            seed=cfg.seed,
        )
        self.stats["planner_s"] += time.perf_counter() - started
        for pid, stage in placement.assignment.items():
            self._serve(self.peers[pid], stage)
        return cfg.trainers

    def _new_trainer(self) -> int:
        t = len(self.balancers)
        self.trainer_region.append(self.rng.randrange(len(self.region_names)))
        self.balancers.append(
            ReplicaBalancer(
                self.cfg.num_stages,
                backward_cost=BACKWARD_COST,
                rng=random.Random(self.cfg.seed * 7919 + t),
                clock=lambda: self.now,
            )
        )
        return t

    def _start_trainer(self, trainer: int) -> None:
        for _ in range(self.per_trainer):
            self._start_microbatch(trainer)

    def _planner_workload(self) -> Workload:
        cfg, m = self.cfg, self.stage_cost
        mean_speed = sum(m.samples_per_s(t) for t in cfg.gpu_tflops) / len(cfg.gpu_tflops)
        samples_per_s = mean_speed * cfg.num_peers / cfg.num_stages
        samples_per_step = float(cfg.microbatches_in_flight * cfg.microbatch)
        steps_per_round = max(1.0, cfg.average_every_s * samples_per_s / samples_per_step)
        return Workload(samples_per_step, m.activation_bytes_per_sample / 1e9, m.state_bytes / 1e9, steps_per_round)

    # --- membership --------------------------------------------------------------------
    def _serve(self, peer: SimPeer, stage: int) -> None:
        peer.stage, peer.state, peer.serving_since = stage, "serving", self.now
        self.dirty.add(stage)

    def _stop_serving(self, peer: SimPeer) -> None:
        if peer.state in ("serving", "draining") and peer.stage >= 0:
            self.stage_serving[peer.stage] += self.now - peer.serving_since

    def _die(self, pid: str) -> None:
        peer = self.peers[pid]
        if peer.state == "dead":
            return
        self._stop_serving(peer)
        for start, end in peer.queued:  # the op in progress is lost (the queue never ran)
            if start <= self.now < end:
                self.stats["lost_s"] += self.now - start
        peer.queued.clear()
        peer.state, peer.died_at = "dead", self.now
        peer.generation += 1
        self.stats["deaths"] += 1
        self.at(self.now + self.cfg.lease_s, self._lease_expired, pid)

    def _lease_expired(self, pid: str) -> None:
        """The registry drops a peer that stopped renewing its lease."""
        if self.peers[pid].stage >= 0:
            self.dirty.add(self.peers[pid].stage)

    def _join(self, rate: float) -> None:
        self.at(self.now + self.rng.expovariate(rate), self._join, rate)
        self._join_one()

    def _join_one(self) -> None:
        peer = self._new_peer(self._joined)
        self._joined += 1
        self.stats["joins"] += 1
        self._welcome(peer)

    def _welcome(self, peer: SimPeer) -> None:
        """A new server registers; the coordinator places it at the next refresh."""
        peer.state = "joining"
        self._pending_joiners.append(peer.peer.peer_id)

    def _place_joiners(self) -> None:
        """The coordinator places the servers that registered since the last refresh."""
        joiners = [pid for pid in self._pending_joiners if self.peers[pid].state == "joining"]
        self._pending_joiners = []
        if not joiners:
            return
        current = {pid: p.stage for pid, p in self.peers.items() if p.state in ("serving", "draining")}
        peers = [self.peers[pid].peer for pid in current] + [self.peers[pid].peer for pid in joiners]
        started = time.perf_counter()
        stages = place_joiners(
            current,
            peers,
            self.net,
            self.workload,
            self.cfg.num_stages,
            seed=self.cfg.seed,
            time_budget_s=self.cfg.planner_budget_s,
            max_evaluations=self.cfg.planner_evaluations,
        )
        self.stats["planner_s"] += time.perf_counter() - started
        for pid in joiners:
            self._download_then_serve(self.peers[pid], stages[pid])

    def _download_s(self, peer: SimPeer, stage: int) -> float:
        """Seconds to fetch the stage's state from its nearest live replica in the registry's view."""
        sources = [self.peers[u].region for u in self.view[stage] if self.peers[u].state == "serving"]
        if not sources:
            return self.cfg.lease_s  # from the latest checkpoint
        return min(
            self.rtt_s[peer.region, r] + self.stage_cost.state_bytes / self.bytes_s[peer.region, r] for r in sources
        )

    def _download_then_serve(self, peer: SimPeer, stage: int) -> None:
        """Fetch the stage's state from the nearest live replica, then serve it."""
        seconds = self._download_s(peer, stage)
        peer.state, peer.stage = "joining", stage
        self.at(self.now + seconds, self._ready, peer.peer.peer_id, peer.generation, stage)

    def _ready(self, pid: str, generation: int, stage: int) -> None:
        peer = self.peers[pid]
        if peer.generation == generation and peer.state == "joining":
            self._serve(peer, stage)

    def _refresh(self) -> None:
        self.at(self.now + self.cfg.registry_refresh_s, self._refresh)
        self._place_joiners()
        self._publish_view()

    def _publish_view(self) -> None:
        """Trainers learn the registry: replicas that serve, or died less than a lease ago."""
        for stage in sorted(self.dirty):
            urls = [
                pid
                for pid, p in self.peers.items()
                if p.stage == stage
                and (p.state == "serving" or (p.state == "dead" and self.now < p.died_at + self.cfg.lease_s))
            ]
            self.view[stage] = urls
            self._route_view(stage, urls)
        self.dirty.clear()

    def _route_view(self, stage: int, urls: list[str]) -> None:
        """Every trainer's balancer learns the stage's replicas (SWARM's stochastic wiring)."""
        for balancer in self.balancers:
            balancer.set_replicas(stage, urls)

    # --- the data plane ----------------------------------------------------------------
    def _start_microbatch(self, trainer: int) -> None:
        self._dispatch(MicrobatchTrip(trainer))

    def _transfer_s(self, mb: MicrobatchTrip, peer: SimPeer, nbytes: float) -> float:
        """When the hop's input reaches ``peer``: the sender's uplink serialises its sends."""
        if mb.source is None:  # stage 0's input from the trainer: token ids, a few KB
            return self.now + self.rtt_s[self.trainer_region[mb.trainer], peer.region]
        sender = self.peers[mb.source]
        start = max(self.now, sender.uplink_free)
        sender.uplink_free = start + nbytes / self.bytes_s[sender.region, peer.region]
        return sender.uplink_free + self.rtt_s[sender.region, peer.region]

    def _dispatch(self, mb: MicrobatchTrip) -> None:
        balancer = self.balancers[mb.trainer]
        try:
            url = balancer.choose(mb.stage, kind=mb.kind, batch_size=self.cfg.microbatch, exclude=mb.tried)
        except NoReplica:
            self.at(self.now + self.cfg.registry_refresh_s, self._retry, mb)
            return
        peer = self.peers[url]
        mb.sent_at = self.now
        if peer.state == "dead":
            self.at(self.now + self.cfg.dead_peer_timeout_s, self._failed, mb, url)
            return
        nbytes = self.stage_cost.activation_bytes_per_sample * self.cfg.microbatch
        self.at(self._transfer_s(mb, peer, nbytes), self._arrive, mb, url, peer.generation)

    def _arrive(self, mb: MicrobatchTrip, url: str, generation: int) -> None:
        if mb.cancelled:
            return
        peer = self.peers[url]
        if peer.generation != generation or peer.state != "serving" or peer.stage != mb.stage:
            delay = self.cfg.dead_peer_timeout_s if peer.state == "dead" else self.rtt_s[peer.region, peer.region]
            self.at(self.now + delay, self._failed, mb, url)
            return
        seconds = self.cfg.microbatch / peer.peer.throughput / (1 + BACKWARD_COST)
        if mb.kind == "backward":
            seconds *= BACKWARD_COST
        start = max(self.now, peer.busy_until)
        peer.busy_until = start + seconds
        peer.queued.append((start, peer.busy_until))
        self.at(peer.busy_until, self._done, mb, url, generation, seconds)

    def _done(self, mb: MicrobatchTrip, url: str, generation: int, seconds: float) -> None:
        if mb.cancelled:  # its pipeline broke: the work was counted lost then
            return
        peer = self.peers[url]
        if peer.generation != generation:  # died with this op queued: its partial work counted in _die
            self.at(self.now + max(0.0, peer.died_at + self.cfg.dead_peer_timeout_s - self.now), self._failed, mb, url)
            return
        peer.queued.popleft()
        peer.busy_s += seconds
        self.stage_busy[mb.stage] += seconds
        self.stats["compute_s"] += seconds
        mb.compute_s += seconds
        self.balancers[mb.trainer].report_success(mb.stage, url, self.now - mb.sent_at, self.cfg.microbatch, mb.kind)
        mb.source, mb.attempts, mb.tried = url, 0, []
        last = self.cfg.num_stages - 1
        if mb.kind == "forward" and mb.stage < last:
            mb.stage += 1
        elif mb.kind == "forward":
            mb.kind = "backward"
        elif mb.stage > 0:
            mb.stage -= 1
        else:
            self._completed(mb)
            return
        self._dispatch(mb)

    def _completed(self, mb: MicrobatchTrip) -> None:
        tokens = self.cfg.microbatch * self.stage_cost.tokens_per_sample
        self.stats["tokens"] += tokens
        self.stats["completed"] += 1
        window = min(self.cfg.windows - 1, int(self.now / self.cfg.duration_s * self.cfg.windows))
        self.window_tokens[window] += tokens
        self._start_microbatch(mb.trainer)

    def _failed(self, mb: MicrobatchTrip, url: str) -> None:
        if mb.cancelled:
            return
        self.stats["failed"] += 1
        self.balancers[mb.trainer].report_failure(mb.stage, url)
        mb.tried.append(url)
        mb.attempts += 1
        if mb.attempts > self.cfg.max_retries:  # reported, never silently dropped: counted lost
            self.stats["lost_mb"] += 1
            self.stats["lost_s"] += mb.compute_s
            self._start_microbatch(mb.trainer)
            return
        self._dispatch(mb)

    def _retry(self, mb: MicrobatchTrip) -> None:
        if not mb.cancelled:
            self._dispatch(mb)

    # --- control plane: averaging and rebalancing ------------------------------------------
    def _average(self) -> None:
        """A butterfly all-reduce per stage: each member's uplink carries its share."""
        self.at(self.now + self.cfg.average_every_s, self._average)
        gradient_gb = self.stage_cost.state_bytes / 1e9
        for stage in range(self.cfg.num_stages):
            members = [p for p in self.peers.values() if p.stage == stage and p.state == "serving"]
            if len(members) < 2:
                continue
            regions = np.array([p.region for p in members], dtype=np.intp)
            sub = np.ix_(regions, regions)
            rtt, bw = self.rtt_s[sub], self.bytes_s[sub] * 8 / 1e9
            self.stats["rounds"] += 1
            self.stats["round_s"] += butterfly_time(rtt, bw, gradient_gb)
            k = len(members)
            with np.errstate(divide="ignore"):
                share = 2.0 * (8.0 * gradient_gb / k) / bw  # seconds on each link
            np.fill_diagonal(share, 0.0)
            busy = share.sum(axis=1)
            for peer, seconds in zip(members, busy):
                peer.uplink_free = max(peer.uplink_free, self.now) + float(seconds)

    def swarm_view(self) -> SwarmView:
        """The swarm as the coordinator's registry would show it: the serving peers, with the
        topology planner's inputs (the simulated coordinator always plans with the network)."""
        serving = [p for p in self.peers.values() if p.state == "serving"]
        current = {p.peer.peer_id: p.stage for p in serving}
        replicas = tuple(Replica(p.peer.peer_id, p.stage, p.peer.throughput) for p in serving)
        topology = PlacementInputs([p.peer for p in serving], self.net, self.workload, current)
        return SwarmView(self.cfg.num_stages, replicas, topology=topology)

    def _rebalance(self) -> None:
        """The coordinator asks its placement policy; moved servers drain first."""
        self.at(self.now + self.cfg.rebalance_every_s, self._rebalance)
        started = time.perf_counter()
        moves = self.policy.check(self.swarm_view())  # confirmed on consecutive checks, no stage emptied
        self.stats["planner_s"] += time.perf_counter() - started
        for move in moves:
            peer = self.peers[move.server_id]
            self._stop_serving(peer)
            peer.state, peer.next_stage = "draining", move.to_stage
            self.dirty.add(peer.stage)
            self.at(max(self.now, peer.busy_until), self._drained, move.server_id, peer.generation)
            self.stats["moves"] += 1

    def _drained(self, pid: str, generation: int) -> None:
        peer = self.peers[pid]
        if peer.generation != generation or peer.state != "draining":
            return
        peer.generation += 1
        self._download_then_serve(peer, peer.next_stage)

    # --- the report ----------------------------------------------------------------------
    def _report(self, wall_s: float, cpu_s: float) -> Report:
        cfg = self.cfg
        for peer in self.peers.values():
            self._stop_serving(peer)
        window_s = cfg.duration_s / cfg.windows
        total_compute = self.stats["compute_s"] + self.stats["lost_s"]
        return Report(
            mode=cfg.mode,
            peers=cfg.num_peers,
            stages=cfg.num_stages,
            duration_s=cfg.duration_s,
            tokens_per_s=self.stats["tokens"] / cfg.duration_s,
            tokens_per_s_windows=[t / window_s for t in self.window_tokens],
            stage_utilisation=[b / s if s > 0 else 0.0 for b, s in zip(self.stage_busy, self.stage_serving)],
            stage_replicas_end=[
                sum(1 for p in self.peers.values() if p.stage == s and p.state == "serving")
                for s in range(cfg.num_stages)
            ],
            lost_work_fraction=self.stats["lost_s"] / total_compute if total_compute else 0.0,
            lost_microbatches=self.stats["lost_mb"],
            completed_microbatches=self.stats["completed"],
            failed_hops=self.stats["failed"],
            deaths=self.stats["deaths"],
            joins=self.stats["joins"],
            moves=self.stats["moves"],
            averaging_rounds=self.stats["rounds"],
            mean_averaging_s=self.stats["round_s"] / self.stats["rounds"] if self.stats["rounds"] else 0.0,
            planner_s=self.stats["planner_s"],
            wall_s=wall_s,
            cpu_s=cpu_s,
            events=self.stats["events"],
        )


def simulate(config: SimConfig, network: Network | None = None) -> Report:
    """Run one simulation of the mode the config names and return its report."""
    from .fixed import FixedPipelineSimulation  # the baseline extends this module's Simulation

    kind = FixedPipelineSimulation if config.mode == FixedPipelineSimulation.MODE else Simulation
    return kind(config, network).run()
