"""What the policy decides on: the swarm as one process sees it at one moment.

A :class:`SwarmView` is plain data: the stages, the replicas serving them with what they
report (throughput, queue length), the stages handed to joiners that have not registered
yet, and, when placement plans with the network, the topology planner's inputs. The
coordinator builds it from its registry, the simulator from its peers; every rule of the
policy reads it. Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.policy.resilience import JoinChoice, join_stage, standby_stage
from shared.policy.throughput import weakest

if TYPE_CHECKING:  # annotations only: shared.topology's planner imports shared.policy.move
    from shared.topology import Network, Peer, Workload


@dataclass(frozen=True)
class Replica:
    """A server serving ``stage``: ``throughput`` in samples per second as it reports it
    (0: not measured yet), ``queue_length`` requests waiting on it, ``speed`` the compute
    rate it declared as it joined (FLOP/s its process got; 0: none declared), ``link_mbit``
    the link rate it declared (Mbit/s; 0: none)."""

    server_id: str
    stage: int
    throughput: float
    queue_length: int = 0
    speed: float = 0.0
    link_mbit: float = 0.0


@dataclass(frozen=True)
class PlacementInputs:
    """The topology planner's inputs: every peer (region, throughput), the network between
    them, the workload, and the stage of every peer that has one."""

    peers: list[Peer]
    network: Network
    workload: Workload
    current: dict[str, int]


@dataclass(frozen=True)
class SwarmView:
    """The swarm: ``num_stages`` stages, the ``replicas`` serving them, the stages of
    ``pending`` joins (handed to a server that has not registered yet: each counts as one
    replica at the replicas' mean throughput) with the speeds they declared
    (``pending_speeds``, in the same order; absent: none declared) and links
    (``pending_links``, Mbit/s, likewise), and ``topology``, the planner's inputs when
    placement plans with the network (``None``: placement balances throughput).

    Raises ``ValueError`` when ``num_stages < 1`` or a stage is outside ``[0, num_stages)``.
    """

    num_stages: int
    replicas: tuple[Replica, ...] = ()
    pending: tuple[int, ...] = ()
    topology: PlacementInputs | None = None
    pending_speeds: tuple[float, ...] = ()
    pending_links: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        for r in self.replicas:
            if not 0 <= r.stage < self.num_stages:
                raise ValueError(
                    f"replica {r.server_id!r} is on stage {r.stage}, outside [0, {self.num_stages}) (num_stages)"
                )
        for stage in self.pending:
            if not 0 <= stage < self.num_stages:
                raise ValueError(f"a pending join of stage {stage} is outside [0, {self.num_stages}) (num_stages)")
        if self.pending_speeds and len(self.pending_speeds) != len(self.pending):
            raise ValueError(f"{len(self.pending_speeds)} pending speeds for {len(self.pending)} pending joins")
        if self.pending_links and len(self.pending_links) != len(self.pending):
            raise ValueError(f"{len(self.pending_links)} pending links for {len(self.pending)} pending joins")

    @classmethod
    def of(
        cls,
        servers: Iterable,
        num_stages: int,
        *,
        pending: Iterable[int] = (),
        topology: PlacementInputs | None = None,
        speeds: Mapping[str, float] | None = None,
        pending_speeds: Iterable[float] = (),
        links: Mapping[str, float] | None = None,
        pending_links: Iterable[float] = (),
    ) -> SwarmView:
        """The view of ``servers``: objects with ``server_id``, ``stage``, ``throughput`` and
        ``queue_length`` (the registry's ``RegisteredServer``), the speeds and links they
        declared by id (``speeds``, ``links``) and the pending joins' (``pending_speeds``,
        ``pending_links``)."""
        speeds, links = speeds or {}, links or {}
        replicas = tuple(
            Replica(
                s.server_id,
                s.stage,
                s.throughput,
                s.queue_length,
                speeds.get(s.server_id, 0.0),
                links.get(s.server_id, 0.0),
            )
            for s in servers
        )
        return cls(num_stages, replicas, tuple(pending), topology, tuple(pending_speeds), tuple(pending_links))

    def throughputs(self) -> dict[str, tuple[int, float]]:
        """``{server_id: (stage, throughput)}``: the throughput rule's input."""
        return {r.server_id: (r.stage, r.throughput) for r in self.replicas}

    def members(self) -> list[list[float]]:
        """Per stage, the throughputs of its replicas, then one per pending join at the replicas' mean."""
        mean = sum(r.throughput for r in self.replicas) / len(self.replicas) if self.replicas else 0.0
        return self._per_stage([r.throughput for r in self.replicas], [mean] * len(self.pending))

    def join_members(self) -> tuple[list[list[float]], str]:
        """What a join is placed by: per stage, its replicas' declared speeds and its pending
        joins' where every replica and pending join declared one; else :meth:`members`. As a
        swarm forms no server has served yet, so every throughput reads 0 and says nothing of
        which stage is weak; the speeds the joiners measured as they joined do (a peer capped at
        a quarter of another's CPU declares about a quarter of its speed). With the unit they count in."""
        declared = [r.speed for r in self.replicas] + list(self.pending_speeds)
        if len(self.pending_speeds) != len(self.pending) or not declared or not all(v > 0 for v in declared):
            return self.members(), "samples/s"
        return self._per_stage([r.speed for r in self.replicas], self.pending_speeds), "FLOP/s declared"

    def replica_speeds(self) -> tuple[dict[str, float], str] | None:
        """``({server_id: speed}, unit)`` of the replicas (pending joins aside): their declared
        compute speeds where every replica declared one (static: no feedback from the routing
        that placement changes), else their measured throughputs where every replica measured
        one; else None (also without replicas)."""
        if not self.replicas:
            return None
        if all(r.speed > 0 for r in self.replicas):
            return {r.server_id: r.speed for r in self.replicas}, "FLOP/s declared"
        if all(r.throughput > 0 for r in self.replicas):
            return {r.server_id: r.throughput for r in self.replicas}, "samples/s"
        return None

    def _per_stage(self, of_replicas: Iterable[float], of_pending: Iterable[float]) -> list[list[float]]:
        """Per stage, the replicas' values (in the replicas' order), then the pending joins'."""
        members: list[list[float]] = [[] for _ in range(self.num_stages)]
        for r, value in zip(self.replicas, of_replicas):
            members[r.stage].append(value)
        for stage, value in zip(self.pending, of_pending):
            members[stage].append(value)
        return members

    def capacities(self) -> list[float]:
        """Per stage, the sum of its replicas' throughputs, pending joins counted at the replicas' mean."""
        return [sum(m) for m in self.members()]

    def replica_counts(self) -> list[int]:
        """Per stage, its replicas, pending joins included."""
        counts = [0] * self.num_stages
        for stage in [r.stage for r in self.replicas] + list(self.pending):
            counts[stage] += 1
        return counts

    def queue_lengths(self) -> list[int]:
        """Per stage, the sum of its replicas' queue lengths."""
        queued = [0] * self.num_stages
        for r in self.replicas:
            queued[r.stage] += r.queue_length
        return queued

    def weakest_stage(self) -> int:
        """The stage the swarm waits on (:func:`~shared.policy.throughput.weakest`)."""
        stage = weakest(self.capacities(), self.replica_counts())
        assert stage is not None, "a view has at least one stage"
        return stage

    def declared_links(self) -> list[float]:
        """Every replica's and pending join's declared link (Mbit/s; 0: none declared, and
        pending joins count 0 where they declared none)."""
        pending = self.pending_links or (0.0,) * len(self.pending)
        return [r.link_mbit for r in self.replicas] + list(pending)

    def join_stage(self, link_mbit: float = 0.0) -> JoinChoice:
        """Where a new server goes: where a loss would hurt most, a slow link (``link_mbit``,
        the joiner's declared link) where the stage has most to spare
        (:func:`~shared.policy.resilience.join_stage`)."""
        return join_stage(*self.join_members(), link_mbit=link_mbit, links=[*self.declared_links(), link_mbit])

    def standby_stage(self) -> JoinChoice | None:
        """Where a standby server goes now, if anywhere (:func:`~shared.policy.resilience.standby_stage`)."""
        return standby_stage(*self.join_members())
