"""The one entry point of the placement policy: :meth:`RebalancingPolicy.check`, a
:class:`~shared.policy.view.SwarmView` in, the moves to order now out.

The coordinator's rebalancing loop and the simulator call it on every rebalancing
period; what it returns is what they order. Pure logic, no I/O (a topology check may
take its time budget: run it off an event loop).
"""

from __future__ import annotations

from shared.policy.move import Move
from shared.policy.throughput import ThroughputRebalancer
from shared.policy.topology import TopologyRebalancer, split_moves
from shared.policy.view import SwarmView
from shared.topology.planner import Replan


class RebalancingPolicy:
    """Decides which servers change stage, from one view after another.

    A view without topology inputs goes to the ``throughput`` rule (the single move that
    raises the weakest stage's capacity most, if its gain is large enough); a view with
    them goes to the ``topology`` rule (a replan with the network cost model), except while
    a replica has not measured its throughput yet (the check waits for it and counts as no
    check). Both rules confirm their moves on consecutive checks, each with its own count,
    and no stage is ever emptied: moves that would empty one are left for a later check.
    """

    def __init__(self, throughput: ThroughputRebalancer | None = None, topology: TopologyRebalancer | None = None):
        self.throughput = throughput if throughput is not None else ThroughputRebalancer()
        self.topology = topology
        self.replan: Replan | None = None  # the topology replan the latest check ordered (its predicted costs)
        self.deferred: list[Move] = []  # moves of that replan left for a later check (they would empty a stage)

    def check(self, view: SwarmView) -> list[Move]:
        """The moves to order now, in order (often none).

        Raises ``ValueError`` for a view with topology inputs when this policy has no
        topology rule (and whatever the planner raises on inputs it cannot work with).
        """
        self.replan, self.deferred = None, []
        if view.topology is None:
            move = self.throughput.check(view.throughputs(), view.num_stages)
            return [] if move is None else [move]
        if self.topology is None:
            raise ValueError("the view has topology inputs but the policy has no topology rule (topology=...)")
        if any(r.throughput <= 0 for r in view.replicas):
            return []  # a server that has not measured its speed yet: wait for it
        replan = self.topology.check(view.topology, view.num_stages)
        if replan is None:
            return []
        now, self.deferred = split_moves(view.topology.current, replan.moves)
        self.replan = replan
        return now
