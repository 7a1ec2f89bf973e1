"""HTTP handlers of the stage server: decode, hand to the compute worker, encode.

Request bodies (msgpack maps, see ``shared.codec``)::

    /forward  {v, run_id?, stage, microbatch_id, seed, codec?, eval?, admitted_step?, inputs, targets?}
              -> {stage, microbatch_id, step, step_wait_s, outputs} or, on the last stage, {..., loss}
    /backward {v, run_id?, stage, microbatch_id, seed, codec?, forward_step?, until_step?, admitted_step?,
               inputs, targets?, grad_outputs?}
              -> {stage, microbatch_id, step, stage_step, bucket, accumulated, step_wait_s,
                  complete?, grad_inputs?, loss?}

``step`` is the stage's global step (weights version) the computation ran at, ``stage_step``
the stage's step when the backward answers (one more when it completed a global batch),
``bucket`` the global step whose gradient this backward went into, ``step_wait_s`` the
seconds it waited for the global step (a reservation held, the step of the batch it
completed; a forward: the step a backward here closed, or a step round still applying
here): not this replica's speed, and the trainer's balancer leaves it out. A backward
gives the ``step`` of its forward here as ``forward_step``; one more than
``SWARM_MAX_STALENESS`` steps away is refused with 409 ``stale_forward`` (run the
microbatch again). ``accumulated: false``: this microbatch's gradient was already
accumulated here (a retried backward); its input gradient is returned all the same.
``until_step``: the trainer's run ends at that global step; once its steps are all
reserved at this stage, the backward computes the input gradient, accumulates nothing,
and answers ``complete: true``. ``admitted_step``: the global step the coordinator admitted
the microbatch for (the trainer's admission); its gradient goes into no earlier step.

``GET /metrics`` (Prometheus text) is added by the app factory (``shared.metrics``).

``codec`` picks the codec of the reply's tensors (default: the server's ``wire_codec``);
``eval: true`` marks a forward that no backward follows (nothing is cached for it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import random
import time
from dataclasses import asdict, dataclass

import torch
from aiohttp import web

from services.stage_server.metrics import STAGE_METRICS
from services.stage_server.move import MoveOrder
from services.stage_server.runtime import NO_BUCKET, ComputeWorker, StageRuntime
from shared import WIRE_VERSION, package_version
from shared.codec import FLOAT_CODECS, decode_tensor, encode_tensor
from shared.config import StageServerSettings
from shared.errors import BadPayload, WrongStage
from shared.http import MSGPACK, msgpack_response, read_message
from shared.step_protocol import Verdict

SETTINGS = web.AppKey("settings", StageServerSettings)
STEPPER = web.AppKey("stepper")  # stepping.StepClient; absent without a coordinator (the runtime steps on its own)
RUNTIME = web.AppKey("runtime", StageRuntime)
WORKER = web.AppKey("worker", ComputeWorker)
MOVE = web.AppKey("move", MoveOrder)
SESSIONS = web.AppKey("sessions")  # services.stage_server.sessions.SessionStore

MAX_ID_LEN = 128
OFF_LOOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class StageRequest:
    microbatch_id: str
    seed: int
    reply_codec: str
    eval: bool
    inputs: torch.Tensor
    targets: torch.Tensor | None
    grad_outputs: torch.Tensor | None
    forward_step: int | None = None
    until_step: int | None = None
    admitted_step: int | None = None  # the global step the coordinator admitted the microbatch for


async def _parse(request: web.Request, *, backward: bool) -> StageRequest:
    settings = request.app[SETTINGS]
    msg = await read_message(request, int(settings.max_body_mb * 2**20))
    return await parse_message(request, msg, names=["inputs", "targets"] + (["grad_outputs"] if backward else []))


def check_stage_and_run(settings: StageServerSettings, msg: dict) -> None:
    """:class:`BadPayload` or :class:`WrongStage` unless ``msg`` is for this server's stage and run."""
    stage = msg.get("stage")
    if type(stage) is not int:
        raise BadPayload("'stage' must be an int")
    if stage != settings.stage:
        raise WrongStage(f"this server holds stage {settings.stage}, not {stage}")
    run_id = msg.get("run_id", settings.run_id)
    if run_id != settings.run_id:
        raise WrongStage(f"this server belongs to run {settings.run_id!r}, not {run_id!r}")


async def parse_message(request: web.Request, msg: dict, *, names: list[str]) -> StageRequest:
    """Check a /forward, /backward or /chain message against this server and decode its
    tensors ``names`` (``inputs`` first); raises :class:`BadPayload` or :class:`WrongStage`."""
    settings = request.app[SETTINGS]
    check_stage_and_run(settings, msg)
    mb_id, seed = msg.get("microbatch_id"), msg.get("seed", 0)
    if not isinstance(mb_id, str) or not 0 < len(mb_id) <= MAX_ID_LEN:
        raise BadPayload(f"'microbatch_id' must be a string of 1..{MAX_ID_LEN} characters")
    if type(seed) is not int or not 0 <= seed < 2**63:
        raise BadPayload("'seed' must be an int in [0, 2**63)")
    codec = msg.get("codec", settings.wire_codec)
    if codec not in FLOAT_CODECS:
        raise BadPayload(f"'codec' must be one of {FLOAT_CODECS}, got {codec!r}")
    is_eval = msg.get("eval", False)
    if type(is_eval) is not bool:
        raise BadPayload("'eval' must be a bool")
    forward_step, until_step, admitted_step = msg.get("forward_step"), msg.get("until_step"), msg.get("admitted_step")
    for name, value in (("forward_step", forward_step), ("admitted_step", admitted_step)):
        if value is not None and (type(value) is not int or not 0 <= value < 2**53):
            raise BadPayload(f"'{name}' must be an int >= 0")
    if until_step is not None and (type(until_step) is not int or not 1 <= until_step < 2**53):
        raise BadPayload("'until_step' must be an int >= 1")
    device = request.app[RUNTIME].device
    body_bytes = (
        request.content_length if request.content_length is not None else OFF_LOOP_BYTES
    )  # chunked: assume large
    tensors = await _off_loop(body_bytes, _decode_all, msg, names, device)
    request.app[STAGE_METRICS].count_tensors("in", msg)
    if not is_eval and not request.app[RUNTIME].spec.is_first:  # the inputs are the previous stage's activations
        request.app[STAGE_METRICS].note_activation(msg["inputs"], _samples(tensors[0]))
    return StageRequest(
        mb_id,
        seed,
        codec,
        is_eval,
        *tensors,
        forward_step=forward_step,
        until_step=until_step,
        admitted_step=admitted_step,
    )


def _samples(inputs: torch.Tensor) -> int:
    return int(inputs.shape[0]) if inputs.dim() else 0


def _decode_all(msg: dict, names: list[str], device: torch.device) -> list[torch.Tensor | None]:
    out = [decode_tensor(msg[n], name=n, device=device) if msg.get(n) is not None else None for n in names]
    if out[0] is None:
        raise BadPayload("'inputs' is missing")
    return out + [None] * (3 - len(out))


async def _off_loop(nbytes: int, fn, *args):
    """Codec work on large tensors runs in a thread so the event loop stays responsive;
    small ones run inline, where a thread hop would cost more than the work."""
    if nbytes >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _encode(t: torch.Tensor, codec: str, int8_block: int) -> dict:
    return await _off_loop(
        t.numel() * t.element_size(), functools.partial(encode_tensor, int8_block=int8_block), t, codec
    )


async def forward(request: web.Request) -> web.Response:
    req = await _parse(request, backward=False)
    reply = await run_forward(request.app, req)
    request.app[STAGE_METRICS].count_tensors("out", reply)
    return _respond(request.app[SETTINGS], reply)


async def run_forward(app: web.Application, req: StageRequest) -> dict:
    """The stage's forward of ``req`` on the compute worker; the reply: ``{stage,
    microbatch_id, step}`` and ``outputs`` (encoded), or ``loss`` on the last stage."""
    runtime, settings = app[RUNTIME], app[SETTINGS]
    stepper = app.get(STEPPER)
    waited = 0.0
    if stepper:  # the step a backward here closed, settling in the background: on its weights
        asked = time.perf_counter()
        await stepper.settled()
        if not req.eval:  # and on those of a step round still applying here that its admission counts on
            await stepper.hold_for(req.admitted_step)
        waited = time.perf_counter() - asked

    def compute():
        return runtime.forward(
            req.microbatch_id, req.seed, req.inputs, req.targets, keep_graph=not req.eval
        ), runtime.step

    output, step = await app[WORKER].run(compute)
    reply = {"stage": settings.stage, "microbatch_id": req.microbatch_id, "step": step, "step_wait_s": round(waited, 6)}
    if runtime.spec.is_last:
        reply["loss"] = float(output)
    else:
        reply["outputs"] = await _encode(output, req.reply_codec, settings.int8_block)
        if not req.eval:
            app[STAGE_METRICS].note_activation(reply["outputs"], _samples(req.inputs))
    return reply


async def backward(request: web.Request) -> web.Response:
    req = await _parse(request, backward=True)
    reply = await run_backward(request.app, req)
    request.app[STAGE_METRICS].count_tensors("out", reply)
    return _respond(request.app[SETTINGS], reply)


async def run_backward(app: web.Application, req: StageRequest) -> dict:
    """The stage's backward of ``req`` (its gradient accumulated into the global step the
    coordinator reserves, at most once per microbatch id); the reply of ``/backward``.

    Where the reservation cannot change the weights the gradient is computed on (the forward
    ran here already, or runs now in a step that is open here), the gradient is computed
    while the coordinator answers the reservation, so that the coordinator's round trip is
    off each stage's backward path: the compute job accumulates it at once if the answer
    came meanwhile, else a short job does once it comes (``StepClient.early`` bounds the
    computed gradients that wait for their answer at once)."""
    runtime, settings, worker = app[RUNTIME], app[SETTINGS], app[WORKER]
    stepper = app.get(STEPPER)
    held = 0.0
    if stepper and req.forward_step is None:  # its forward runs here now (the last stage): as in run_forward
        asked = time.perf_counter()
        await stepper.hold_for(req.admitted_step)
        held = time.perf_counter() - asked
    if stepper and req.forward_step is not None:
        runtime.check_staleness(
            req.microbatch_id, req.forward_step
        )  # before a reservation: a stale backward takes none
    duplicate = (
        runtime.accumulated_in(req.microbatch_id) is not None
    )  # a retry or a re-run of a microbatch already here: it takes no reservation (giving one back reopens a step)
    work = 3.0 if runtime.spec.is_last else 2.0  # the last stage's backward includes its forward
    args = (req.microbatch_id, req.seed, req.inputs, req.targets, req.grad_outputs, req.forward_step)
    answer, waited = None, held
    reserve = (
        functools.partial(stepper.reserve, _samples(req.inputs), req.until_step, req.microbatch_id, req.admitted_step)
        if stepper and not duplicate
        else None
    )
    if reserve is None:
        result = await worker.run(runtime.backward, *args, work=work)
    elif _computes_early(runtime, req) and not stepper.early.locked():
        async with stepper.early:
            answer, result, waited = await _backward_while_reserving(reserve, args, work, stepper, runtime, worker)
    else:
        asked = time.perf_counter()
        answer = await reserve()
        waited = time.perf_counter() - asked
        result = await _given_back_on_failure(
            worker.run(runtime.backward, *args, *_placement(answer), work=work), answer, stepper, worker
        )
    reservation = answer if _is_reservation(answer) else None
    if reservation:
        samples = _samples(req.inputs) if result.accumulated else 0
        if reservation.closes and not runtime.spec.is_first:  # its gradient is awaited upstream: step beside it
            stepper.settle_soon(reservation, samples, worker.run)
        else:
            settled = time.perf_counter()
            await stepper.settle(reservation, samples, worker.run)
            waited += time.perf_counter() - settled
    reply: dict = {
        "stage": settings.stage,
        "microbatch_id": req.microbatch_id,
        "step": result.step,
        "stage_step": runtime.step,
        "accumulated": result.accumulated,
        "bucket": _holder(result, reservation),
        "step_wait_s": round(waited, 6),
    }
    if answer is Verdict.COMPLETE:  # the run's steps are all reserved
        reply["complete"] = True
    if result.grad_inputs is not None:
        reply["grad_inputs"] = await _encode(result.grad_inputs, req.reply_codec, settings.int8_block)
    if result.loss is not None:
        reply["loss"] = result.loss
    return reply


def _computes_early(runtime: StageRuntime, req: StageRequest) -> bool:
    """Whether the backward may be computed before its reservation is answered: its forward
    ran here (its weights are fixed), or runs now on a stage at or past the microbatch's
    admitted step (a reservation that waited for the stage to step would have it run on
    newer weights)."""
    return req.forward_step is not None or (req.admitted_step is not None and req.admitted_step <= runtime.step)


def _is_reservation(answer) -> bool:
    """A reservation's answer that holds a place in a step (not a :class:`Verdict` refusing one)."""
    return answer is not None and not isinstance(answer, Verdict)


def _placement(answer) -> tuple[int | None, bool]:
    """(bucket, late_to_current) of ``StageRuntime.accumulate`` for a reservation's answer:
    a refusal (COMPLETE, or DUPLICATE on another replica) accumulates nothing; a step this
    replica counts alone (the coordinator away) is never dropped."""
    if answer is None:
        return None, False
    if isinstance(answer, Verdict):
        return NO_BUCKET, False
    return answer.bucket, bool(answer.alone)


async def _give_back(answer, stepper, worker) -> None:
    """The reservation ``answer`` (if it is one) goes back: 0 samples, its step opens again."""
    if _is_reservation(answer):
        await stepper.settle(answer, 0, worker.run)


async def _given_back_on_failure(job, answer, stepper, worker):
    """Await ``job``; if it fails, the reservation ``answer`` goes back."""
    try:
        return await job
    except BaseException:
        await _give_back(answer, stepper, worker)
        raise


async def _backward_while_reserving(reserve, args: tuple, work: float, stepper, runtime, worker) -> tuple:
    """(the reservation's answer, the backward's result, the seconds it waited for the answer
    beyond its compute): the reservation asked for while the gradient is computed."""
    answered: concurrent.futures.Future = concurrent.futures.Future()  # read by the compute thread

    def copy(task: asyncio.Task) -> None:
        if task.cancelled():
            answered.cancel()
        elif task.exception() is not None:
            answered.set_exception(task.exception())
        else:
            answered.set_result(task.result())

    asking = asyncio.ensure_future(reserve())
    asking.add_done_callback(copy)

    def job():
        computed = runtime.compute_backward(*args)
        if answered.done() and not answered.cancelled() and answered.exception() is None:
            return computed, runtime.accumulate(computed, *_placement(answered.result()))
        return computed, None

    try:
        computed, result = await worker.run(job, work=work)
    except BaseException:  # nothing was accumulated: the reservation, once answered, goes back
        with contextlib.suppress(Exception):
            await _give_back(await asking, stepper, worker)
        raise
    computed_at = time.perf_counter()
    answer = await asking
    waited = time.perf_counter() - computed_at
    if result is None:  # the gradient is computed: a full queue or a drain does not refuse its accumulation
        result = await _given_back_on_failure(
            worker.run(runtime.accumulate, computed, *_placement(answer), work=0.0, bounded=False),
            answer,
            stepper,
            worker,
        )
    return answer, result, waited


def _holder(result, reservation) -> int:
    """The global step whose batch holds the microbatch: where a duplicate went the first time,
    else the step it was reserved for (the trainer files its loss under it)."""
    if result.bucket is not None:
        return result.bucket
    return reservation.bucket if reservation else result.step


def _respond(settings: StageServerSettings, reply: dict) -> web.Response:
    """The reply; with fault injection (``inject.garbage``), sometimes random bytes of its length instead."""
    response = msgpack_response(reply)
    if settings.inject.garbage and random.random() < settings.inject.garbage:
        return web.Response(body=os.urandom(len(response.body)), content_type=MSGPACK)
    return response


async def health(request: web.Request) -> web.Response:
    worker, runtime = request.app[WORKER], request.app[RUNTIME]
    return web.json_response(
        {
            "status": "draining" if worker.draining else "ok",
            "stage": request.app[SETTINGS].stage,
            "queue_depth": worker.queue_depth,
            "weights_version": runtime.version,
            "step": runtime.step,
            "stats": asdict(runtime.stats),
            "utilisation": request.app[STAGE_METRICS].utilisation.report(),  # MFU and its peak's source
            "sessions": request.app[SESSIONS].summary() if SESSIONS in request.app else None,
        },
        status=503 if worker.draining else 200,
    )


async def info(request: web.Request) -> web.Response:
    settings, runtime = request.app[SETTINGS], request.app[RUNTIME]
    return web.json_response(
        {
            "run_id": settings.run_id,
            "stage": settings.stage,
            "num_stages": settings.num_stages,
            "layers": [runtime.spec.layers.start, runtime.spec.layers.stop],
            "model": settings.model,
            "model_config": runtime.cfg.to_dict(),
            "parameters": sum(p.numel() for p in runtime.params),  # trainable (with LoRA: the adapters')
            "lora": None
            if runtime.lora_report is None
            else {
                **runtime.lora.to_dict(),
                "base_dtype": runtime.lora.base_dtype,
                "targets": len(runtime.lora_report.targets),
                "frozen_parameters": runtime.lora_report.frozen,
                "base_fingerprint": runtime.lora_report.base_fingerprint,
            },
            "wire_codec": settings.wire_codec,
            "int8_block": settings.int8_block,
            "wire_version": WIRE_VERSION,
            "routings": ["relay", "chain"],  # /forward + /backward, and /chain
            "global_batch": settings.global_batch,
            "max_staleness": settings.max_staleness,
            "device": str(runtime.device),
            "version": package_version(),
        }
    )


async def move(request: web.Request) -> web.Response:
    """``POST /move`` {run_id, stage, to_stage} from the coordinator: leave this stage for another.

    Answers {stage, to_stage} at once; the server's main loop then drains, deregisters and
    starts again as a server of ``to_stage`` (the steps: ``move.py``). A repeated order
    answers the stage of the first."""
    settings = request.app[SETTINGS]
    msg = await read_message(request, 64 * 1024)
    if msg.get("run_id") != settings.run_id or msg.get("stage") != settings.stage:
        raise WrongStage(f"this server holds stage {settings.stage} of run {settings.run_id!r}")
    to_stage = msg.get("to_stage")
    if type(to_stage) is not int or not 0 <= to_stage < settings.num_stages or to_stage == settings.stage:
        raise BadPayload(f"'to_stage' must be another stage in [0, {settings.num_stages}), got {to_stage!r}")
    return msgpack_response({"stage": settings.stage, "to_stage": request.app[MOVE].order(to_stage)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/forward", forward)
    app.router.add_post("/backward", backward)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_post("/move", move)
