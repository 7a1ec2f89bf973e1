"""The topology rule: replans with the network cost model (:mod:`shared.topology`),
confirmed on consecutive checks, and ordered so that no stage is ever emptied.

Pure logic, no I/O; a check may take its time budget (seconds), so callers on an event
loop run it in a thread.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from shared.policy.hysteresis import Confirmation
from shared.policy.move import Move
from shared.policy.view import PlacementInputs
from shared.topology.planner import Replan, placement_cost, replan

REBALANCE_EVALUATIONS = 40_000  # placements a rebalancing check may evaluate (it also has a time budget)...
EVALUATIONS_PER_SERVER = 2_000  # ...and no more than this many per server: a small swarm is planned in milliseconds


def split_moves(current: Mapping[str, int], moves: Sequence[Move]) -> tuple[list[Move], list[Move]]:
    """(moves to order now, moves to leave for a later check): a server leaves its stage
    now only if the stage keeps a member that is not leaving now, so no stage is ever
    emptied while servers are between stages (and joiners of it can download its state)."""
    members = Counter(current.values())
    leaving: Counter = Counter()
    now, later = [], []
    for move in moves:
        if members[move.from_stage] - leaving[move.from_stage] > 1:
            leaving[move.from_stage] += 1
            now.append(move)
        else:
            later.append(move)
    return now, later


class TopologyRebalancer:
    """Replans with the network cost model and orders the moves only once a replan has
    found a placement at least ``min_gain`` cheaper on ``confirmations`` consecutive
    checks (each replan ignores gains below ``min_gain``: measurement noise moves
    nothing), moving at most ``max_moves_fraction`` of the servers (at least one).

    Each check searches with a seed of its own, so the confirming checks are independent
    searches: of their replans from the same assignment, the one cheapest under the
    latest measurements is ordered (an unlucky search is neither repeated nor final)."""

    def __init__(
        self,
        *,
        min_gain: float,
        max_moves_fraction: float,
        time_budget_s: float,
        confirmations: int = 2,
        max_evaluations: float = REBALANCE_EVALUATIONS,
        seed: int = 0,
    ):
        self.min_gain, self.max_moves_fraction, self.time_budget_s = min_gain, max_moves_fraction, time_budget_s
        self.max_evaluations, self.seed = max_evaluations, seed
        self.checks = 0  # replans so far: the next one's seed is seed + checks
        self.last: Replan | None = None  # the latest replan, confirmed or not
        # (assignment it started from, replan) of the unconfirmed checks that found moves
        self._confirmation: Confirmation[tuple[dict[str, int], Replan]] = Confirmation(confirmations)

    @property
    def confirmations(self) -> int:
        return self._confirmation.confirmations

    @property
    def seen(self) -> int:
        """Consecutive checks so far that found moves worth making, not yet confirmed."""
        return self._confirmation.seen

    def check(self, inputs: PlacementInputs, num_stages: int) -> Replan | None:
        """Replan from the current assignment; the replan to carry out now, or None."""
        if len(inputs.current) < 2 or len(inputs.peers) != len(inputs.current):
            self.last = None  # nothing to move, or servers without a stage (not planned here)
            self._confirmation.reset()
            return None
        max_moves = max(1, math.floor(self.max_moves_fraction * len(inputs.current)))
        self.last = replan(
            inputs.current,
            inputs.peers,
            inputs.network,
            inputs.workload,
            num_stages,
            min_gain=self.min_gain,
            max_moves=max_moves,
            time_budget_s=self.time_budget_s,
            seed=self.seed + self.checks,
            max_evaluations=min(self.max_evaluations, EVALUATIONS_PER_SERVER * len(inputs.peers)),
        )
        self.checks += 1
        streak = self._confirmation.observe((dict(inputs.current), self.last) if self.last.moves else None)
        if streak is None:
            return None
        best = self.last
        for start, earlier in streak[:-1]:
            if start != inputs.current:
                continue  # planned from an assignment that has changed since
            cost = placement_cost(earlier.assignment, inputs.peers, inputs.network, inputs.workload, num_stages)
            if cost < best.cost_after_s:
                best = Replan(earlier.assignment, earlier.moves, earlier.joined, self.last.cost_before_s, cost)
        self.last = best
        return best
