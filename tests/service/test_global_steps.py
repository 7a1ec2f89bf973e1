"""One model per stage: the swarm's global steps, through the real coordinator and real
stage servers on loopback (in this process), trained by the real trainer.

- replicas of a stage are bit-identical after every step (their digests are recorded on
  the compute worker right after each step), every step holds exactly the global batch,
  every gradient was computed on the weights of the step it went into, and the
  coordinator moves no tensor;
- with one replica per stage, one trainer and one microbatch in flight, the swarm's
  parameters after 10 global steps are those of the same model trained in one process
  with the same AdamW, schedule, clipping and batches;
- a backward too old is refused (409) and its microbatch run again, counted once; a
  duplicate backward is not accumulated twice;
- a replica that dies while its stage all-reduces is left out within the round's timeout,
  its samples are counted as dropped, and training goes on.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field, replace

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.coordinator.app import STEPS
from services.coordinator.app import create_app as create_coordinator
from services.coordinator.routes import ADMISSION, REGISTRY, TRAFFIC
from services.stage_server.allreduce import AVERAGER as AVERAGER_KEY
from services.stage_server.app import MEMBERSHIP, create_app
from services.stage_server.routes import RUNTIME
from services.stage_server.runtime import OptimizerConfig, flat_parameters
from services.trainer.admission import AdmissionClient
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import PipelineClient
from services.trainer.trainer import Trainer
from shared import checkpoint
from shared.codec import encode_tensor
from shared.errors import RemoteError
from shared.http import post_message
from shared.model import PRESETS, build_gpt, build_stage
from shared.processes import free_port
from tests.conftest import balancer_for, coordinator_settings, stage_settings

RUN_ID = "test"
SEQ_LEN, MICROBATCH = 32, 4


@dataclass
class Swarm:
    coordinator: web.Application
    coordinator_url: str
    coordinator_server: TestServer
    stages: list[list[web.Application]]  # apps per stage
    urls: list[list[str]]
    servers: dict[str, TestServer] = field(default_factory=dict)  # URL -> its server
    digests: dict[tuple[int, int], list[str]] = field(
        default_factory=dict
    )  # (stage, step) -> digest of each replica after it
    batches: dict[tuple[int, int], list[int]] = field(
        default_factory=dict
    )  # (stage, step) -> samples of the step, per replica


@pytest.fixture
async def swarm():
    """``await swarm(replicas per stage, **stage settings)`` -> a registered :class:`Swarm`."""
    servers: list[TestServer] = []

    async def serve(app: web.Application, port: int | None = None) -> str:
        server = TestServer(app, host="127.0.0.1", port=port)
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    async def start(
        replicas: list[int],
        *,
        step_timeout_s: float = 10.0,
        checkpoint_dir: str = "",
        coordinator_overrides: dict | None = None,
        **overrides,
    ) -> Swarm:
        coordinator_app = create_coordinator(
            coordinator_settings(
                **(coordinator_overrides or {}),
                run_id=RUN_ID,
                num_stages=len(replicas),
                step_timeout_s=step_timeout_s,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every_s=60,
            )
        )
        coordinator = await serve(coordinator_app)
        result = Swarm(coordinator_app, coordinator, servers[-1], [], [])
        for stage, count in enumerate(replicas):
            result.stages.append([]), result.urls.append([])
            for _ in range(count):
                port = free_port()  # the URL a server registers is the one it listens at
                settings = stage_settings(
                    stage,
                    num_stages=len(replicas),
                    coordinator=coordinator,
                    heartbeat_s=60.0,
                    port=port,
                    run_id=RUN_ID,
                    **overrides,
                )
                app = create_app(settings)
                url = await serve(app, port)
                result.stages[-1].append(app), result.urls[-1].append(url)
                result.servers[url] = servers[-1]
                record_steps(app[RUNTIME], stage, result)
        for app in (a for group in result.stages for a in group):
            await asyncio.wait_for(app[MEMBERSHIP].registered.wait(), 10)
        return result

    yield start
    for server in reversed(servers):
        await server.close()


async def settled(swarm: Swarm) -> None:
    """Until every replica's round in progress (the last step's, the trainer may have its
    answers already) ended; bounded by the round's own deadline."""
    for app in (a for group in swarm.stages for a in group):
        averager = app[AVERAGER_KEY]
        if averager.running:
            await averager.wait_round(averager.round.spec.round_id, 30)
    await swarm.coordinator[STEPS].settled()


def record_steps(runtime, stage: int, swarm: Swarm) -> None:
    """After each step a runtime applies: its digest and the step's samples (on the compute worker)."""
    apply_step = runtime.apply_step

    def recording(gradient):
        apply_step(gradient)
        swarm.digests.setdefault((stage, runtime.step), []).append(runtime.digest())
        swarm.batches.setdefault((stage, runtime.step), []).append(gradient.samples)

    runtime.apply_step = recording


def trainer(
    session,
    urls,
    *,
    steps: int,
    global_batch: int,
    in_flight: int,
    shard: tuple[int, int] = (0, 1),
    trainer_id: str = "t0",
    coordinator: str = "",
) -> Trainer:
    """The run's trainer; with ``coordinator``, it asks there which step each microbatch is for."""
    client = PipelineClient(
        session, balancer_for(urls, seed=shard[0]), run_id=RUN_ID, codec="fp32", until_step=steps, client_id=trainer_id
    )
    batcher = ByteBatcher(load_corpus(), SEQ_LEN, MICROBATCH, seed=0)
    return Trainer(
        client,
        batcher,
        steps=steps,
        global_batch=global_batch,
        in_flight=in_flight,
        eval_microbatches=1,
        shard_index=shard[0],
        num_shards=shard[1],
        admission=AdmissionClient(session, coordinator, run_id=RUN_ID, until_step=steps, wait_s=60)
        if coordinator
        else None,
    )


async def test_replicas_of_a_stage_are_identical_after_every_step(swarm, http_session):
    """3 replicas of each of 2 stages, 2 trainers, 20 global steps."""
    steps, global_batch = 20, 16
    s = await swarm([3, 3], global_batch=global_batch, wire_codec="fp32")
    runs = [
        trainer(
            http_session, s.urls, steps=steps, global_batch=global_batch, in_flight=2, shard=(t, 2), trainer_id=f"t{t}"
        )
        for t in range(2)
    ]
    summaries = await asyncio.gather(*(t.run() for t in runs))
    await settled(s)

    assert all(x.microbatches_failed == 0 for x in summaries)
    for stage in range(2):
        assert [app[RUNTIME].step for app in s.stages[stage]] == [steps] * 3
        for step in range(1, steps + 1):
            digests = s.digests[(stage, step)]
            assert len(digests) == 3 and len(set(digests)) == 1, f"stage {stage} step {step}: replicas differ"
            assert s.batches[(stage, step)] == [global_batch] * 3, (
                f"stage {stage} step {step} held {s.batches[(stage, step)]} samples"
            )
    # every gradient was computed on its forward's weights, also those reserved for the next
    # step (a step's worth of microbatches is in flight), which went in one step late
    replicas = [app[RUNTIME].stats for group in s.stages for app in group]
    assert sum(r.other_weights_backwards for r in replicas) == 0
    assert sum(r.stale_gradients for r in replicas) > 0, "no backward went into the step after its weights'"
    counter = s.coordinator[STEPS].counter
    assert [st.step for st in counter.stages] == [steps, steps] and all(
        st.samples_dropped == 0 for st in counter.stages
    )
    # the coordinator only named rounds and polled their end: a few KB a round, where each
    # member sends about 4/3 of a stage's fp32 gradient (~2.3 MB here) in every round
    traffic = s.coordinator[TRAFFIC]["steps"]
    per_round = (traffic["sent"] + traffic["received"]) / (2 * steps)
    parameters = sum(p.numel() for p in s.stages[0][0][RUNTIME].params)
    assert 0 < per_round < 16 * 1024 < 0.01 * 4 * parameters, per_round


@pytest.mark.parametrize("optimizer", ["adamw", "nadamw"])
async def test_one_replica_one_microbatch_in_flight_is_one_process_training(swarm, http_session, optimizer):
    """10 global steps through 4 stages over HTTP (fp32 wire) vs the whole model in one
    process, with AdamW and with NAdamW (``SWARM_OPTIMIZER``, the paper's beta1 0.99)."""
    steps, global_batch, num_stages = 10, 2 * MICROBATCH, 4
    optim = reference_optimizer(global_batch, steps)
    if optimizer == "nadamw":
        optim = replace(optim, name="nadamw", betas=(0.99, optim.betas[1]))
    s = await reference_swarm(swarm, [1] * num_stages, optim)
    summary = await trainer(http_session, s.urls, steps=steps, global_batch=global_batch, in_flight=1).run()
    assert summary.microbatches_completed == steps * 2 and summary.microbatch_reruns == 0

    reference = one_process_training(optim, num_stages, steps)
    clipped = 0
    for stage, group in enumerate(s.stages):
        runtime = group[0][RUNTIME]
        assert runtime.step == steps
        clipped += runtime.stats.clipped_steps
        for name, p in runtime.model.named_parameters():
            ref = reference[name]
            rel = float((p.detach() - ref).norm() / ref.norm())
            assert rel <= 1e-5, f"stage {stage} {name}: relative error {rel:.2e}"
    assert clipped > 0, "the clipping was never exercised"


async def two_trainers(s: Swarm, session, steps: int, global_batch: int) -> list:
    """Two trainers with 2 microbatches in flight each, admitted by the swarm's coordinator;
    their summaries, once every round ended (none failed, none ran again)."""
    runs = [
        trainer(
            session,
            s.urls,
            steps=steps,
            global_batch=global_batch,
            in_flight=2,
            shard=(t, 2),
            trainer_id=f"t{t}",
            coordinator=s.coordinator_url,
        )
        for t in range(2)
    ]
    summaries = await asyncio.gather(*(t.run() for t in runs))
    await settled(s)
    assert all(x.microbatches_failed == 0 and x.microbatch_reruns == 0 for x in summaries)
    return summaries


def admitted_batches(s: Swarm, steps: int) -> list[list[int]]:
    """The run's microbatch indices the coordinator admitted into each step."""
    admission = s.coordinator[ADMISSION]
    return [[int(mb.rsplit(":", 1)[1]) for mb in admission.batch(k)] for k in range(steps)]


def assert_one_process(s: Swarm, optim: OptimizerConfig, num_stages: int, steps: int, batches) -> None:
    """Every replica holds what one process trains on ``batches``: the stage's parameters within
    1e-5 (relative), each tensor within 1e-4 (the replicas sum their gradients in another order
    than one process does: float rounding, then AdamW)."""
    reference = one_process_training(optim, num_stages, steps, batches)
    for stage, group in enumerate(s.stages):
        names = [name for name, _ in group[0][RUNTIME].model.named_parameters()]
        expected = flat_parameters([reference[name] for name in names])
        for app in group:
            runtime = app[RUNTIME]
            assert runtime.step == steps
            rel = float((flat_parameters(runtime.params) - expected).norm() / expected.norm())
            assert rel <= 1e-5, f"stage {stage}: relative error {rel:.2e}"
            for name, p in runtime.model.named_parameters():
                for part, ours, ref in comparable_parts(name, p.detach(), reference[name]):
                    rel = float((ours - ref).norm() / ref.norm())
                    assert rel <= 1e-4, f"stage {stage} {name}{part}: relative error {rel:.2e}"


async def test_the_sync_schedule_trains_two_replicas_and_two_trainers_as_one_process(swarm, http_session):
    """SWARM_SCHEDULE=sync: 2 replicas of each of 2 stages, 2 trainers with 2 microbatches in
    flight each (fp32 wire and step rounds). After 10 global steps every replica holds the parameters of the
    whole model trained in one process on the same microbatches in each step (the ones the
    coordinator admitted into it), and every gradient was computed on the weights of the step
    it went into."""
    steps, global_batch, num_stages = 10, 4 * MICROBATCH, 2
    optim = reference_optimizer(global_batch, steps)
    s = await reference_swarm(
        swarm, [2] * num_stages, optim, coordinator_overrides={"schedule": "sync", "averaging_codec": "fp32"}
    )
    summaries = await two_trainers(s, http_session, steps, global_batch)
    batches = admitted_batches(s, steps)
    assert [len(b) for b in batches] == [4] * steps and len({i for b in batches for i in b}) == 4 * steps
    assert all(x.microbatches_completed > 0 for x in summaries)  # both trainers filled the steps
    replicas = [app[RUNTIME] for group in s.stages for app in group]
    assert sum(r.stats.stale_gradients for r in replicas) == 0 and sum(r.stats.samples for r in replicas) > 0
    assert sum(r.stats.other_weights_backwards for r in replicas) == 0
    assert_one_process(s, optim, num_stages, steps, batches)


async def test_a_stage_moves_with_its_fast_replica_and_the_slow_one_holds_the_next_steps_forwards(swarm, http_session):
    """SWARM_SCHEDULE=sync with a slow replica in each stage (a weak peer: its step's apply
    comes last). The coordinator moves a stage when the first member of its round stepped, so
    the swarm's next step is admitted while the slow replica still applies; a forward of it
    that reaches the slow replica waits there for the round's weights. Each slow apply here
    waits until the coordinator moved its stage without it (the old code waited for every
    member: each such wait ran out), and the run is still one process's training."""
    steps, global_batch, num_stages = 6, 4 * MICROBATCH, 2
    optim = reference_optimizer(global_batch, steps)
    s = await reference_swarm(
        swarm, [2] * num_stages, optim, coordinator_overrides={"schedule": "sync", "averaging_codec": "fp32"}
    )
    counter = s.coordinator[STEPS].counter
    moved: dict[tuple[int, int], threading.Event] = {
        (stage, k): threading.Event() for stage in range(num_stages) for k in range(steps + 1)
    }
    member_stepped = counter.member_stepped

    def recording(stage, round_id, url, reached, members):
        went = member_stepped(stage, round_id, url, reached, members)
        if went:
            moved[(stage, reached)].set()
        return went

    counter.member_stepped = recording
    slow_applies: list[tuple[int, int, bool]] = []  # (stage, step it took, the stage had moved without it)
    for stage, group in enumerate(s.stages):
        runtime = group[1][RUNTIME]
        apply_step = runtime.apply_step

        def slow(gradient, runtime=runtime, apply_step=apply_step, stage=stage):  # on the compute worker
            before_moved = moved[(stage, runtime.step + 1)].wait(10.0)
            slow_applies.append((stage, runtime.step + 1, before_moved))
            apply_step(gradient)

        runtime.apply_step = slow
    await two_trainers(s, http_session, steps, global_batch)
    assert sorted((stage, k) for stage, k, _ in slow_applies) == [
        (stage, k) for stage in range(num_stages) for k in range(1, steps + 1)
    ]
    assert all(before for _, _, before in slow_applies), slow_applies  # every stage moved without its slow member
    replicas = [app[RUNTIME] for group in s.stages for app in group]
    assert (
        sum(r.stats.stale_gradients for r in replicas) == 0
        and sum(r.stats.other_weights_backwards for r in replicas) == 0
    )
    assert_one_process(s, optim, num_stages, steps, admitted_batches(s, steps))


def comparable_parts(name: str, ours: torch.Tensor, ref: torch.Tensor):
    """(part, ours, reference) to compare in relative terms. The key bias of an attention
    (the middle third of ``c_attn.bias``) has a gradient of exactly 0 (softmax does not change
    when the same value is added to every score of a query), so what moves it is AdamW on
    float noise, which any other order of summation changes: both stay near 0 instead."""
    if not name.endswith("c_attn.bias"):
        return [("", ours, ref)]
    d = ours.numel() // 3
    assert float(ours[d : 2 * d].norm()) < 1e-3 and float(ref[d : 2 * d].norm()) < 1e-3, name
    return [("[q]", ours[:d], ref[:d]), ("[v]", ours[2 * d :], ref[2 * d :])]


def reference_optimizer(global_batch: int, steps: int) -> OptimizerConfig:
    """AdamW with warm-up, a cosine schedule and clipping: what the one-process references use."""
    return OptimizerConfig(
        lr=3e-3,
        weight_decay=0.01,
        global_batch=global_batch,
        warmup_steps=3,
        schedule="cosine",
        total_steps=steps,
        min_lr_ratio=0.1,
        max_grad_norm=0.5,
    )


async def reference_swarm(swarm, replicas: list[int], optim: OptimizerConfig, **overrides) -> Swarm:
    """A swarm whose servers train with ``optim`` over an fp32 wire."""
    return await swarm(
        replicas,
        global_batch=optim.global_batch,
        wire_codec="fp32",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        warmup_steps=optim.warmup_steps,
        lr_schedule=optim.schedule,
        total_steps=optim.total_steps,
        min_lr_ratio=optim.min_lr_ratio,
        max_grad_norm=optim.max_grad_norm,
        optimizer=optim.name,
        beta1=optim.betas[0],
        **overrides,
    )


def one_process_training(
    optim: OptimizerConfig, num_stages: int, steps: int, batches: list[list[int]] | None = None
) -> dict[str, torch.Tensor]:
    """The whole tiny model, the same batches (``batches[step]``: the run's microbatch indices of
    each step; default 0, 1, ... in order), gradient means over each global batch, each stage's
    gradient clipped on its own, AdamW or NAdamW (``optim.name``; decay on matrices only) at the
    schedule's learning rate."""
    cfg = PRESETS["tiny"]
    assert cfg.dropout == 0.0
    model = build_gpt(cfg, seed=0)
    params = dict(model.named_parameters())
    stage_names = [
        [name for name, _ in build_stage(cfg, s, num_stages, seed=0).named_parameters()] for s in range(num_stages)
    ]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if optim.name == "nadamw":
        opt = torch.optim.NAdam(groups, lr=optim.lr, betas=optim.betas, decoupled_weight_decay=True)
    else:
        opt = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas)
    batcher = ByteBatcher(load_corpus(), SEQ_LEN, MICROBATCH, seed=0)
    per_step = optim.global_batch // MICROBATCH
    for step in range(steps):
        opt.zero_grad()
        for index in batches[step] if batches else range(step * per_step, (step + 1) * per_step):
            mb = batcher.microbatch(index)
            (model(mb.inputs, mb.targets) * mb.inputs.shape[0] / optim.global_batch).backward()
        for names in stage_names:
            torch.nn.utils.clip_grad_norm_([params[n] for n in names], optim.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = optim.lr_at(step)
        opt.step()
    return {name: p.detach().clone() for name, p in params.items()}


async def test_a_stale_backward_is_refused_and_its_microbatch_run_again_once(start_stages, http_session):
    """Stage 0 steps twice between a microbatch's forward and its backward: 409, the trainer
    runs the microbatch again from the start, and every stage counts its samples once."""
    apps, urls = await start_stages(
        [[stage_settings(s, num_stages=2, global_batch=MICROBATCH, max_staleness=1)] for s in range(2)]
    )
    first = apps[0][0][RUNTIME]
    batcher = ByteBatcher(load_corpus(), SEQ_LEN, MICROBATCH, seed=0)
    client = PipelineClient(http_session, balancer_for(urls), run_id=RUN_ID, codec="fp32")
    mb = batcher.microbatch(0)

    real_call = client._call
    meddled = False

    async def call(mb_, stage, path, msg, read, **kwargs):
        nonlocal meddled
        if (
            stage == 0 and path == "/backward" and not meddled
        ):  # other trainers' microbatches step stage 0 twice meanwhile
            meddled = True
            for other in (1, 2):
                await client.train(batcher.microbatch(other), seed=other)
        return await real_call(mb_, stage, path, msg, read, **kwargs)

    client._call = call
    result = await client.train(mb, seed=0)
    assert result.reruns == 1
    assert first.stats.stale_backwards == 1 and first.stats.samples == 3 * MICROBATCH and first.step == 3
    last = apps[1][0][RUNTIME]  # its backward of the first run was accumulated; the re-run's is a duplicate
    assert last.stats.samples == 3 * MICROBATCH and last.stats.duplicate_backwards == 1


def last_stage_backward(microbatch_id: str, samples: int) -> dict:
    """A ``/backward`` body for stage 1 of 2 (the last): random hidden states and targets."""
    return {
        "run_id": RUN_ID,
        "stage": 1,
        "microbatch_id": microbatch_id,
        "seed": 0,
        "codec": "fp32",
        "inputs": encode_tensor(torch.randn(samples, SEQ_LEN, PRESETS["tiny"].d_model), "fp32"),
        "targets": encode_tensor(torch.randint(0, 256, (samples, SEQ_LEN)), "raw"),
    }


async def test_a_duplicate_backward_is_answered_and_not_accumulated_twice(start_stages, http_session):
    apps, urls = await start_stages([[stage_settings(1, num_stages=2)]])
    runtime = apps[0][0][RUNTIME]
    msg = last_stage_backward("mb", 2)
    first = await post_message(http_session, urls[0][0] + "/backward", msg, timeout_s=30)
    again = await post_message(http_session, urls[0][0] + "/backward", msg, timeout_s=30)
    assert first["accumulated"] is True and again["accumulated"] is False and first["loss"] == again["loss"]
    assert runtime.pending_samples == 2 and runtime.stats.duplicate_backwards == 1
    with pytest.raises(RemoteError) as refused:
        await post_message(
            http_session, urls[0][0] + "/backward", {**msg, "microbatch_id": "old", "forward_step": 5}, timeout_s=30
        )
    assert refused.value.status == 409 and refused.value.code == "stale_forward"
    assert runtime.pending_samples == 2


async def test_a_duplicate_backward_takes_no_reservation(swarm, http_session):
    """A backward of a microbatch already accumulated asks the coordinator for nothing: a
    reservation given back would reopen a closed step, and backwards waiting for the replica
    to take that step would wait for samples nobody sends."""
    s = await swarm([1, 1], global_batch=2 * MICROBATCH, wire_codec="fp32")
    counter = s.coordinator[STEPS].counter
    asked = []
    reserve = counter.reserve
    counter.reserve = lambda req, *args, **kwargs: asked.append(req.stage) or reserve(req, *args, **kwargs)
    msg = last_stage_backward("mb", MICROBATCH)
    first = await post_message(http_session, s.urls[1][0] + "/backward", msg, timeout_s=30)
    again = await post_message(http_session, s.urls[1][0] + "/backward", msg, timeout_s=30)
    assert first["accumulated"] is True and again["accumulated"] is False and "complete" not in again
    assert asked == [1]
    assert counter.stages[1].reserved == {0: MICROBATCH} and not counter.stages[1].closed(0)
    assert s.stages[1][0][RUNTIME].pending_samples == MICROBATCH


async def test_a_replica_killed_while_its_stage_all_reduces_is_left_out_and_training_goes_on(swarm, http_session):
    steps, global_batch = 6, 4 * MICROBATCH
    s = await swarm([2, 1], global_batch=global_batch, wire_codec="fp32", step_timeout_s=4.0)
    survivor, victim = s.stages[0]
    victim_url = s.urls[0][1]
    taken: list[int] = []
    real_start = victim[AVERAGER_KEY].start

    real_take = victim[RUNTIME].take_gradients
    loop, gradient_taken = asyncio.get_running_loop(), asyncio.Event()

    def take(step=None):  # on the compute worker: what the victim puts into the round it dies in
        got = real_take(step)
        if len(taken) == 1:
            taken.append(got.samples)
            loop.call_soon_threadsafe(gradient_taken.set)
        return got

    victim[RUNTIME].take_gradients = take

    def start_then_die(spec):  # the victim dies as a round of its stage begins, with samples of that step
        real_start(spec)
        if spec.kind == "step" and spec.step >= 1 and not taken and victim[RUNTIME].pending(spec.step):
            taken.append(spec.step)
            asyncio.get_running_loop().create_task(die())

    # as a process killed mid-round: its round cut short once it took its gradient (a graceful stop would
    # finish it), then gone, and its lease run out at the coordinator (this test's lease is 180 s: a killed
    # victim that held the whole step would otherwise keep it closed, as live, past the trainers' patience)
    async def die():
        await asyncio.wait_for(gradient_taken.wait(), 30)
        await victim[AVERAGER_KEY].close()
        await s.servers[victim_url].close()
        s.coordinator[REGISTRY].deregister(victim[MEMBERSHIP].server_id)

    victim[AVERAGER_KEY].start = start_then_die
    before = flat_parameters(survivor[RUNTIME].params)
    # two trainers, one through each replica of stage 0 (until it is gone: then the survivor)
    routes = [[[s.urls[0][0]], s.urls[1]], [[victim_url, s.urls[0][0]], s.urls[1]]]
    runs = [
        trainer(
            http_session, urls, steps=steps, global_batch=global_batch, in_flight=1, shard=(t, 2), trainer_id=f"t{t}"
        )
        for t, urls in enumerate(routes)
    ]
    runs[1].client.balancer.report_success(
        0, s.urls[0][0], 10.0, 1, "forward"
    )  # the survivor looks slow to this trainer: it goes to the victim first
    summaries = await asyncio.gather(*(t.run() for t in runs))
    await settled(s)

    assert taken, f"the victim never held samples of a step as its round began: {victim[RUNTIME].stats}"
    died_in, held = taken
    assert survivor[RUNTIME].step == steps and s.stages[1][0][RUNTIME].step == steps
    assert not torch.equal(before, flat_parameters(survivor[RUNTIME].params))
    # What it had accumulated for later steps when it died is lost too: a backward of the next step that it
    # answered before its end, or while it stopped (a run here saw 4 samples of the next step go with it).
    later = {k: n for k in range(died_in + 1, steps) if (n := victim[RUNTIME].pending(k))}
    counter = s.coordinator[STEPS].counter.stages[0]
    assert counter.samples_dropped == held + sum(later.values()), later  # exactly what the dead replica held

    def went_on_without(n: int) -> list[int]:
        """The batch of a step whose samples the victim held ``n`` of: the step went on without
        them; if it held them all, nothing was left to step with (a step of no samples is
        never taken): the step filled again."""
        return [global_batch - n] if n < global_batch else [global_batch]

    assert s.batches[(0, died_in + 1)] == went_on_without(held)  # the step it died in
    for k, n in later.items():  # and the later steps it held samples of
        assert s.batches[(0, k + 1)] == went_on_without(n), (k, n)
    whole = [k for k in range(1, steps + 1) if k != died_in + 1 and k - 1 not in later]
    assert all(s.batches[(0, k)] == [global_batch] * len(s.batches[(0, k)]) for k in whole)
    assert all(x.microbatches_failed == 0 for x in summaries)


async def test_a_checkpoint_holds_every_stage_at_one_global_step(swarm, http_session, tmp_path):
    """Asked while the trainer runs, the checkpoint waits for the stages behind the furthest one."""
    steps, global_batch = 6, 2 * MICROBATCH
    s = await swarm([1, 1, 1], global_batch=global_batch, wire_codec="fp32", checkpoint_dir=str(tmp_path))
    run = asyncio.create_task(trainer(http_session, s.urls, steps=steps, global_batch=global_batch, in_flight=2).run())
    saved = []
    while not run.done() and len(saved) < 3:  # checkpoints taken while the stages step
        async with http_session.post(s.coordinator_url + "/checkpoint", json={}) as resp:
            assert resp.status == 200, await resp.text()
            saved.append((await resp.json())["step"])
    await run
    await settled(s)
    async with http_session.post(s.coordinator_url + "/checkpoint", json={}) as resp:
        saved.append((await resp.json())["step"])
    assert saved[-1] == steps, (saved, [g[0][RUNTIME].step for g in s.stages], s.coordinator[STEPS].counter.view())
    for path in sorted(tmp_path.glob("step-*")):
        meta = checkpoint.read_meta(path)
        assert set(meta["stage_steps"].values()) == {meta["step"]}, meta  # every stage at the checkpoint's step


async def test_without_the_coordinator_each_replica_steps_alone_on_its_share(swarm, http_session):
    """The coordinator goes away mid-run: a stage of one replica goes on stepping exactly
    every global batch, on its own."""
    global_batch = 2 * MICROBATCH
    s = await swarm([1, 1], global_batch=global_batch, wire_codec="fp32")
    await trainer(http_session, s.urls, steps=3, global_batch=global_batch, in_flight=2).run()
    await settled(s)
    await s.coordinator_server.close()
    run = trainer(http_session, s.urls, steps=8, global_batch=global_batch, in_flight=2, trainer_id="t1")
    run.start_step = 3  # the swarm's step: the run goes on from there
    summary = await run.run()
    assert summary.microbatches_failed == 0
    assert [g[0][RUNTIME].step for g in s.stages] == [8, 8], (
        [g[0][RUNTIME].stats for g in s.stages],
        {k: v for k, v in s.batches.items() if k[1] > 3},
    )
    assert all(
        s.batches[(stage, k)] == [global_batch] for stage in range(2) for k in range(4, 9)
    )  # every step alone: exactly the global batch
