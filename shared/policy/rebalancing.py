"""The one entry point of the placement policy: :meth:`RebalancingPolicy.check`, a
:class:`~shared.policy.view.SwarmView` in, the moves to order now out.

The coordinator's rebalancing loop and the simulator call it on every rebalancing
period; what it returns is what they order. Pure logic, no I/O (a topology check may
take its time budget: run it off an event loop).
"""

from __future__ import annotations

import dataclasses

from shared.policy.hysteresis import Confirmation
from shared.policy.links import link_exchange
from shared.policy.move import Move
from shared.policy.resilience import SAFE_REPLICAS, repair_move, replica_floor, thinned_stage
from shared.policy.throughput import ThroughputRebalancer
from shared.policy.topology import TopologyRebalancer, split_moves
from shared.policy.view import SwarmView
from shared.topology.planner import Replan


class RebalancingPolicy:
    """Decides which servers change stage, from one view after another.

    First the ``resilience`` rule (:mod:`shared.policy.resilience`): a stage with fewer
    replicas than the swarm can give it (none; or one while the swarm has two servers a
    stage) gets one from a stage with spare, and the other rules wait meanwhile. Then the
    ``links`` rule (:mod:`shared.policy.links`): a replica on a slow link in the weakest
    stage changes places with one of about its speed on a fast link (on its first check: the
    speeds and links it reads are declared, not measured; ``in_turn`` is then True: the
    second move is to be ordered once the first one's server serves at its new stage). Else a view
    without topology inputs goes to the ``throughput`` rule (the single move that raises the
    weakest stage's capacity most, if its gain is large enough; else the exchange of two
    replicas that does, where every stage is at its replica floor); a view with them goes to
    the ``topology`` rule (a replan with the network cost model), except while a replica
    has not measured its throughput yet (the check waits for it and counts as no check);
    a replan held because it would leave a stage short (see below) gives way to the
    throughput rule's exchange of two replicas, if one qualifies (the planner does not
    search under the replica floor, so with two servers a stage it would never move).
    Every rule confirms its moves on consecutive checks, each with its own count. No stage
    is ever emptied (moves that would empty one are left for a later check), and while the
    swarm has two servers a stage no move leaves a stage with one replica
    (:func:`~shared.policy.resilience.replica_floor`): a replan that would is not ordered.
    ``held`` says, after a check, why a move that a rule wanted was not ordered (else ``None``).
    """

    def __init__(
        self,
        throughput: ThroughputRebalancer | None = None,
        topology: TopologyRebalancer | None = None,
        repair_confirmations: int = 2,
    ):
        self.throughput = throughput if throughput is not None else ThroughputRebalancer()
        self.topology = topology
        self.replan: Replan | None = None  # the topology replan the latest check ordered (its predicted costs)
        self.deferred: list[Move] = []  # moves of that replan left for a later check (they would empty a stage)
        self.held: str | None = None
        self.in_turn = False  # the latest check's moves are to be ordered one after another (a link exchange)
        # a repair counts as the same while it strengthens the same stage (the replica it takes may change)
        self._repair: Confirmation[Move] = Confirmation(repair_confirmations, lambda a, b: a.to_stage == b.to_stage)

    def check(self, view: SwarmView) -> list[Move]:
        """The moves to order now, in order (often none).

        Raises ``ValueError`` for a view with topology inputs when this policy has no
        topology rule (and whatever the planner raises on inputs it cannot work with).
        """
        self.replan, self.deferred, self.held, self.in_turn = None, [], None, False
        repair = repair_move(view.members(), view.throughputs())
        confirmed = self._repair.observe(repair)
        if repair is not None:
            return [] if confirmed is None else [confirmed[-1]]
        exchange = link_exchange(view)
        if exchange is not None:
            self.throughput.reset()
            self.in_turn = True
            return list(exchange)
        if view.topology is None:
            moves = self.throughput.check(view.throughputs(), view.num_stages)
            if self.throughput.held is not None:
                held = self.throughput.held
                self.held = (
                    f"not moving {held.server_id} to stage {held.to_stage}: {self._thins(view, held.from_stage)}"
                )
            return moves
        if self.topology is None:
            raise ValueError("the view has topology inputs but the policy has no topology rule (topology=...)")
        if any(r.throughput <= 0 for r in view.replicas):
            return []  # a server that has not measured its speed yet: wait for it
        if len(view.replicas) < view.num_stages:  # the planner fills every stage: not with fewer servers
            self.held = f"not replanning: {len(view.replicas)} servers cannot fill {view.num_stages} stages"
            return []
        replan = self.topology.check(view.topology, view.num_stages)
        thinned = None if replan is None else thinned_stage(view.topology.current, replan.moves, view.num_stages)
        if thinned is None:
            self.throughput.reset()  # its exchanges are confirmed on consecutive held replans only
        if replan is None:
            return []
        if thinned is not None:
            # the planner would leave a stage short; an exchange of two replicas keeps every count
            exchange = self.throughput.check(view.throughputs(), view.num_stages)
            instead = {0: "", 1: "; moving one replica by throughput instead", 2: "; exchanging two replicas instead"}
            self.held = f"not replanning: {self._thins(view, thinned)}{instead[len(exchange)]}"
            return exchange
        reason = f"the network cost model predicts {replan.cost_before_s:.3g} -> {replan.cost_after_s:.3g} s per step"
        now, self.deferred = split_moves(
            view.topology.current, [dataclasses.replace(m, reason=reason) for m in replan.moves]
        )
        self.replan = replan
        return now

    @staticmethod
    def _thins(view: SwarmView, stage: int) -> str:
        if replica_floor(len(view.replicas), view.num_stages) >= SAFE_REPLICAS:
            return f"stage {stage} would keep fewer than {SAFE_REPLICAS} replicas, and the swarm has that many a stage"
        return f"stage {stage} would keep no replica"
