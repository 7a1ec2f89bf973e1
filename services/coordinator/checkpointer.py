"""Checkpointer: every ``checkpoint_every_s``, one live replica's state per stage into the
checkpoint directory (safetensors + JSON, see ``shared.checkpoint``).

The coordinator pulls the bytes (``GET /state?step=N`` on a replica) and writes them; it
never decodes a tensor. Every stage is saved at the same global step N, at a step
boundary: all stages are asked at once for N, the furthest step any stage has taken, and
a replica of a stage still short of it answers once its stage took it (stages of one
global batch step within a pipeline's latency of each other); if a stage stepped past N
meanwhile, all are asked again at its step. A stage that does not get there within the timeout
(training stopped) is saved as it is, and the checkpoint's step is then the smallest
step among the stages, so a resumed run never claims progress some stage did not make.
A checkpoint is committed only when every stage was saved; when a stage gave no state, the
states the others gave are kept as their newest (``checkpoint.keep_newest_stage``), for a
stage that loses every replica to recover from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp

from services.coordinator.registry import Registry
from shared import checkpoint
from shared.errors import BadPayload, RemoteError
from shared.http import OCTET_STREAM, from_any_replica, request_bytes

ALIGN_ATTEMPTS = 3  # downloads of every stage until all are at one step


class Checkpointer:
    def __init__(
        self,
        registry: Registry,
        *,
        root: str,
        run_id: str,
        keep: int,
        timeout_s: float,
        log,
        session: aiohttp.ClientSession | None = None,
        stage_steps: Callable[[], list[int]] = list,
    ):
        """``session`` (for downloading states) may be given later, before the first checkpoint;
        ``stage_steps()``: each stage's global step as the coordinator counts it."""
        self.session, self.registry, self.root, self.run_id, self.stage_steps = (
            session,
            registry,
            root,
            run_id,
            stage_steps,
        )
        self.keep, self.timeout_s, self.log = keep, timeout_s, log
        self.saved = 0
        # bytes/s of each replica's last state download (0: it failed): the fastest asked first, one
        # never asked before them all (a replica behind a slow link, tried first, would spend the
        # whole timeout and leave the checkpoint without its stage)
        self.rates: dict[str, float] = {}

    async def checkpoint_once(self) -> Path | None:
        """Save every stage; the committed checkpoint's path, or None if a stage had no state to give."""
        by_stage: dict[int, list[str]] = {s: [] for s in range(self.registry.num_stages)}
        for server in self.registry.live():
            by_stage[server.stage].append(server.url)
        target = max(self.stage_steps(), default=0)
        for _ in range(ALIGN_ATTEMPTS):  # all stages at once; again at the furthest step if one stepped meanwhile
            downloads = await asyncio.gather(*(self._download(stage, urls, target) for stage, urls in by_stage.items()))
            missing = [stage for stage, data in zip(by_stage, downloads) if data is None]
            if missing:
                kept = [
                    stage
                    for stage, data in zip(by_stage, downloads)
                    if data is not None and checkpoint.keep_newest_stage(self.root, stage, data)
                ]
                self.log.warning(
                    "checkpoint.skipped",
                    stage=missing[0],
                    missing=missing,
                    reason="no live replica gave its state",
                    kept_newest=kept,
                )
                return None
            states = dict(zip(by_stage, downloads))
            metas = {stage: checkpoint.state_metadata(data) for stage, data in states.items()}
            reached = {int(m.get("optimizer_steps", 0)) for m in metas.values()}
            if len(reached) == 1:
                break
            target = max(reached)
        step = min(int(m.get("optimizer_steps", 0)) for m in metas.values())
        if any(int(m.get("optimizer_steps", 0)) != step for m in metas.values()):
            self.log.warning(
                "checkpoint.uneven",
                step=step,
                stage_steps={s: m.get("optimizer_steps") for s, m in metas.items()},
                reason="a stage did not reach the others' step in time",
            )
        latest = checkpoint.latest_checkpoint(self.root)
        if latest is not None and checkpoint.read_meta(latest)["step"] == step:
            return latest  # nothing new; never rewrite the files of a committed checkpoint
        for stage, data in states.items():
            checkpoint.write_stage_file(self.root, step, stage, data)
        meta = {
            "run_id": self.run_id,
            "num_stages": self.registry.num_stages,
            "model_config": metas[0].get("model_config"),
            "stage_steps": {str(s): m.get("optimizer_steps") for s, m in metas.items()},
        }
        if metas[0].get("lora"):  # a LoRA run: the stages hold adapters of this base
            meta["lora"] = metas[0]["lora"]
            meta["base_fingerprints"] = {str(s): m.get("base_fingerprint") for s, m in metas.items()}
        path = checkpoint.commit_checkpoint(self.root, step, meta)
        self.registry.record_checkpoint(step, str(path))
        checkpoint.prune(self.root, self.keep)
        self.saved += 1
        self.log.info("checkpoint.saved", path=str(path), step=step, bytes=sum(map(len, states.values())))
        return path

    async def _download(self, stage: int, urls: list[str], step: int) -> bytes | None:
        """One replica's state at global step ``step`` (or later, or as it is if its stage
        does not get there in time): each replica in turn, the fastest of the last downloads
        first (``rates``); a busy one (503 overloaded) again after its Retry-After, within ``timeout_s``."""

        loop = asyncio.get_running_loop()

        async def fetch(url: str) -> bytes:
            started = loop.time()
            self.rates[url] = 0.0  # until it answers
            data = await request_bytes(
                self.session,
                "GET",
                f"{url}/state?step={step}&wait_s={self.timeout_s / 2:g}",
                expect=OCTET_STREAM,
                timeout_s=self.timeout_s,
            )
            try:
                checkpoint.state_metadata(data)  # a readable state, not an error page
            except BadPayload as exc:
                raise RemoteError(url + "/state", 200, "bad_reply", exc.message) from None
            self.rates[url] = len(data) / max(loop.time() - started, 1e-6)
            return data

        def failed(url: str, exc: RemoteError) -> None:
            self.log.warning("checkpoint.download_failed", stage=stage, replica=url, error=str(exc))

        fastest_first = sorted(urls, key=lambda url: -self.rates.get(url, float("inf")))
        return await from_any_replica(fastest_first, fetch, deadline_s=self.timeout_s, on_error=failed)

    async def run(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.checkpoint_once()
            except OSError as exc:  # a full or read-only disk: say so, try again next period
                self.log.error("checkpoint.failed", error=repr(exc))
