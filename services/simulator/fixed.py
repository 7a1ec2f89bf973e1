"""The baseline: fixed pipelines that repair themselves with spares.

Fixed pipelines recover as the best such systems do (Bamboo's and Oobleck's
reconfiguration, torchft-style recovery from a live peer); as simulated here:

- **pipelines**: the peers at the start are cut into pipelines of one replica per stage,
  in the order they come (random regions and GPUs: a scheduler that does not look at the
  network); each pipeline has its own trainer keeping ``microbatches_in_flight /
  pipelines`` microbatches in it; its route is fixed: no rerouting, no rebalancing;
- **spares**: the peers left over at the start, every peer that joins, and the survivors of
  a dissolved pipeline wait idle;
- **detection**: a pipeline breaks at the first failed hop to a dead member
  (``dead_peer_timeout_s`` after the request) or at the member's lease expiry
  (``lease_s``), whichever comes first. Every microbatch in flight on it is lost and
  counted (lost microbatches; their compute, and the ops its members were computing, as
  lost work); the members that were dead by then are found at the rendezvous;
- **repair**: each vacant stage gets the spare with the cheapest per-microbatch time there
  (its compute plus the hops to the pipeline's members on either side); the pipeline
  restarts after ``repair_delay_s`` (processes and the pipeline's communicator restarted)
  plus the slowest newcomer's download of its stage's state from the stage's nearest live
  replica, at that link's bandwidth. A member that died meanwhile is found at the restart,
  and the repair starts over;
- **no spare**: the pipeline waits, its survivors allocated and idle. Broken pipelines are
  served fewest vacancies first; when the spares complete none of them but the survivors
  of another would, the one with the fewest survivors is dissolved into spares (Oobleck
  re-forms pipelines from survivors); an empty pipeline is staffed like a broken one, and
  when no pipeline waits and ``num_stages`` spares are idle a new pipeline, with a new
  trainer, is formed from them.

The coordinator learns of a join at once (it is never later than SWARM's registry refresh).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shared.topology.network import Network

from .records import MicrobatchTrip, Report, SimConfig, SimPeer, StageCost
from .sim import Simulation


@dataclass(eq=False)  # one pipeline is itself only: found in the list by identity
class Pipeline:
    """One pipeline: a peer per stage (``None``: vacant) and the trips of its trainer."""

    members: list[str | None]
    state: str = "running"  # running | broken (waits for spares) | repairing
    epoch: int = 0  # bumped at every restart: a stale restart event is ignored
    failed_at: float = 0.0  # its first member's death (or when it was formed)
    broken_at: float = 0.0  # when the failure was detected
    trips: dict[MicrobatchTrip, None] = field(default_factory=dict)  # in flight, in order
    newcomers: list[tuple[int, str]] = field(default_factory=list)  # (stage, peer) since it broke
    completed: int = 0  # microbatches

    def vacancies(self) -> list[int]:
        return [stage for stage, pid in enumerate(self.members) if pid is None]

    def survivors(self) -> list[str]:
        return [pid for pid in self.members if pid is not None]


@dataclass(frozen=True)
class Repair:
    """A pipeline serving again: a member died at ``failed_at``, detected at ``broken_at``
    (both when the pipeline was formed, for a new one), restarted at ``restarted_at``."""

    pipeline: int
    failed_at: float
    broken_at: float
    restarted_at: float
    newcomers: tuple[tuple[int, str], ...]  # (stage, peer) filled by spares


class FixedPipelineSimulation(Simulation):
    """Fixed pipelines with spares (see the module): :meth:`run` returns the :class:`Report`;
    ``pipelines`` and ``repairs`` show what happened."""

    MODE = "fixed"
    REBALANCES = False

    def __init__(self, config: SimConfig, network: Network | None = None, stage_cost: StageCost | None = None):
        super().__init__(config, network, stage_cost)
        self.pipelines: list[Pipeline] = []  # pipeline i is trainer i's
        self.spares: list[str] = []  # idle peers the coordinator knows alive
        self.member_of: dict[str, int] = {}  # peer -> its pipeline
        self.repairs: list[Repair] = []
        self.dissolved = 0

    # --- set-up: pipelines in the order peers come -----------------------------------------
    def _place_initial(self) -> int:
        stages = self.cfg.num_stages
        order = list(self.peers.values())
        whole = len(order) // stages * stages
        for first in range(0, whole, stages):
            members = order[first : first + stages]
            for stage, peer in enumerate(members):
                self._serve(peer, stage)
            self._add_pipeline(Pipeline([peer.peer.peer_id for peer in members]))
        self.spares = [peer.peer.peer_id for peer in order[whole:]]
        return len(self.pipelines)

    def _add_pipeline(self, pipeline: Pipeline) -> int:
        index = len(self.pipelines)
        self.pipelines.append(pipeline)
        for pid in pipeline.survivors():
            self.member_of[pid] = index
        return index

    def _start_trainer(self, trainer: int) -> None:
        """A trainer knows only its pipeline's members."""
        pipeline = self.pipelines[trainer]
        for stage, pid in enumerate(pipeline.members):
            self.balancers[trainer].set_replicas(stage, [pid])
        for _ in range(self.per_trainer):
            self._start_microbatch(trainer)

    def _route_view(self, stage: int, urls: list[str]) -> None:
        pass  # routes are fixed: trainers never learn the registry

    # --- the data plane: a trip belongs to its pipeline ---------------------------------------
    def _start_microbatch(self, trainer: int) -> None:
        mb = MicrobatchTrip(trainer)
        self.pipelines[trainer].trips[mb] = None
        self._dispatch(mb)

    def _completed(self, mb: MicrobatchTrip) -> None:
        pipeline = self.pipelines[mb.trainer]
        del pipeline.trips[mb]
        pipeline.completed += 1
        super()._completed(mb)

    def _failed(self, mb: MicrobatchTrip, url: str) -> None:
        """A failed hop (only a dead member fails one) breaks the pipeline: no rerouting."""
        if mb.cancelled:
            return
        self.stats["failed"] += 1
        self._break(self.pipelines[mb.trainer])

    # --- failures and joins ----------------------------------------------------------------------
    def _lease_expired(self, pid: str) -> None:
        super()._lease_expired(pid)
        if pid in self.spares:
            self.spares.remove(pid)
            return
        index = self.member_of.get(pid)
        if index is None:
            return
        pipeline = self.pipelines[index]
        if pipeline.state == "running":
            self._break(pipeline)
        elif pipeline.state == "broken":  # a survivor died while it waited
            self._vacate(pipeline)
            self._repair()
        # repairing: the restart finds it

    def _welcome(self, peer: SimPeer) -> None:
        peer.state = "idle"
        self.spares.append(peer.peer.peer_id)
        self._repair()

    def _break(self, pipeline: Pipeline) -> None:
        """Stop the pipeline: its work in flight is lost, its dead members leave."""
        if pipeline.state != "running":
            return
        pipeline.state, pipeline.broken_at = "broken", self.now
        pipeline.failed_at = min((self.peers[pid].died_at for pid in pipeline.survivors()), default=self.now)
        for mb in pipeline.trips:
            mb.cancelled = True
            self.stats["lost_mb"] += 1
            self.stats["lost_s"] += mb.compute_s
        pipeline.trips.clear()
        for pid in pipeline.survivors():
            peer = self.peers[pid]
            for start, end in peer.queued:  # the op in progress is thrown away
                if start <= self.now < end:
                    self.stats["lost_s"] += self.now - start
            peer.queued.clear()
            peer.busy_until = self.now
        self._vacate(pipeline)
        self._repair()

    def _vacate(self, pipeline: Pipeline) -> None:
        for stage, pid in enumerate(pipeline.members):
            if pid is not None and self.peers[pid].state == "dead":
                pipeline.members[stage] = None
                del self.member_of[pid]

    # --- the coordinator: spares to broken pipelines ---------------------------------------------
    def _repair(self) -> None:
        """Restart every broken pipeline the spares can complete, fewest vacancies first;
        dissolve a pipeline when its survivors complete another; form new pipelines."""
        while True:
            waiting = sorted(
                (p for p in self.pipelines if p.state == "broken"), key=lambda p: (len(p.vacancies()), p.broken_at)
            )
            fixable = next((p for p in waiting if len(p.vacancies()) <= len(self.spares)), None)
            if fixable is not None:
                self._restart(fixable)
            elif len(self.spares) >= self.cfg.num_stages:  # nobody waits: a new pipeline
                empty = Pipeline([None] * self.cfg.num_stages, "broken", failed_at=self.now, broken_at=self.now)
                index = self._add_pipeline(empty)
                assert self._new_trainer() == index, "pipeline i is trainer i's"
            elif not self._dissolve_one(waiting):
                return

    def _dissolve_one(self, waiting: list[Pipeline]) -> bool:
        """Dissolve the waiting pipeline with the fewest survivors if they and the spares
        complete the one with the fewest vacancies."""
        staffed = [p for p in waiting if p.survivors()]
        if len(staffed) < 2:
            return False
        victim = min(staffed, key=lambda p: (len(p.survivors()), -p.broken_at))
        target = min((p for p in waiting if p is not victim), key=lambda p: len(p.vacancies()))
        if len(self.spares) + len(victim.survivors()) < len(target.vacancies()):
            return False
        for stage, pid in enumerate(victim.members):
            if pid is not None:
                peer = self.peers[pid]
                self._stop_serving(peer)
                peer.state = "idle"
                self.dirty.add(stage)
                self.spares.append(pid)
                del self.member_of[pid]
                victim.members[stage] = None
        self.dissolved += 1
        return True

    def _restart(self, pipeline: Pipeline) -> None:
        """Fill every vacancy with a spare; the pipeline serves after the repair delay and the
        newcomers' state downloads."""
        index = self.pipelines.index(pipeline)
        download_s = 0.0
        for stage in pipeline.vacancies():
            pid = self._best_spare(pipeline, stage)
            self.spares.remove(pid)
            pipeline.members[stage] = pid
            self.member_of[pid] = index
            pipeline.newcomers.append((stage, pid))
            peer = self.peers[pid]
            if peer.stage != stage:  # a survivor back at its stage still holds the state
                download_s = max(download_s, self._download_s(peer, stage))
            peer.state, peer.stage = "joining", stage
        pipeline.state = "repairing"
        pipeline.epoch += 1
        self.at(self.now + self.cfg.repair_delay_s + download_s, self._restarted, index, pipeline.epoch)

    def _best_spare(self, pipeline: Pipeline, stage: int) -> str:
        """A spare that holds the stage's state (a survivor of a dissolved pipeline) if any,
        then the least compute plus hop time per microbatch at ``stage``."""
        nbytes = self.stage_cost.activation_bytes_per_sample * self.cfg.microbatch
        neighbours = [
            self.peers[pid].region
            for s in (stage - 1, stage + 1)
            if 0 <= s < self.cfg.num_stages and (pid := pipeline.members[s]) is not None
        ]

        def seconds(pid: str) -> float:
            peer = self.peers[pid]
            hops = sum(self.rtt_s[peer.region, r] + nbytes / self.bytes_s[peer.region, r] for r in neighbours)
            return hops + self.cfg.microbatch / peer.peer.throughput

        return min(self.spares, key=lambda pid: (self.peers[pid].stage != stage, seconds(pid)))

    def _restarted(self, index: int, epoch: int) -> None:
        pipeline = self.pipelines[index]
        if pipeline.epoch != epoch or pipeline.state != "repairing":
            return
        pipeline.state = "broken"
        if any(self.peers[pid].state == "dead" for pid in pipeline.survivors()):  # found at the rendezvous
            self._vacate(pipeline)
            self._repair()
            return
        newcomers = tuple((stage, pid) for stage, pid in pipeline.newcomers if pipeline.members[stage] == pid)
        for stage, pid in newcomers:
            self._serve(self.peers[pid], stage)
        pipeline.state, pipeline.newcomers = "running", []
        self.repairs.append(Repair(index, pipeline.failed_at, pipeline.broken_at, self.now, newcomers))
        self._start_trainer(index)

    def _report(self, wall_s: float, cpu_s: float) -> Report:
        report = super()._report(wall_s, cpu_s)
        if not self.repairs:
            return report
        n = len(self.repairs)
        return dataclasses.replace(
            report,
            repairs=n,
            mean_detection_s=sum(r.broken_at - r.failed_at for r in self.repairs) / n,
            mean_repair_s=sum(r.restarted_at - r.broken_at for r in self.repairs) / n,
        )
