"""ComputeWorker: the one thread that runs a stage's compute, in arrival order.

The event loop only accepts, decodes, queues and answers; everything that touches the
stage's parameters runs here, so an optimizer step never races a backward and
``/health`` stays responsive while the stage computes. The queue is bounded: past
``max_queue`` waiting jobs a caller gets :class:`Overloaded` (503 with Retry-After), and
a draining server refuses new work (:class:`Draining`). Both refuse new work only: the
jobs of a step round (take the gradient, apply the step or give the gradient back) are
the stage's own bookkeeping of work it already accepted, and run ``bounded=False``.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from shared.errors import Draining, Overloaded


class ComputeWorker:
    def __init__(self, max_queue: int, *, inject_delay_s: float = 0.0):
        self.max_queue = max_queue
        self.inject_delay_s = inject_delay_s  # fault injection: a slower device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._pending = 0
        self.busy_s = 0.0  # wall time spent on jobs (injected delay included)
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    @property
    def queue_depth(self) -> int:
        """Jobs accepted and not finished (running one included)."""
        return self._pending

    async def run(self, fn: Callable[..., Any], *args: Any, work: float = 1.0, bounded: bool = True) -> Any:
        """Run ``fn(*args)`` on the compute thread, after the jobs queued before it. ``work``
        (in forward passes) scales the injected delay: a slow device is slow in proportion
        to the work it does. ``bounded=False``: neither a full queue nor a drain refuses
        the job (it still counts in :attr:`queue_depth`, and a drain waits for it)."""
        if bounded and self.draining:
            raise Draining("server is draining; send new work to another replica", retry_after_s=1.0)
        if bounded and self._pending >= self.max_queue:
            raise Overloaded(f"compute queue full ({self._pending} >= max_queue={self.max_queue})", retry_after_s=1.0)
        self._pending += 1
        self._idle.clear()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args, work)
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    def _call(self, fn: Callable[..., Any], args: tuple, work: float) -> Any:
        started = time.perf_counter()
        try:
            if self.inject_delay_s:
                time.sleep(self.inject_delay_s * work)
            return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - started

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new jobs and wait for the accepted ones; True if all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def close(self) -> None:
        self._executor.shutdown(wait=True)
