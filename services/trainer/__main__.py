"""``swarm train`` / ``python -m services.trainer``: train through stage servers.

Prints the run's summary as one JSON line on stdout at the end (the full one, with
per-step losses, goes to ``summary_file`` if set); logs go to stderr.
Exit status: 0 trained, 1 some microbatches failed, 2 bad settings or unusable swarm.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid
from pathlib import Path

import aiohttp

from services.trainer.admission import AdmissionClient
from services.trainer.data import make_batcher
from services.trainer.pipeline import HopTimeouts, PipelineClient
from services.trainer.progress import ProgressDisplay, choose_display
from services.trainer.registry_mirror import RegistryMirror
from services.trainer.telemetry import TrainerTelemetry
from services.trainer.trainer import Trainer, summary_json
from services.trainer.utilisation import read_swarm_losses, read_utilisation, run_utilisation
from shared.config import TrainerSettings, parse_settings
from shared.discovery import find_coordinator
from shared.http import swarm_session
from shared.log import configure_logging, get_logger
from shared.retry import RetryPolicy
from shared.wiring import ReplicaBalancer

READY_WAIT_S = 60.0


class SwarmMismatch(ValueError):
    """A stage server that does not belong to this run as configured."""


async def check_stages(
    session: aiohttp.ClientSession,
    stage_urls: list[list[str]],
    settings: TrainerSettings,
    log,
    *,
    wait_s: float = READY_WAIT_S,
) -> dict:
    """GET /info of every replica (waiting up to ``wait_s`` for it to come up) and check
    that it serves the stage, model, cut and run this trainer expects. A replica that does
    not answer is skipped (the balancer routes around it) as long as its stage has another
    that does. Returns the info of a stage-0 replica."""
    # the model by its config: machines may hold a model directory at different paths
    expected = {
        "run_id": settings.run_id,
        "model_config": settings.gpt_config().to_dict(),
        "num_stages": settings.num_stages,
    }
    first = None
    for stage, urls in enumerate(stage_urls):
        answered = 0
        for url in urls:
            try:
                info = await _get_info(session, url, settings.info_timeout_s, wait_s)
            except SwarmMismatch as exc:
                log.warning("swarm.replica_unreachable", stage=stage, replica=url, error=str(exc))
                continue
            wrong = {k: info.get(k) for k, v in {**expected, "stage": stage}.items() if info.get(k) != v}
            if wrong:
                raise SwarmMismatch(f"{url} serves {wrong}, expected { ({**expected, 'stage': stage}) }")
            if settings.routing not in info.get("routings", ["relay"]):
                raise SwarmMismatch(
                    f"{url} does not serve SWARM_ROUTING={settings.routing} "
                    f"(it serves {info.get('routings', ['relay'])}): upgrade it, or set SWARM_ROUTING=relay"
                )
            answered += 1
            first = first or info
        if not answered:
            raise SwarmMismatch(f"no replica of stage {stage} answered GET /info within {wait_s} s: {urls}")
    log.info(
        "swarm.checked", stages=len(stage_urls), replicas=sum(map(len, stage_urls)), global_batch=first["global_batch"]
    )
    return first


async def _get_info(session: aiohttp.ClientSession, url: str, timeout_s: float, wait_s: float) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    policy = RetryPolicy(max_retries=1000, base_delay_s=0.1, max_delay_s=2.0)
    attempt = 0
    while True:
        try:
            async with session.get(url + "/info", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                resp.raise_for_status()
                return await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            attempt += 1
            if loop.time() > deadline:
                raise SwarmMismatch(f"{url}/info did not answer within {wait_s} s: {exc!r}") from None
            await asyncio.sleep(policy.delay_s(attempt))


async def find_swarm(
    session: aiohttp.ClientSession, settings: TrainerSettings, balancer: ReplicaBalancer, log
) -> RegistryMirror | None:
    """Static URLs (SWARM_STAGES) or the coordinator's registry (SWARM_COORDINATOR, or mDNS)."""
    if settings.stages:
        for stage, urls in enumerate(settings.stage_urls()):
            balancer.set_replicas(stage, urls)
        return None
    coordinator = settings.coordinator
    if not coordinator and settings.mdns:
        coordinator = (
            await find_coordinator(
                settings.run_id, interfaces_spec=settings.mdns_interfaces, timeout_s=settings.mdns_timeout_s
            )
            or ""
        )
    if not coordinator:
        raise SwarmMismatch(
            "no stage servers: set SWARM_STAGES or SWARM_COORDINATOR (no coordinator found by mDNS either)"
        )
    log.info("coordinator.using", url=coordinator, discovered=not settings.coordinator)
    view = RegistryMirror(session, coordinator, balancer, refresh_s=settings.heartbeat_s, log=log)
    if not await view.wait_complete(READY_WAIT_S):
        raise SwarmMismatch(
            f"the coordinator at {coordinator} lists no replica for some stage after {READY_WAIT_S} s: "
            f"{view.replicas()}"
        )
    return view


async def train(settings: TrainerSettings) -> int:
    trainer_id = uuid.uuid4().hex[:8]
    log = get_logger(service="trainer", run=settings.run_id, trainer=trainer_id)
    batcher = make_batcher(settings, settings.gpt_config(), log)
    balancer = ReplicaBalancer(settings.num_stages, rng=random.Random(settings.seed))
    async with swarm_session(settings, limit=0) as session:  # limit 0: one keep-alive connection per request in flight
        view = await find_swarm(session, settings, balancer, log)
        stage_urls = [list(balancer.estimates(s)) for s in range(settings.num_stages)]
        # registry entries are live servers: a short wait suffices; fixed URLs may still be starting
        info = await check_stages(
            session, stage_urls, settings, log, wait_s=settings.info_timeout_s if view else READY_WAIT_S
        )
        if settings.seq_len > info["model_config"]["block_size"]:
            raise SwarmMismatch(
                f"SWARM_SEQ_LEN={settings.seq_len} exceeds the model's block_size {info['model_config']['block_size']}"
            )
        telemetry = TrainerTelemetry(run_id=settings.run_id, trainer_id=trainer_id, log=log)
        client = PipelineClient(
            session,
            balancer,
            run_id=settings.run_id,
            codec=settings.wire_codec,
            until_step=settings.steps,
            timeouts=HopTimeouts(settings.forward_timeout_s, settings.backward_timeout_s, settings.stage_wait_s),
            retry=RetryPolicy(max_retries=settings.max_retries),
            log=log,
            on_stage_empty=view.stage_empty if view else None,
            client_id=trainer_id,
            telemetry=telemetry,
            routing=settings.routing,
        )
        display = ProgressDisplay(
            choose_display(settings.progress, sys.stderr, log_format=settings.log_format),
            settings.steps,
            stream=sys.stderr,
            initial_steps=settings.start_step,
            every_steps=settings.log_every,
        )
        trainer = Trainer(
            client,
            batcher,
            steps=settings.steps,
            global_batch=info["global_batch"],
            shard_index=settings.shard_index,
            num_shards=settings.num_shards,
            in_flight=settings.in_flight,
            seed=settings.seed,
            log_every=settings.log_every,
            eval_every=settings.eval_every,
            metrics_file=settings.metrics_file,
            log=log,
            start_step=settings.start_step,
            on_step=lambda record: (display.show_record(record), telemetry.step_done(record)),
            before_final_eval=(lambda: view.average(settings.final_average_timeout_s))
            if view and settings.final_average
            else None,
            admission=AdmissionClient(
                session,
                view.coordinator,
                run_id=settings.run_id,
                until_step=settings.steps,
                wait_s=max(settings.stage_wait_s, settings.backward_timeout_s),
                log=log,
            )
            if view
            else None,
        )
        log.info(
            "train.start",
            steps=settings.steps,
            global_batch=info["global_batch"],
            microbatches_per_step=trainer.microbatches_per_step,
            in_flight=settings.in_flight,
            codec=settings.wire_codec,
            shard=f"{settings.shard_index}/{settings.num_shards}",
        )
        await telemetry.start(
            session,
            coordinator=view.coordinator if view else settings.coordinator,
            host=settings.metrics_host,
            port=settings.metrics_port,
        )
        refresher = asyncio.create_task(view.run()) if view else None
        utilisation_before, read_at = await read_utilisation(session, _replicas(balancer), log), time.perf_counter()
        try:
            with display:  # meanwhile log lines go above the bar
                summary = await trainer.run()
        finally:
            await telemetry.stop()  # the last progress report, then /metrics closes
            if refresher:
                refresher.cancel()
                await asyncio.gather(refresher, return_exceptions=True)
        utilisation_after = await read_utilisation(session, _replicas(balancer), log)
        summary.stages = run_utilisation(
            utilisation_before, utilisation_after, time.perf_counter() - read_at, settings.num_stages
        )
        summary.swarm_losses = await read_swarm_losses(session, view.coordinator if view else settings.coordinator, log)
    log.info(
        "train.utilisation",
        mfu_busy=[s["mfu_busy"] for s in summary.stages],
        mfu_wall=[s["mfu_wall"] for s in summary.stages],
    )
    log.info(
        "train.done",
        steps=summary.steps,
        completed=summary.microbatches_completed,
        failed=summary.microbatches_failed,
        tokens_per_s=round(summary.tokens_per_s, 1),
        eval_loss_before=round(summary.eval_loss_before, 4),
        eval_loss_after=round(summary.eval_loss_after, 4),
        steps_lost=[s["steps_lost_total"] for s in summary.swarm_losses],
        samples_dropped=[s["samples_dropped"] for s in summary.swarm_losses],
    )
    if settings.summary_file:
        Path(settings.summary_file).write_text(summary_json(summary) + "\n")
    print(summary_json(summary, per_step=False), flush=True)
    return 1 if summary.microbatches_failed else 0


def _replicas(balancer: ReplicaBalancer) -> list[list[str]]:
    """Each stage's replica URLs as the balancer knows them now."""
    return [list(balancer.estimates(s)) for s in range(balancer.num_stages)]


def main(argv: list[str] | None = None, *, settings_class: type[TrainerSettings] = TrainerSettings) -> int:
    """Train until done. ``settings_class``: a variant of the settings (the benches' models of
    other dimensions, ``bench.stage_proc``)."""
    settings = parse_settings(settings_class, argv, "swarm train", "Train a model through stage servers.")
    configure_logging(settings.log_format, settings.log_level)
    try:
        return asyncio.run(train(settings))
    except ValueError as exc:  # bad settings, unusable corpus, a swarm that does not match
        print(f"swarm train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
