"""The stages' model FLOPs utilisation (MFU) over a training run, for the trainer's summary.

The trainer reads every replica's utilisation (``GET /health``: the stage server's meter,
``services/stage_server/utilisation.py``) before its first microbatch and after its last,
and divides the difference: per stage, its replicas' model FLOPs over the run's wall clock
times the sum of their peaks (``mfu_wall``: idle time counts against it) and over their
compute seconds, each weighted by its peak (``mfu_busy``). The work of every trainer of the
swarm in that window counts (the stage's, not this trainer's share). A replica that started
during the run counts from zero; one that went away took its work with it.

What the swarm lost over the run (steps whose updates died with their replicas, samples
dropped, duplicates refused) is read from the coordinator at the end (:func:`read_swarm_losses`).
"""

from __future__ import annotations

import asyncio

from shared.errors import RemoteError
from shared.http import get_json

HEALTH_TIMEOUT_S = 5.0


async def read_utilisation(session, stage_urls: list[list[str]], log=None) -> dict[str, dict]:
    """``{replica URL: its utilisation report with its stage}`` of the replicas that answer."""

    async def read(stage: int, url: str) -> tuple[str, dict | None]:
        try:
            health = await get_json(session, url + "/health", timeout_s=HEALTH_TIMEOUT_S)
        except RemoteError as exc:
            if log:
                log.warning("utilisation.unread", replica=url, error=str(exc))
            return url, None
        report = health.get("utilisation")
        return url, {**report, "stage": stage} if isinstance(report, dict) else None

    answers = await asyncio.gather(*(read(s, url) for s, urls in enumerate(stage_urls) for url in urls))
    return {url: report for url, report in answers if report is not None}


def run_utilisation(before: dict[str, dict], after: dict[str, dict], wall_s: float, num_stages: int) -> list[dict]:
    """Each stage's MFU between two :func:`read_utilisation` readings ``wall_s`` seconds apart."""
    stages = []
    for stage in range(num_stages):
        flops = compute_s = peak = busy_peak = 0.0
        replicas, peaks = 0, set()
        for url, end in after.items():
            if end["stage"] != stage:
                continue
            start = before.get(url)
            if start is None or start["stage"] != stage or start["model_flops"] > end["model_flops"]:
                start = {"model_flops": 0.0, "compute_s": 0.0}  # started during the run (or again, at this URL)
            replicas += 1
            flops += end["model_flops"] - start["model_flops"]
            seconds = end["compute_s"] - start["compute_s"]
            compute_s += seconds
            peak += end["peak_flops"]
            busy_peak += seconds * end["peak_flops"]
            peaks.add(f"{end['peak_source']}: {end['peak_device']}")
        stages.append(
            {
                "stage": stage,
                "replicas": replicas,
                "model_flops": flops,
                "compute_s": round(compute_s, 3),
                "flops_per_s_wall": flops / wall_s if wall_s > 0 else 0.0,
                "peak_flops": peak,
                "mfu_wall": round(flops / (wall_s * peak), 6) if wall_s > 0 and peak else None,
                "mfu_busy": round(flops / busy_peak, 6) if busy_peak else None,
                "peaks": sorted(peaks),
            }
        )
    return stages


LOSS_FIELDS = ("steps_lost_total", "steps_lost", "samples_dropped", "duplicates_refused")


async def read_swarm_losses(session, coordinator: str, log=None) -> list[dict]:
    """What the swarm lost, per stage, as the coordinator counts it (``GET /swarm``): the
    steps whose updates went with the replicas that held them (``steps_lost_total``, and the
    last ``steps_lost`` ranges), the samples accumulated yet not in a step, the duplicate
    backwards refused. ``[]`` without a coordinator or when it does not answer."""
    if not coordinator:
        return []
    try:
        view = await get_json(session, coordinator.rstrip("/") + "/swarm", timeout_s=HEALTH_TIMEOUT_S)
    except RemoteError as exc:
        if log is not None:
            log.warning("train.losses_unread", coordinator=coordinator, error=str(exc))
        return []
    losses = []
    for s in view.get("stages", []):
        step = s.get("step") or {}
        losses.append(
            {"stage": s.get("stage"), **{k: step.get(k, [] if k == "steps_lost" else 0) for k in LOSS_FIELDS}}
        )
    return losses
