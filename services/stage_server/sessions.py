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
    /session/step   {v, run_id, stage, session_id, position, inputs, chunks?, codec?}
                    -> {stage, session_id, position, step, weights_version, outputs | logits}
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


class SessionNotFound(SwarmError):
    """No such session here (never opened, closed, expired, or the server restarted)."""

    status = 404
    code = "session_not_found"


class SessionOutOfSync(SwarmError):
    """The client's position is not the session's length: the client replays the session."""

    status = 409
    code = "session_out_of_sync"


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
    async with session.lock:  # one step of a session at a time, in order
        if position != session.cache.length:
            raise SessionOutOfSync(
                f"session {session_id!r} holds {session.cache.length} "
                f"positions, the step starts at {position}: replay it"
            )
        output, step, version = await request.app[WORKER].run(
            _step, runtime, session.cache, inputs, chunks, work=inputs.shape[1] / 64
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
    if runtime.spec.is_last:
        reply["logits"] = encode_tensor(output[:, -1].float().contiguous(), "fp32")
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


def _step(runtime: StageRuntime, cache: KVCache, inputs: torch.Tensor, chunks: list[int]):
    """On the compute thread: the stage's forward of each chunk after the cached positions."""
    model = runtime.model
    inputs = inputs.long() if runtime.spec.is_first else inputs.to(runtime.param_dtype)
    was_training = model.training
    model.eval()  # no dropout; the training forward (same thread) sets it back below
    try:
        with torch.no_grad(), runtime.precision():
            start, output = 0, None
            for n in chunks:
                output = model(inputs[:, start : start + n], None, cache)
                start += n
    finally:
        model.train(was_training)
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
