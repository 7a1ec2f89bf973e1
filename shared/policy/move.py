"""The one record of a placement decision: a server leaving its stage for another.

A leaf module (standard library only): the topology planner (:mod:`shared.topology`)
emits these moves too, so it must not import anything that imports the planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Move:
    """Server ``server_id`` leaves ``from_stage`` for ``to_stage`` (and downloads that stage's state).

    ``capacity_before`` and ``capacity_after`` are the swarm's minimum stage capacity
    before and after the move when the throughput or resilience rule planned it; ``None`` for
    a move of a topology replan, whose figures are the replan's predicted step times.
    ``reason`` says why, in words, for the log and the dashboard (not part of equality).
    """

    server_id: str
    from_stage: int
    to_stage: int
    capacity_before: float | None = None
    capacity_after: float | None = None
    reason: str = field(default="", compare=False)

    @property
    def gain(self) -> float:
        """``capacity_after / capacity_before``; ``inf`` when before is 0 and after > 0 (1.0 when both are 0).

        Raises ``ValueError`` for a move without capacities (a topology move).
        """
        if self.capacity_before is None or self.capacity_after is None:
            raise ValueError(f"{self} has no capacities: only the throughput rule's moves have a gain")
        if self.capacity_before == 0:
            return math.inf if self.capacity_after > 0 else 1.0
        return self.capacity_after / self.capacity_before

    def same_as(self, other: Move) -> bool:
        """Whether both move the same server between the same stages (capacities aside)."""
        return (self.server_id, self.from_stage, self.to_stage) == (other.server_id, other.from_stage, other.to_stage)
