"""The trainer side of a mesh bench, in the bench's own process: the trainer's own classes
(``ReplicaBalancer``, ``PipelineClient``, ``RegistryMirror``) driven by a loop that keeps
``in_flight`` microbatches going until a count or a deadline, and records when each one
completed or failed, so a bench can cut the run into time windows (warm-up, before and
after a fault or a move) without a trainer process's start-up, evaluation and summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import HopTimeouts, MicrobatchFailed, PipelineClient
from services.trainer.registry_mirror import RegistryMirror
from shared.config import TrainerSettings
from shared.retry import RetryPolicy
from shared.wiring import ReplicaBalancer


@dataclass
class Completion:
    at: float  # time.monotonic() when it ended
    tokens: int  # 0 if it failed
    ok: bool


@dataclass
class PumpLog:
    started: float = 0.0
    completions: list[Completion] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return sum(c.ok for c in self.completions)

    @property
    def failed(self) -> int:
        return sum(not c.ok for c in self.completions)

    def tokens_per_s(self, since: float, until: float) -> float:
        """Tokens of the microbatches that completed in ``[since, until]``, per second."""
        tokens = sum(c.tokens for c in self.completions if since <= c.at <= until)
        return tokens / (until - since) if until > since else 0.0

    def between_completions(self, first: int, last: int) -> tuple[float, float, int]:
        """(start, end, tokens) from the end of successful microbatch ``first`` to that of
        ``last`` (1-based counts): the steady-state window, fill and drain left out."""
        done = [c for c in self.completions if c.ok]
        start, end = done[first - 1].at, done[last - 1].at
        return start, end, sum(c.tokens for c in done[first:last])


class MeshClient:
    """A session, a balancer and a pipeline client for one run; ``coordinator`` or static URLs."""

    def __init__(
        self,
        *,
        run_id: str,
        num_stages: int,
        codec: str,
        seq_len: int,
        microbatch_size: int,
        seed: int = 0,
        timeouts: HopTimeouts = HopTimeouts(60.0, 120.0),
        max_retries: int = 3,
        routing: str = TrainerSettings.model_fields["routing"].default,
    ):
        self.run_id, self.num_stages, self.codec, self.routing = run_id, num_stages, codec, routing
        self.batcher = ByteBatcher(load_corpus(), seq_len, microbatch_size, seed=seed)
        self.balancer = ReplicaBalancer(num_stages, rng=random.Random(seed))
        self.timeouts, self.retry = timeouts, RetryPolicy(max_retries=max_retries)
        self.seed = seed
        self.view: RegistryMirror | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "MeshClient":
        self.session = await self._stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        )
        self.client = PipelineClient(
            self.session,
            self.balancer,
            run_id=self.run_id,
            codec=self.codec,
            timeouts=self.timeouts,
            retry=self.retry,
            on_stage_empty=self._stage_empty,
            routing=self.routing,
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()

    def use_urls(self, urls: list[list[str]]) -> None:
        for stage, group in enumerate(urls):
            self.balancer.set_replicas(stage, group)

    async def use_coordinator(self, coordinator: str, refresh_s: float = 0.5, wait_s: float = 120.0) -> None:
        """Follow the coordinator's registry (refreshed every ``refresh_s``) as a trainer does."""
        self.view = RegistryMirror(self.session, coordinator, self.balancer, refresh_s=refresh_s)
        if not await self.view.wait_complete(wait_s):
            raise RuntimeError(f"the coordinator at {coordinator} lists no replica for some stage after {wait_s} s")
        task = asyncio.create_task(self.view.run())

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self._stack.push_async_callback(stop)

    async def _stage_empty(self, stage: int) -> None:
        if self.view is not None:
            await self.view.refresh()

    async def pump(
        self,
        *,
        in_flight: int,
        count: int | None = None,
        seconds: float | None = None,
        first_index: int = 0,
        stop_after: int | None = None,
        on_complete: Callable[[PumpLog], None] | None = None,
        stop: asyncio.Event | None = None,
    ) -> PumpLog:
        """Train microbatches ``first_index, first_index + 1, ...`` with ``in_flight`` at once,
        until ``count`` were started, ``seconds`` passed or ``stop`` is set; with
        ``stop_after``, the microbatches still running once that many completed are
        cancelled (no drain)."""
        assert count is not None or seconds is not None, "pump needs a count or a time limit"
        log = PumpLog(started=time.monotonic())
        deadline = log.started + seconds if seconds is not None else float("inf")
        next_index = first_index
        enough = asyncio.Event()

        async def worker() -> None:
            nonlocal next_index
            while (
                time.monotonic() < deadline
                and (count is None or next_index < first_index + count)
                and not enough.is_set()
                and not (stop and stop.is_set())
            ):
                index, next_index = next_index, next_index + 1
                mb = self.batcher.microbatch(index)
                try:
                    await self.client.train(mb, seed=self.seed * 1_000_003 + index)
                    log.completions.append(Completion(time.monotonic(), mb.num_tokens, True))
                except MicrobatchFailed as exc:
                    log.completions.append(Completion(time.monotonic(), 0, False))
                    log.failures.append(str(exc))
                if on_complete:
                    on_complete(log)
                if stop_after is not None and log.completed >= stop_after:
                    enough.set()

        workers = [asyncio.create_task(worker()) for _ in range(in_flight)]
        waiter = asyncio.create_task(enough.wait())
        try:
            pending = {*workers, waiter}
            while waiter in pending and not all(w.done() for w in workers):
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [*workers, waiter]:
                task.cancel()
            await asyncio.gather(*workers, waiter, return_exceptions=True)
        for w in workers:  # a bug in a worker must not pass for a measurement
            if not w.cancelled() and w.exception() is not None:
                raise w.exception()
        return log


async def registry_view(session: aiohttp.ClientSession, coordinator: str) -> list[list[dict]]:
    """The coordinator's live replicas per stage (``GET /swarm``)."""
    async with session.get(coordinator + "/swarm", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        return [s["replicas"] for s in (await resp.json())["stages"]]
