"""PipelineClient: one microbatch forward through the stages and backward again, over HTTP.

The trainer relays tensors without decoding them: a stage's ``outputs`` (as they came
off the wire) are the next stage's ``inputs``, a stage's ``grad_inputs`` the previous
stage's ``grad_outputs``. It keeps every stage's input until that stage's backward is
done, so a backward can go to any replica (stateless backward) and a failed hop is
retried on another replica with the same input.

The last stage gets one call, ``/backward``: it recomputes its forward, returns the loss
and the gradient of its input. Evaluation calls ``/forward`` on every stage with
``eval: true``.

Each forward answer carries the stage's global step; the backward of that stage sends it
back (``forward_step``). A stage that stepped more than ``SWARM_MAX_STALENESS`` times since
refuses the backward (409 ``stale_forward``): the microbatch runs again from stage 0,
counted as a re-run, at most ``MAX_RERUNS`` times.

``routing="chain"`` (``SWARM_ROUTING``, the trainer's default; this class's is relay): the
trainer picks a replica for every stage (and up to ``CHAIN_ALTERNATES`` alternates each)
with the same wiring, and sends the route with the token ids to the stage-0 replica, one
``POST /chain``; the stage servers pass activations
and gradients to each other (``services/stage_server/chain.py``) and stage 0 answers with
the loss and every hop's timings, which the wiring learns from as from its own calls. A
chain broken where no alternate could take over (502 ``chain_broken``) runs again from
stage 0 like a stale one, counted as a re-run, with the replicas that failed banned and the
others kept (a stage that already accumulated the microbatch recognises it). The trainer
then decodes nothing and holds only token ids.

A stage none of whose replicas is usable (each failed and is banned, or the registry lists
none: its servers were preempted and are restarting, or being replaced) is an outage, not
a reason to fail microbatches: with ``HopTimeouts.stage_wait_s`` (``SWARM_STAGE_WAIT_S``)
a hop, or a chain re-run, waits for a replica of that stage to become usable again (a ban
runs out, the registry lists a new one) for up to that long, and the failures meanwhile do
not count against its retries. Past it, they count as before and the microbatch fails.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp

from services.trainer.data import Microbatch
from shared.codec import encode_tensor, pack_message
from shared.errors import RemoteError
from shared.http import MICROBATCH_HEADER, post_message
from shared.retry import RetryPolicy
from shared.wiring import NoReplica, ReplicaBalancer

MAX_RERUNS = 8  # times a microbatch runs again from the start after a stale backward or a broken chain
CHAIN_ALTERNATES = 2  # replicas per later stage a chain may fall back on, besides its choice
ROUTINGS = ("relay", "chain")
MAX_OVERLOAD_WAITS = 30  # 503 "overloaded" answers a hop waits out (Retry-After) before they count as failures
MAX_OVERLOAD_WAIT_S = 5.0
STAGE_POLL_S = 1.0  # during an outage, how often the registry is read again (bans are waited out to the instant)


class MicrobatchFailed(Exception):
    """A microbatch whose hop failed on every try; the trainer reports it."""

    def __init__(self, index: int, stage: int, path: str, errors: list[RemoteError]):
        super().__init__(f"microbatch {index}: {path} on stage {stage} failed {len(errors)} times; last: {errors[-1]}")
        self.index, self.stage, self.path, self.errors = index, stage, path, errors


class StaleMicrobatch(Exception):
    """A stage refused a backward (its forward is too many steps old), or a chain broke where
    no alternate could take over: run the microbatch again. ``stages``: the stages whose
    replicas failed on the way (a broken chain's)."""

    def __init__(self, message: str, stages: tuple[int, ...] = ()):
        super().__init__(message)
        self.stages = stages


@dataclass(frozen=True)
class TrainResult:
    loss: float  # mean over the microbatch's tokens
    loss_step: int  # the global step whose batch the microbatch was in, as the last stage counted it
    swarm_step: int  # stage 0's step when its backward answered (the last stage of a global batch to step)
    reruns: int = 0  # times the microbatch ran again after a stale backward
    complete: bool = False  # stage 0 had every step of the run (until_step) reserved: it took nothing of this one


@dataclass(frozen=True)
class HopTimeouts:
    forward_s: float = 30.0
    backward_s: float = 60.0
    stage_wait_s: float = (
        0.0  # how long a stage with no usable replica is waited for (0: not at all; see the module docstring)
    )

    def chain_s(self, num_stages: int) -> float:
        """A whole chain's budget: half a hop's forward and backward timeouts per stage (the
        relay gives every hop its own); the servers split it along the chain."""
        return num_stages * (self.forward_s + self.backward_s) / 2


class Outage:
    """The time one microbatch may spend waiting for stages with no usable replica: it
    starts with the first wait and lasts ``wait_s`` (0: no waiting)."""

    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.wait_s, self.clock, self.started = wait_s, clock, None

    def running(self) -> bool:
        """Still time to wait (starting the clock at the first call)."""
        if self.wait_s <= 0:
            return False
        if self.started is None:
            self.started = self.clock()
        return self.left_s() > 0

    def waited_s(self) -> float:
        return 0.0 if self.started is None else self.clock() - self.started

    def left_s(self) -> float:
        return self.wait_s - self.waited_s()


class PipelineClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        balancer: ReplicaBalancer,
        *,
        run_id: str,
        codec: str,
        until_step: int | None = None,
        timeouts: HopTimeouts = HopTimeouts(),
        retry: RetryPolicy = RetryPolicy(),
        log=None,
        on_stage_empty: Callable[[int], Awaitable[None]] | None = None,
        client_id: str = "",
        telemetry=None,
        routing: str = "relay",
    ):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r} (setting SWARM_ROUTING)")
        self.session, self.balancer, self.run_id = session, balancer, run_id
        self.codec, self.timeouts, self.retry, self.log = codec, timeouts, retry, log
        self.until_step = until_step  # the run's last global step: stages refuse gradients past it
        self.on_stage_empty = on_stage_empty  # e.g. refresh the registry view at once
        self.client_id = client_id or uuid.uuid4().hex[:8]  # microbatch ids stay unique across trainers
        self.num_stages = balancer.num_stages
        self.telemetry = telemetry  # a TrainerTelemetry: hops, bytes and microbatches counted
        self.routing = routing
        self._routes: dict[
            int, list[str]
        ] = {}  # chain routing: a microbatch's replicas of stages 1.., kept for its re-runs

    def microbatch_id(self, index: int) -> str:
        """The id of the run's microbatch ``index`` as this trainer sends it (its re-runs keep it)."""
        return f"{self.run_id}:{self.client_id}:{index}"

    async def train(
        self, mb: Microbatch, seed: int, on_loss: Callable[[int], None] | None = None, step: int | None = None
    ) -> TrainResult:
        """Forward and backward one microbatch, again from the start if a stage finds its
        forward too old (at most ``MAX_RERUNS`` times); raises :class:`MicrobatchFailed`.
        ``on_loss(loss_step)``: called when the last stage has answered, before the stages
        below run their backwards. ``step``: the global step the coordinator admitted it for
        (every stage reserves that step for it); None: the stages' next open step."""
        train_once = functools.partial(self._train_chain if self.routing == "chain" else self._train_once, step=step)
        runs = counted = 0  # re-runs in all, and those that count against MAX_RERUNS (not waiting out an outage)
        outage = Outage(self.timeouts.stage_wait_s)
        while counted <= MAX_RERUNS:
            try:
                loss, loss_step, swarm_step, complete = await train_once(mb, seed, on_loss, outage)
                if self.telemetry:
                    self.telemetry.microbatch_done(mb.num_tokens)
                self._routes.pop(mb.index, None)
                return TrainResult(loss, loss_step, swarm_step, runs, complete)
            except StaleMicrobatch as exc:
                runs += 1
                if self.telemetry:
                    self.telemetry.microbatch_rerun()
                if self.log:
                    self.log.info("microbatch.rerun", microbatch=mb.index, rerun=runs, reason=str(exc))
                error = exc
                down = [s for s in exc.stages if not self.balancer.has_usable(s)]
                if not (down and await self._wait_out(outage, down, mb)):
                    counted += 1
        self._routes.pop(mb.index, None)
        if self.telemetry:
            self.telemetry.microbatch_failed()
        raise MicrobatchFailed(
            mb.index,
            0,
            "/backward",
            [RemoteError("pipeline", 409, "stale_forward", f"{runs} runs were all stale or broken: {error}")],
        )

    async def _wait_out(self, outage: Outage, stages: list[int], mb: Microbatch) -> bool:
        """Wait while ``stages`` have no usable replica, within ``outage``'s time; True if
        the outage is still being waited out (what failed meanwhile does not count)."""
        if not outage.running():
            return False
        if self.log:
            self.log.warning(
                "stage.outage",
                microbatch=mb.index,
                stages=stages,
                waited_s=round(outage.waited_s(), 1),
                wait_s=self.timeouts.stage_wait_s,
            )
        for stage in stages:
            await self._await_stage(stage, outage)
        return True

    async def _await_stage(self, stage: int, outage: Outage) -> None:
        """Until ``stage`` has a usable replica (a ban ran out, the registry lists a new
        replica) or ``outage`` runs out."""
        while not self.balancer.has_usable(stage) and outage.running():
            if self.on_stage_empty:
                await self.on_stage_empty(stage)
                if self.balancer.has_usable(stage):
                    return
            ban_left = self.balancer.next_usable_in(stage)
            await asyncio.sleep(
                max(0.0, min(outage.left_s(), STAGE_POLL_S, STAGE_POLL_S if ban_left is None else ban_left))
            )

    async def _train_once(
        self, mb: Microbatch, seed: int, on_loss: Callable[[int], None] | None, outage: Outage, step: int | None
    ) -> tuple[float, int, int, bool]:
        mb_id = self.microbatch_id(mb.index)
        base = {"run_id": self.run_id, "microbatch_id": mb_id, "seed": seed, "codec": self.codec}
        if self.until_step is not None:
            base["until_step"] = self.until_step
        if step is not None:
            base["admitted_step"] = step
        last = self.num_stages - 1
        targets = encode_tensor(mb.targets, "raw")
        stage_inputs = [encode_tensor(mb.inputs, "raw")]
        forward_steps = []
        for stage in range(last):
            msg = {**base, "stage": stage, "inputs": stage_inputs[stage]}
            outputs, step = await self._call(mb, stage, "/forward", msg, _outputs, outage=outage)
            stage_inputs.append(outputs)
            forward_steps.append(step)
        msg = {**base, "stage": last, "inputs": stage_inputs[last], "targets": targets}
        loss, grad, loss_step, swarm_step, complete = await self._call(
            mb, last, "/backward", msg, _loss_and_grad if last else _loss_only, outage=outage
        )
        if on_loss:
            on_loss(loss_step)
        for stage in range(last - 1, -1, -1):
            stage_inputs[stage + 1] = None  # no longer needed: free it early
            msg = {
                **base,
                "stage": stage,
                "inputs": stage_inputs[stage],
                "grad_outputs": grad,
                "forward_step": forward_steps[stage],
            }
            grad, swarm_step, complete = await self._call(
                mb, stage, "/backward", msg, _grad_inputs if stage else _nothing, outage=outage
            )
        return loss, loss_step, swarm_step, complete

    async def _train_chain(
        self, mb: Microbatch, seed: int, on_loss: Callable[[int], None] | None, outage: Outage, step: int | None
    ) -> tuple[float, int, int, bool]:
        """One run of the microbatch down a chain of stage servers and back (see the module's docstring)."""
        msg = {"run_id": self.run_id, "microbatch_id": self.microbatch_id(mb.index), "seed": seed, "codec": self.codec}
        if self.until_step is not None:
            msg["until_step"] = self.until_step
        if step is not None:
            msg["admitted_step"] = step
        reply = await self._chain(mb, msg, _chain_trained, outage)
        loss, loss_step, swarm_step, complete = reply
        if on_loss:
            on_loss(loss_step)
        return loss, loss_step, swarm_step, complete

    async def _chain(self, mb: Microbatch, msg: dict, read: Callable[[dict], Any], outage: Outage | None = None) -> Any:
        """POST ``msg`` down a chain (stage 0 chosen by :meth:`_call`, the later stages here) and
        learn from the answer."""
        batch = mb.inputs.shape[0]
        preferred = self._routes.get(mb.index) or []
        down = [stage for stage in range(1, self.num_stages) if not self.balancer.has_usable(stage)]
        if (
            down
        ):  # every replica of a later stage failed lately: wait for one (bounded), rather than send a chain that breaks
            await self._wait_out(outage or Outage(self.timeouts.stage_wait_s), down, mb)
        route = []
        for stage in range(1, self.num_stages):
            keep = preferred[stage - 1] if stage - 1 < len(preferred) else None
            url = (
                keep
                if keep in self.balancer.usable(stage)
                else self.balancer.choose(stage, kind="chain", batch_size=batch)
            )
            route.append([url, *self.balancer.alternates(stage, url, CHAIN_ALTERNATES)])
        if not msg.get("eval"):
            self._routes[mb.index] = [replicas[0] for replicas in route]
        body = {
            **msg,
            "stage": 0,
            "inputs": encode_tensor(mb.inputs, "raw"),
            "targets": encode_tensor(mb.targets, "raw"),
            "route": route,
            "budget_s": self.timeouts.chain_s(self.num_stages),
        }
        reply = await self._call(mb, 0, "/chain", body, lambda r: (r, read(r)), measure=False, outage=outage)
        answer, result = reply
        self._learn(answer, batch)
        return result

    def _learn(self, reply: dict, batch: int) -> None:
        """The chain's timings per replica into the wiring, its failures as bans."""
        hops = reply.get("hops") if isinstance(reply.get("hops"), list) else []
        for hop in hops:
            if (
                not isinstance(hop, dict)
                or type(hop.get("stage")) is not int
                or not 0 < hop["stage"] < self.num_stages
                or not isinstance(hop.get("replica"), str)
            ):
                continue
            for kind in ("forward", "backward"):
                seconds = hop.get(f"{kind}_s")
                if isinstance(seconds, (int, float)) and seconds > 0:
                    self.balancer.report_success(hop["stage"], hop["replica"], float(seconds), batch, kind)
        self._ban(reply.get("rerouted"))

    def _ban(self, failed) -> tuple[int, ...]:
        """Ban the replicas a chain's answer names as failed; returns their stages."""
        stages = []
        for f in failed if isinstance(failed, list) else []:
            if (
                isinstance(f, dict)
                and type(f.get("stage")) is int
                and 0 <= f["stage"] < self.num_stages
                and isinstance(f.get("replica"), str)
            ):
                self.balancer.report_failure(f["stage"], f["replica"])
                stages.append(f["stage"])
                if self.log:
                    self.log.warning("chain.rerouted", stage=f["stage"], replica=f["replica"], code=f.get("code"))
        return tuple(sorted(set(stages)))

    async def evaluate(self, mb: Microbatch, seed: int) -> float:
        """Forward only (no gradients, nothing cached on the servers); returns the loss."""
        base = {
            "run_id": self.run_id,
            "microbatch_id": f"{self.run_id}:{self.client_id}:eval:{mb.index}",
            "seed": seed,
            "codec": self.codec,
            "eval": True,
        }
        if self.routing == "chain":
            return await self._chain(mb, base, _loss)
        x = encode_tensor(mb.inputs, "raw")
        for stage in range(self.num_stages - 1):
            x, _ = await self._call(mb, stage, "/forward", {**base, "stage": stage, "inputs": x}, _outputs)
        msg = {**base, "stage": self.num_stages - 1, "inputs": x, "targets": encode_tensor(mb.targets, "raw")}
        loss, *_ = await self._call(mb, self.num_stages - 1, "/forward", msg, _loss_only)
        return loss

    async def _call(
        self,
        mb: Microbatch,
        stage: int,
        path: str,
        msg: dict,
        read: Callable[[dict], Any],
        measure: bool = True,
        outage: Outage | None = None,
    ) -> Any:
        """One hop, retried on other replicas of the stage; ``read`` checks the reply and picks
        out what the caller needs. Raises :class:`MicrobatchFailed` when every try failed.
        ``measure``: the call's time is the replica's (not so for a whole chain). ``outage``:
        the microbatch's time to wait for a stage with no usable replica (default: the hop's own)."""
        kind = {"/forward": "forward", "/backward": "backward", "/chain": "chain"}[path]
        timeout_s = {"forward": self.timeouts.forward_s, "backward": self.timeouts.backward_s}.get(kind) or msg[
            "budget_s"
        ]
        batch = mb.inputs.shape[0]
        body = pack_message(msg)  # packed once, resent as is on a retry
        headers = {MICROBATCH_HEADER: msg["microbatch_id"]}  # the servers bind it in their log lines
        tried: list[str] = []
        errors: list[RemoteError] = []
        # A failure uses up one of max_retries; a 503 "overloaded" does not (up to
        # MAX_OVERLOAD_WAITS of them): the replica is healthy but busy, and its Retry-After
        # says when to come back, so a burst of trainers waits instead of losing work.
        failures = overloads = 0
        wait_s = 0.0
        outage = outage or Outage(self.timeouts.stage_wait_s)
        while failures <= self.retry.max_retries:
            attempt = failures + overloads
            if wait_s:
                await asyncio.sleep(wait_s)
            if not self.balancer.has_usable(stage) and self.on_stage_empty:
                await self.on_stage_empty(stage)
            try:
                url = self.balancer.choose(stage, kind=kind, batch_size=batch, exclude=tried)
            except NoReplica:
                errors.append(RemoteError(f"stage {stage}", None, "no_replica", "no replica of this stage is known"))
                if await self._wait_out(outage, [stage], mb):
                    wait_s = 0.0
                    continue
                failures += 1
                wait_s = self.retry.delay_s(failures)
                continue
            started = time.monotonic()
            try:
                reply = await post_message(
                    self.session, url + path, msg, timeout_s=timeout_s, body=body, headers=headers
                )
                result = read(reply)
            except RemoteError as err:
                err.url = url
                if self.telemetry:
                    self.telemetry.hop(stage, kind, time.monotonic() - started, err.code, msg)
                errors.append(err)
                tried.append(url)
                if err.code in (
                    "stale_forward",
                    "chain_broken",
                ):  # no replica can take this backward, or the chain broke further down: start over
                    raise StaleMicrobatch(str(err), self._ban(err.details.get("failed"))) from None
                if err.retryable:  # the replica's fault (down, overloaded, moved): ban it for a while
                    self.balancer.report_failure(stage, url)
                if self.log:
                    self.log.warning(
                        "hop.failed",
                        microbatch=msg["microbatch_id"],
                        stage=stage,
                        path=path,
                        replica=url,
                        status=err.status,
                        code=err.code,
                        attempt=attempt,
                    )
                if not err.retryable:
                    break
                if err.code == "overloaded" and overloads < MAX_OVERLOAD_WAITS:
                    overloads += 1
                    wait_s = min(MAX_OVERLOAD_WAIT_S, max(err.retry_after_s or 0.0, self.retry.delay_s(1)))
                elif not self.balancer.has_usable(stage) and await self._wait_out(outage, [stage], mb):
                    wait_s = 0.0  # the stage's every replica failed: waited for one, the failure not counted
                else:
                    failures += 1
                    wait_s = self.retry.delay_s(failures)
                continue
            seconds = time.monotonic() - started
            waited = reply.get("step_wait_s", 0.0)  # waiting for the swarm's global step: not this replica's speed
            if measure:
                self.balancer.report_success(
                    stage,
                    url,
                    max(seconds - waited, 1e-6) if isinstance(waited, (int, float)) else seconds,
                    batch,
                    kind,
                )
            else:  # a chain: stage 0's own share of it, as the server measured it
                for k in ("forward", "backward"):
                    if isinstance(reply.get(f"{k}_s"), (int, float)) and reply[f"{k}_s"] > 0:
                        self.balancer.report_success(stage, url, float(reply[f"{k}_s"]), batch, k)
            if self.telemetry:
                self.telemetry.hop(stage, kind, seconds, "ok", msg, reply)
            if self.log:
                self.log.debug(
                    "hop.done",
                    microbatch=msg["microbatch_id"],
                    stage=stage,
                    path=path,
                    replica=url,
                    seconds=round(seconds, 6),
                )
            return result
        if self.telemetry and not msg.get("eval"):
            self.telemetry.microbatch_failed()
        raise MicrobatchFailed(mb.index, stage, path, errors)


def _tensor(reply: dict, name: str) -> dict:
    value = reply.get(name)
    if not isinstance(value, dict):
        raise RemoteError("reply", 200, "bad_reply", f"reply lacks tensor {name!r}")
    return value


def _step(reply: dict, name: str = "step") -> int:
    value = reply.get(name)
    if type(value) is not int or value < 0:
        raise RemoteError("reply", 200, "bad_reply", f"reply carries no {name!r}: {value!r}")
    return value


def _loss(reply: dict) -> float:
    loss = reply.get("loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise RemoteError("reply", 200, "bad_reply", f"reply carries no finite loss: {loss!r}")
    return float(loss)


def _outputs(reply: dict) -> tuple[dict, int]:
    """A forward: the outputs and the step they were computed at."""
    return _tensor(reply, "outputs"), _step(reply)


def _grad_inputs(reply: dict) -> tuple[dict, int, bool]:
    """A middle stage's backward: the input gradient, the stage's step now, whether the run's
    steps were all reserved."""
    return _tensor(reply, "grad_inputs"), _step(reply, "stage_step"), reply.get("complete") is True


def _loss_and_grad(reply: dict) -> tuple[float, dict, int, int, bool]:
    """The last stage's backward: loss, input gradient, the step of its batch, its step now, complete."""
    return (
        _loss(reply),
        _tensor(reply, "grad_inputs"),
        _batch_step(reply),
        _step(reply, "stage_step"),
        reply.get("complete") is True,
    )


def _loss_only(reply: dict) -> tuple[float, None, int, int, bool]:
    """A one-stage pipeline's backward, or the last stage's evaluation forward."""
    return (
        _loss(reply),
        None,
        _batch_step(reply),
        _step(reply, "stage_step") if "stage_step" in reply else _step(reply),
        reply.get("complete") is True,
    )


def _batch_step(reply: dict) -> int:
    """The global step whose gradient the backward went into (an older server: the step it ran at)."""
    return _step(reply, "bucket") if type(reply.get("bucket")) is int and reply["bucket"] >= 0 else _step(reply)


def _chain_trained(reply: dict) -> tuple[float, int, int, bool]:
    """A chain's answer from stage 0: the loss, the step of its batch, stage 0's step now, complete."""
    return _loss(reply), _step(reply, "loss_step"), _step(reply, "stage_step"), reply.get("complete") is True


def _nothing(reply: dict) -> tuple[None, int, bool]:
    """Stage 0's backward: the stage's step now, and whether the run's steps were all reserved."""
    return None, _step(reply, "stage_step"), reply.get("complete") is True
