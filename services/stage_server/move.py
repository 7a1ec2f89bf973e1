"""A stage server's move to another stage, ordered by the coordinator with ``POST /move``.

The server leaves its stage and starts again, in the same process and at the same
address, as a server of the new stage:

1. ``POST /move`` (``routes.move``) checks the order, records it with
   :meth:`MoveOrder.order` and answers at once.
2. The server's main loop (``__main__.serve``), waiting in :meth:`MoveOrder.wait`, wakes
   up and shuts the app down exactly as on SIGTERM: it answers 503 to new work, ends a step
   round under way, deregisters from the coordinator and finishes the requests it accepted
   (``app.leave``), then stops listening and stops its background tasks.
3. The loop builds the app again for the new stage and starts it: the app joins by
   downloading the new stage's weights and optimizer state from a live replica
   (``app._join``), listens again and registers under a new server id
   (``membership.Membership``).
"""

from __future__ import annotations

import asyncio


class MoveOrder:
    """The coordinator's order to serve another stage; at most one per app (the first wins)."""

    def __init__(self) -> None:
        self.to_stage: int | None = None
        self._ordered = asyncio.Event()

    def order(self, to_stage: int) -> int:
        """Record the move to ``to_stage`` and wake :meth:`wait`; the stage this server moves
        to (the first order's: a repeated or conflicting order changes nothing)."""
        if self.to_stage is None:
            self.to_stage = to_stage
            self._ordered.set()
        return self.to_stage

    async def wait(self) -> int:
        """Until a move is ordered: the stage to move to."""
        await self._ordered.wait()
        assert self.to_stage is not None, "a move is ordered only with its stage"
        return self.to_stage
