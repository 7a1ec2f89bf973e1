"""Inference sessions: a stage server keeps the attention cache of one generation.

A client (``shared.inference``) opens a session on one replica of every stage; each server
keeps the keys and values of its layers for the session's positions (``shared.kv_cache``),
so a step sends only the new tokens' hidden states and gets the next ones: the time per
token does not grow with the context the way a forward of the whole prefix does. The last
stage answers the logits of the last position. Sessions never touch the weights, the
gradients or the optimizer: a step runs on the compute worker like training work (in
arrival order, so it never races an optimizer step), in eval mode and without autograd.

Weights: a session is not pinned to a weights version. A step runs with the weights the
stage has when it runs; its answer says which (``step``, the stage's global step, and
``weights_version``), and so does the client's result. While a run trains, a session's
early positions may thus have been computed with older weights than its late ones.

Requests (msgpack)::

    /session/open   {v, run_id, stage, session_id, batch, max_length}
                    -> {stage, session_id, step, weights_version, bytes}
    /session/step   {v, run_id, stage, session_id, position, inputs, chunks?, codec?,
                     targets?, top_logprobs?, logits_at?}     (the last three: last stage only)
                    -> {stage, session_id, position, step, weights_version, outputs | logits,
                        target_logprobs?, top_ids?, top_logprobs?}
    /session/close  {v, run_id, stage, session_id} -> {stage, session_id, closed}

``position`` is the number of positions the client believes the session holds; another
number answers 409 ``session_out_of_sync`` (the client replays the session). ``inputs``:
token ids (batch, T) on stage 0, hidden states (batch, T, d_model) after. ``chunks``: run
the inputs as consecutive steps of these lengths (summing to T) in one request, as a
client replays a session into a new replica exactly as it was computed the first time;
the answer is the last chunk's. ``logits``: (batch, vocab) of the last position, always
fp32. ``outputs``: (batch, T_last_chunk, d_model) in ``codec`` (default fp32: a
session's tensors are small, and greedy decoding through the swarm then equals one
process's).

Scoring (the last stage; a prefill of prompts to score, as the coordinator's
``/v1/completions`` with ``echo`` and ``logprobs`` sends them): ``targets`` (batch,
T_last_chunk) ints, the token each position is scored against (the next one of the
sequence; -1: none), asks for ``target_logprobs`` (batch, T) fp32, the log-probability of
each target (0 where none), and, with ``top_logprobs`` N in [1, 20], ``top_ids`` (batch, T,
N) and ``top_logprobs`` (batch, T, N) fp32: each position's N most likely next tokens, most
likely first. ``logits_at`` (one position per row of the last chunk) moves ``logits`` to
those positions: rows of different lengths padded to one. Every position of the request
is computed in one pass, on one weights version of the stage.

Memory: a session's cache is sized at open (``max_length`` positions, ``kv_cache_bytes``)
and counted against ``SWARM_SESSION_MEMORY_MB`` (all sessions of the server) and
``SWARM_SESSION_MAX_MB`` (one session); past either, the open is refused (503
``overloaded`` with Retry-After, or 400 for a session larger than any allowed) before
anything is allocated. A session idle for ``SWARM_SESSION_TTL_S`` is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from aiohttp import web

from services.stage_server.routes import RUNTIME, SESSIONS, SETTINGS, WORKER, check_stage_and_run
from services.stage_server.runtime import StageRuntime
from shared.codec import FLOAT_CODECS, decode_tensor, encode_tensor
from shared.config import StageServerSettings
from shared.errors import BadPayload, Overloaded, SwarmError
from shared.http import msgpack_response, read_message
from shared.kv_cache import KVCache, kv_cache_bytes

MAX_SESSION_ID_LEN = 128
MAX_TOP_LOGPROBS = 20
SCORE_POSITIONS = 256  # positions per log-softmax while scoring: bounds its (positions, vocab) buffer


class SessionNotFound(SwarmError):
    """No such session here (never opened, closed, expired, or the server restarted)."""

    status = 404
    code = "session_not_found"


class SessionOutOfSync(SwarmError):
    """The client's position is not the session's length: the client replays the session."""

    status = 409
    code = "session_out_of_sync"


@dataclass(frozen=True)
class Scoring:
    """What the last stage answers of a step: the logits at ``logits_at`` (batch,), and with
    ``targets`` (batch, T) the log-probabilities of each position's target and its ``top`` alternatives."""

    logits_at: torch.Tensor
    targets: torch.Tensor | None = None
    top: int = 0

    def answer(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """The reply's tensors from the last chunk's ``logits`` (batch, T, vocab)."""
        rows = torch.arange(logits.shape[0], device=logits.device)
        out = {"logits": logits[rows, self.logits_at].float()}
        if self.targets is None:
            return out
        B, T = self.targets.shape
        target_logprobs = torch.zeros(B, T, device=logits.device)
        top_ids = torch.zeros(B, T, self.top, dtype=torch.long, device=logits.device)
        top_logprobs = torch.zeros(B, T, self.top, device=logits.device)
        for b in range(B):
            for start in range(0, T, SCORE_POSITIONS):
                block = torch.log_softmax(logits[b, start : start + SCORE_POSITIONS].float(), dim=-1)  # (t, vocab)
                targets = self.targets[b, start : start + SCORE_POSITIONS]
                picked = block.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                target_logprobs[b, start : start + SCORE_POSITIONS] = torch.where(targets >= 0, picked, 0.0)
                if self.top:
                    values, ids = block.topk(self.top, dim=-1)
                    top_logprobs[b, start : start + SCORE_POSITIONS] = values
                    top_ids[b, start : start + SCORE_POSITIONS] = ids
        out["target_logprobs"] = target_logprobs
        if self.top:
            out.update(top_ids=top_ids, top_logprobs=top_logprobs)
        return out


def _scoring(runtime: StageRuntime, msg: dict, inputs: torch.Tensor, chunks: list[int]) -> Scoring | None:
    """The scoring fields of a step (None on a stage before the last); BadPayload if malformed."""
    asked = [name for name in ("targets", "top_logprobs", "logits_at") if msg.get(name) is not None]
    if not runtime.spec.is_last:
        if asked:
            raise BadPayload(f"{asked} are for the last stage, not stage {runtime.spec.index}")
        return None
    B, T = int(inputs.shape[0]), chunks[-1]
    logits_at = msg.get("logits_at")
    if logits_at is None:
        logits_at = [T - 1] * B
    if (
        not isinstance(logits_at, list)
        or len(logits_at) != B
        or any(type(i) is not int or not 0 <= i < T for i in logits_at)
    ):
        raise BadPayload(f"'logits_at' must be a list of {B} positions in [0, {T}) of the last chunk")
    at = torch.tensor(logits_at, dtype=torch.long, device=inputs.device)
    if msg.get("targets") is None:
        if msg.get("top_logprobs") is not None:
            raise BadPayload("'top_logprobs' needs 'targets'")
        return Scoring(at)
    targets = decode_tensor(msg["targets"], name="targets", device=inputs.device)
    if targets.is_floating_point() or targets.dtype == torch.bool or list(targets.shape) != [B, T]:
        raise BadPayload(f"'targets' must be integer token ids of shape [{B}, {T}], got {list(targets.shape)}")
    vocab = runtime.cfg.vocab_size
    if targets.numel() and not (int(targets.min()) >= -1 and int(targets.max()) < vocab):
        raise BadPayload(f"'targets' must lie in [0, {vocab}), or be -1 (none)")
    top = msg.get("top_logprobs") or 0
    if type(top) is not int or not 0 <= top <= min(MAX_TOP_LOGPROBS, vocab):
        raise BadPayload(f"'top_logprobs' must be an int in [0, {min(MAX_TOP_LOGPROBS, vocab)}], got {top!r}")
    return Scoring(at, targets.long(), top)


@dataclass
class Session:
    session_id: str
    batch: int
    max_length: int
    nbytes: int
    cache: KVCache
    last_used: float
    steps: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionStore:
    """The sessions of one server, bounded in memory, closed after ``ttl_s`` idle."""

    def __init__(
        self, *, memory_bytes: int, session_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.memory_bytes, self.session_bytes, self.ttl_s, self.clock = memory_bytes, session_bytes, ttl_s, clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.opened = self.closed = self.expired = self.refused = 0

    @property
    def reserved_bytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str, batch: int, max_length: int, nbytes: int) -> Session:
        """A new session (an existing one of that id is replaced: the client starts it again)."""
        self.expire()
        self.close(session_id)
        if nbytes > self.session_bytes or nbytes > self.memory_bytes:
            self.refused += 1
            limit = min(self.session_bytes, self.memory_bytes)
            raise BadPayload(
                f"a session of batch {batch} and {max_length} positions needs {nbytes / 2**20:.1f} MiB of KV cache "
                f"here, more than any session may hold ({limit / 2**20:.1f} MiB: SWARM_SESSION_MAX_MB, "
                "SWARM_SESSION_MEMORY_MB)"
            )
        if self.reserved_bytes + nbytes > self.memory_bytes:
            self.refused += 1
            raise Overloaded(
                f"sessions hold {self.reserved_bytes / 2**20:.1f} of {self.memory_bytes / 2**20:.1f} MiB here "
                f"(SWARM_SESSION_MEMORY_MB); this one needs {nbytes / 2**20:.1f} MiB",
                retry_after_s=1.0,
            )
        session = Session(session_id, batch, max_length, nbytes, KVCache(max_length), self.clock())
        self._sessions[session_id] = session
        self.opened += 1
        return session

    def get(self, session_id: str) -> Session:
        self.expire()
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(
                f"no session {session_id!r} here (never opened, closed, "
                "idle past SWARM_SESSION_TTL_S, or the server restarted)"
            )
        session.last_used = self.clock()
        self._sessions.move_to_end(session_id)
        return session

    def close(self, session_id: str) -> bool:
        if self._sessions.pop(session_id, None) is None:
            return False
        self.closed += 1
        return True

    def summary(self) -> dict:
        """What ``GET /health`` shows of the sessions."""
        return {
            "open": len(self),
            "reserved_mb": round(self.reserved_bytes / 2**20, 3),
            "limit_mb": round(self.memory_bytes / 2**20, 3),
            "opened": self.opened,
            "closed": self.closed,
            "expired": self.expired,
            "refused": self.refused,
        }

    def expire(self) -> int:
        """Close the sessions idle for ``ttl_s``; how many."""
        now, gone = self.clock(), 0
        while self._sessions:
            sid, oldest = next(iter(self._sessions.items()))
            if now - oldest.last_used < self.ttl_s or oldest.lock.locked():
                break
            del self._sessions[sid]
            self.expired += 1
            gone += 1
        return gone


def _check_header(settings: StageServerSettings, msg: dict) -> str:
    check_stage_and_run(settings, msg)
    session_id = msg.get("session_id")
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
        raise BadPayload(f"'session_id' must be a string of 1..{MAX_SESSION_ID_LEN} characters")
    return session_id


def _int(msg: dict, name: str, low: int, high: int) -> int:
    value = msg.get(name)
    if type(value) is not int or not low <= value <= high:
        raise BadPayload(f"'{name}' must be an int in [{low}, {high}], got {value!r}")
    return value


async def open_session(request: web.Request) -> web.Response:
    settings, runtime = request.app[SETTINGS], request.app[RUNTIME]
    msg = await read_message(request, 64 * 1024)
    session_id = _check_header(settings, msg)
    batch = _int(msg, "batch", 1, 1024)
    max_length = _int(msg, "max_length", 1, runtime.cfg.block_size)
    element = torch.finfo(runtime.param_dtype).bits // 8
    nbytes = kv_cache_bytes(runtime.cfg, len(runtime.spec.layers), batch, max_length, element_size=element)
    request.app[SESSIONS].open(session_id, batch, max_length, nbytes)
    return msgpack_response(
        {
            "stage": settings.stage,
            "session_id": session_id,
            "step": runtime.step,
            "weights_version": runtime.version,
            "bytes": nbytes,
        }
    )


async def step_session(request: web.Request) -> web.Response:
    settings, runtime, store = request.app[SETTINGS], request.app[RUNTIME], request.app[SESSIONS]
    msg = await read_message(request, int(settings.max_body_mb * 2**20))
    session_id = _check_header(settings, msg)
    codec = msg.get("codec", "fp32")
    if codec not in FLOAT_CODECS:
        raise BadPayload(f"'codec' must be one of {FLOAT_CODECS}, got {codec!r}")
    if msg.get("inputs") is None:
        raise BadPayload("'inputs' is missing")
    session = store.get(session_id)
    position = _int(msg, "position", 0, session.max_length)
    inputs = decode_tensor(msg["inputs"], name="inputs", device=runtime.device)
    chunks = _chunks(msg.get("chunks"), inputs)
    _validate(runtime, session, inputs, position)
    scoring = _scoring(runtime, msg, inputs, chunks)
    async with session.lock:  # one step of a session at a time, in order
        if position != session.cache.length:
            raise SessionOutOfSync(
                f"session {session_id!r} holds {session.cache.length} "
                f"positions, the step starts at {position}: replay it"
            )
        output, step, version = await request.app[WORKER].run(
            _step, runtime, session.cache, inputs, chunks, scoring, work=inputs.shape[0] * inputs.shape[1] / 64
        )
        session.steps += 1
        session.last_used = store.clock()
    reply = {
        "stage": settings.stage,
        "session_id": session_id,
        "position": session.cache.length,
        "step": step,
        "weights_version": version,
    }
    if scoring is not None:
        reply.update({name: encode_tensor(t.contiguous(), "fp32") for name, t in output.items()})
    else:
        reply["outputs"] = encode_tensor(output.contiguous(), codec, int8_block=settings.int8_block)
    return msgpack_response(reply)


def _chunks(chunks, inputs: torch.Tensor) -> list[int]:
    T = int(inputs.shape[1]) if inputs.dim() >= 2 else 0
    if chunks is None:
        return [T]
    if (
        not isinstance(chunks, list)
        or not chunks
        or any(type(c) is not int or c < 1 for c in chunks)
        or sum(chunks) != T
    ):
        raise BadPayload(f"'chunks' must be a list of positive ints summing to the {T} positions of 'inputs'")
    return chunks


def _validate(runtime: StageRuntime, session: Session, inputs: torch.Tensor, position: int) -> None:
    runtime.validate_inputs(inputs)
    if inputs.shape[0] != session.batch or inputs.shape[1] < 1:
        raise BadPayload(f"the session was opened for batch {session.batch}; got inputs of shape {list(inputs.shape)}")
    if position + inputs.shape[1] > session.max_length:
        raise BadPayload(
            f"{position} + {inputs.shape[1]} positions exceed the session's max_length {session.max_length}"
        )


def _step(runtime: StageRuntime, cache: KVCache, inputs: torch.Tensor, chunks: list[int], scoring: Scoring | None):
    """On the compute thread: the stage's forward of each chunk after the cached positions;
    on the last stage, what ``scoring`` asks of the last chunk's logits."""
    model, stats, started = runtime.model, runtime.stats, time.perf_counter()
    inputs = inputs.long() if runtime.spec.is_first else inputs.to(runtime.param_dtype)
    was_training = model.training
    model.eval()  # no dropout; the training forward (same thread) sets it back below
    try:
        with torch.no_grad(), runtime.precision():
            start, output = 0, None
            for n in chunks:
                cached = cache.length
                output = model(inputs[:, start : start + n], None, cache)
                start += n
                # the stage's model FLOPs (its MFU, services/stage_server/utilisation.py): n new
                # positions, each attending to the cached ones and to the new ones (the full
                # square, as training counts it)
                stats.tokens_inferred += inputs.shape[0] * n
                stats.token_pairs_inferred += inputs.shape[0] * n * (cached + n)
            if scoring is not None:
                output = scoring.answer(output)
    finally:
        model.train(was_training)
        stats.compute_s += time.perf_counter() - started
    return output, runtime.step, runtime.version


async def close_session(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    msg = await read_message(request, 64 * 1024)
    session_id = _check_header(settings, msg)
    return msgpack_response(
        {"stage": settings.stage, "session_id": session_id, "closed": request.app[SESSIONS].close(session_id)}
    )


def add_session_routes(app: web.Application, settings: StageServerSettings) -> None:
    app[SESSIONS] = SessionStore(
        memory_bytes=int(settings.session_memory_mb * 2**20),
        session_bytes=int(settings.session_max_mb * 2**20),
        ttl_s=settings.session_ttl_s,
    )

    async def expiry(app: web.Application):
        async def loop():
            while True:
                await asyncio.sleep(max(1.0, min(30.0, settings.session_ttl_s / 4)))
                app[SESSIONS].expire()

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(expiry)
    app.router.add_post("/session/open", open_session)
    app.router.add_post("/session/step", step_session)
    app.router.add_post("/session/close", close_session)
