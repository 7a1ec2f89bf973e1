"""The OpenAI-compatible API of the coordinator: text generation through the live swarm.

::

    GET  /v1/models                -> {object: "list", data: [{id: <run_id>, object: "model", created,
                                       owned_by: "swarm-mesh"}]}
    GET  /v1/models/{model}        -> that model, or 404 model_not_found
    POST /v1/completions           {model, prompt, max_tokens?, temperature?, top_p?, seed?, stop?, stream?,
                                    stream_options?}
    POST /v1/chat/completions      {model, messages: [{role, content}], max_tokens? (or max_completion_tokens?),
                                    ... as above}

The model is the run: its id is the coordinator's run id (SWARM_RUN_ID). Replies are
OpenAI's: a ``text_completion`` / ``chat.completion`` object with ``usage`` {prompt_tokens,
completion_tokens, total_tokens}, or with ``stream: true`` server-sent events, ``data:
{chunk}\\n\\n`` each (``choices[0].text`` / ``choices[0].delta.content``), a last chunk with
the ``finish_reason`` ("stop": a stop string or the end-of-text token ended it; "length":
``max_tokens`` did), a usage chunk if ``stream_options.include_usage``, then ``data: [DONE]``.
A failure after the stream began is one ``data: {"error": ...}`` event that ends it.

Parameters: ``prompt`` a string (or a list of one); ``max_tokens`` 1 .. the model's
block_size minus the prompt's tokens (default 16 for completions, the rest of the context
for chat, as OpenAI); ``temperature`` 0..2 (default 1; 0: greedy); ``top_p`` (0, 1];
``seed``; ``stop`` a string or up to 4. ``n``, ``best_of`` other than 1, ``echo``,
``suffix``, ``logprobs``, penalties, ``logit_bias`` and tools are refused with 400
(never silently ignored); other unknown fields are ignored.

Chat template: plain text, one line per message and the assistant's turn open at the end,
whatever the tokenizer (a Hugging Face tokenizer's own chat template is not used)::

    system: You are terse.
    user: Hello
    assistant:

("developer" messages count as "system"); the answer ends at "\\nuser:" (the model
writing the next turn), besides the request's stop strings.

Generation: the registry's replicas (``swarm_view``) fill a :class:`ReplicaBalancer`; the
model's config comes from a stage server's ``GET /info`` (kept until the registry's
replicas change or a generation fails); the tokenizer is SWARM_TOKENIZER, else the
servers' model directory's if it exists here, else bytes for a 256-token vocabulary. A
:class:`~shared.inference.SwarmSession` (fp32 hidden states: greedy text equals one
process's) of ``max_length`` prompt + max_tokens runs the decoding, failing over between
replicas and re-reading the registry when a stage runs out of them; it is closed at the
end, also when the client goes away mid-stream. An empty prompt starts from the
end-of-text token (the document separator); a tokenizer with a distinct beginning-of-text
token gets it first.

Auth: with a swarm secret, /v1/* wants ``Authorization: Bearer <the secret>`` (401
otherwise) instead of the swarm's HMAC signature; without one they are open like the rest
of an unsigned swarm. Limits: SWARM_MAX_GENERATIONS at once (429 past it), bodies of 64 KiB.
Errors are OpenAI's ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from services.coordinator.openai_format import OpenAIError, ReplyFormat, event, parse_request, sampling_params, usage
from services.coordinator.routes import LOG, MAX_BODY_BYTES, SETTINGS, swarm_view
from shared.config import CoordinatorSettings
from shared.errors import RemoteError, SwarmError
from shared.hf import is_hf_dir
from shared.http import get_json, swarm_session
from shared.inference import SamplingParams, SessionFailed, SwarmSession, TextStream, generate
from shared.model import ModelConfig, config_from_dict
from shared.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from shared.wiring import ReplicaBalancer

API_PREFIX = "/v1/"
OWNER = "swarm-mesh"
INFO_TIMEOUT_S, INFO_TRIES = 5.0, 3
STEP_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ the swarm's model
@dataclass(frozen=True)
class SwarmModel:
    """What generation needs of the run's model (from a stage server's GET /info)."""

    config: ModelConfig
    tokenizer: ByteTokenizer | HFTokenizer
    replicas: tuple[tuple[str, ...], ...]  # the registry's replicas it was read under

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode_batch([text])[0]
        bos = getattr(self.tokenizer, "bos_id", None)
        if bos is not None and bos != self.tokenizer.eos_id:
            return [bos, *ids]
        return ids or [self.tokenizer.eos_id]  # nothing to continue: start a document


class CompletionService:
    """The balancer over the registry's replicas, the model (cached until the replicas
    change or a generation fails) and the bound on generations running at once."""

    def __init__(self, settings: CoordinatorSettings, replicas: Callable[[], list[list[str]]], log):
        self.settings, self.replicas, self.log = settings, replicas, log
        self.balancer = ReplicaBalancer(settings.num_stages)
        self.created = int(time.time())
        self.active = 0
        self.http: aiohttp.ClientSession | None = None  # signed with the swarm secret; opened with the app
        self._model: SwarmModel | None = None
        self._tokenizer: tuple[tuple, ByteTokenizer | HFTokenizer] | None = None
        self._lock = asyncio.Lock()

    async def refresh(self) -> list[list[str]]:
        """Hand the registry's replicas to the balancer (also a SwarmSession's ``refresh``)."""
        replicas = self.replicas()
        for stage, urls in enumerate(replicas):
            self.balancer.set_replicas(stage, urls)
        return replicas

    @contextlib.contextmanager
    def slot(self):
        if self.active >= self.settings.max_generations:
            raise OpenAIError(
                429,
                (
                    f"{self.active} generations are running, the most this coordinator runs at once (setting "
                    "SWARM_MAX_GENERATIONS); retry shortly"
                ),
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    async def model(self) -> SwarmModel:
        replicas = await self.refresh()
        if empty := [stage for stage, urls in enumerate(replicas) if not urls]:
            raise OpenAIError(
                503,
                f"stage(s) {empty} have no live replica: nothing can generate until a stage server serves each",
                code="no_replicas",
            )
        key = tuple(tuple(urls) for urls in replicas)
        async with self._lock:
            if self._model is None or self._model.replicas != key:
                self._model = await self._read_model(key)
            return self._model

    def forget_model(self) -> None:
        self._model = None

    async def _read_model(self, replicas: tuple[tuple[str, ...], ...]) -> SwarmModel:
        errors = []
        for url in [url for urls in replicas for url in urls][:INFO_TRIES]:
            try:
                info = await get_json(self.http, url + "/info", timeout_s=INFO_TIMEOUT_S)
                config = config_from_dict(info["model_config"])
            except (RemoteError, KeyError, TypeError, ValueError) as exc:
                errors.append(f"{url}: {exc}")
                continue
            if info.get("run_id") != self.settings.run_id or info.get("num_stages") != self.settings.num_stages:
                errors.append(
                    f"{url} serves run {info.get('run_id')!r} in {info.get('num_stages')} stages, not "
                    f"{self.settings.run_id!r} in {self.settings.num_stages}"
                )
                continue
            return SwarmModel(config, self._tokenizer_for(str(info.get("model", "")), config), replicas)
        raise OpenAIError(
            503, f"no stage server gave the model's config (GET /info): {'; '.join(errors)}", code="model_unavailable"
        )

    def _tokenizer_for(self, model: str, config: ModelConfig) -> ByteTokenizer | HFTokenizer:
        key = (model, config)
        if self._tokenizer is None or self._tokenizer[0] != key:
            try:
                tokenizer = load_tokenizer(model if is_hf_dir(model) else "", self.settings.tokenizer, config)
            except ValueError as exc:
                raise OpenAIError(
                    503,
                    (
                        f"the completions endpoint has no tokenizer for this model: {exc} (the coordinator's setting "
                        "SWARM_TOKENIZER)"
                    ),
                    code="no_tokenizer",
                ) from None
            self._tokenizer = (key, tokenizer)
        return self._tokenizer[1]


class Generation:
    """One generation's text as it becomes final, its token count and why it ended.
    ``client_gone()`` is asked after every token: a client that went away ends it."""

    def __init__(
        self, tokens: AsyncIterator[int], text: TextStream, params: SamplingParams, client_gone: Callable[[], bool]
    ):
        self.tokens, self.text, self.params, self.client_gone = tokens, text, params, client_gone
        self.completion_tokens = 0
        self.abandoned = False  # the client went away before the end

    async def pieces(self) -> AsyncIterator[str]:
        """The new text after each token (never empty). OpenAIError 503 if the swarm failed;
        ConnectionResetError if the client went away."""
        try:
            async for token in self.tokens:
                self.completion_tokens += 1
                if self.client_gone():
                    raise ConnectionResetError("the client went away")
                if piece := self.text.push(token):
                    yield piece
                if self.text.stopped:
                    return
        except (SessionFailed, RemoteError) as exc:
            raise OpenAIError(
                503,
                f"the generation failed ({self.completion_tokens} tokens generated): {exc}",
                code="generation_failed",
            ) from None
        if tail := self.text.flush():
            yield tail

    @property
    def finish_reason(self) -> str:
        if self.abandoned:
            return "client_gone"  # only logged: nobody is there to read it
        return "length" if not self.text.stopped and self.completion_tokens >= self.params.max_tokens else "stop"


# ------------------------------------------------------------------ handlers
COMPLETIONS = web.AppKey("completions", CompletionService)


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def get_model(request: web.Request) -> web.Response:
    _check_model(request, request.match_info["model"])
    return web.json_response(_model_card(request))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


def _model_card(request: web.Request) -> dict:
    return {
        "id": request.app[SETTINGS].run_id,
        "object": "model",
        "created": request.app[COMPLETIONS].created,
        "owned_by": OWNER,
    }


def _check_model(request: web.Request, model) -> None:
    run_id = request.app[SETTINGS].run_id
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, f"model is missing: this swarm serves {run_id!r}", param="model")
    if model != run_id:
        raise OpenAIError(
            404,
            f"The model {model!r} does not exist: this swarm serves {run_id!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


async def _read_body(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(413, f"the body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object", code="invalid_json")
    return body


async def _complete(request: web.Request, *, chat: bool) -> web.StreamResponse:
    service, started = request.app[COMPLETIONS], time.perf_counter()
    body = await _read_body(request)
    _check_model(request, body.get("model"))
    req = parse_request(body, chat=chat)
    with service.slot():
        model = await service.model()
        ids = model.encode(req.prompt)
        params = sampling_params(req, len(ids), model.config.block_size)
        reply = ReplyFormat(
            chat, request.app[SETTINGS].run_id, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        )
        session = SwarmSession(
            service.http,
            service.balancer,
            run_id=request.app[SETTINGS].run_id,
            max_length=len(ids) + params.max_tokens,
            timeout_s=STEP_TIMEOUT_S,
            refresh=service.refresh,
            log=service.log,
        )
        gen = Generation(
            generate(session.step, ids, params, eos_id=model.tokenizer.eos_id),
            TextStream(model.tokenizer.decode, params.stop),
            params,
            client_gone=lambda: request.transport is None or request.transport.is_closing(),
        )
        try:
            async with session, contextlib.aclosing(gen.tokens), contextlib.aclosing(gen.pieces()) as pieces:
                if req.stream:
                    response = await _stream(
                        request, reply, gen, pieces, include_usage=req.include_usage, prompt_tokens=len(ids)
                    )
                else:
                    text = "".join([piece async for piece in pieces])
                    response = web.json_response(
                        reply.whole(text, gen.finish_reason, usage(len(ids), gen.completion_tokens))
                    )
        except OpenAIError:
            service.forget_model()  # the next request reads the model again
            raise
        except ConnectionResetError:  # nobody to answer
            gen.abandoned, response = True, web.Response(status=499, text="the client went away")
        except asyncio.CancelledError:  # the server stops, or cancels the handlers of clients that went away
            request.app[LOG].info("completion.cancelled", completion_tokens=gen.completion_tokens)
            raise
        request.app[LOG].info(
            "completion.done",
            chat=chat,
            stream=req.stream,
            prompt_tokens=len(ids),
            completion_tokens=gen.completion_tokens,
            finish_reason=gen.finish_reason,
            seconds=round(time.perf_counter() - started, 3),
            **session.stats.to_dict(),
        )
        return response


async def _stream(
    request: web.Request,
    reply: ReplyFormat,
    gen: Generation,
    pieces: AsyncIterator[str],
    *,
    include_usage: bool,
    prompt_tokens: int,
) -> web.StreamResponse:
    """Server-sent events as the text comes. The headers go once the first text is there (or
    the generation ended), so a swarm that cannot serve the prompt still answers 503."""
    first = await anext(pieces, None)
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    try:
        if first is not None or reply.chat:
            await response.write(reply.chunk(first or "", first=True))
        async for piece in pieces:
            await response.write(reply.chunk(piece))
        await response.write(reply.chunk(None, gen.finish_reason))
        if include_usage:
            await response.write(reply.usage_chunk(usage(prompt_tokens, gen.completion_tokens)))
        await response.write(event("[DONE]"))
        await response.write_eof()
    except OpenAIError as exc:  # the status is sent: the error goes as an event
        request.app[COMPLETIONS].forget_model()
        request.app[LOG].warning("completion.failed", error=exc.message, completion_tokens=gen.completion_tokens)
        with contextlib.suppress(ConnectionResetError):
            await response.write(event(exc.body()))
            await response.write_eof()
    except ConnectionResetError:  # from a write, or from the generation's check
        gen.abandoned = True
    return response


# ------------------------------------------------------------------ auth, errors, wiring
def is_api_path(path: str) -> bool:
    return path.startswith(API_PREFIX)


def openai_middleware(settings: CoordinatorSettings, log):
    """On /v1/ paths: the bearer check (with a swarm secret) and every refusal in OpenAI's
    shape. Goes after the swarm's error middleware and before its HMAC check (see :func:`outside_api`)."""
    secret = settings.secret_bytes()

    @web.middleware
    async def middleware(request: web.Request, handler):
        if not is_api_path(request.path):
            return await handler(request)
        try:
            if secret:
                _check_bearer(request, secret)
            return await handler(request)
        except OpenAIError as exc:
            log.info("request.refused", path=request.path, status=exc.status, code=exc.code, reason=exc.message)
            return error_response(exc)
        except SwarmError as exc:
            return error_response(OpenAIError(exc.status, exc.message, code=exc.code))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(
                OpenAIError(
                    exc.status,
                    exc.reason or "refused",
                    code={404: "not_found", 405: "method_not_allowed"}.get(exc.status),
                )
            )
        except Exception as exc:  # a bug: log it whole, answer 500 in the API's shape, keep serving
            log.exception("request.crashed", path=request.path, error=repr(exc))
            return error_response(OpenAIError(500, repr(exc)))

    return middleware


def error_response(exc: OpenAIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


def _check_bearer(request: web.Request, secret: bytes) -> None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), secret):
        raise OpenAIError(
            401,
            "this swarm has a secret: send it as the API key (`Authorization: Bearer <SWARM_SECRET>`)",
            code="invalid_api_key",
        )


def outside_api(middlewares: list) -> list:
    """``middlewares`` (the swarm's HMAC signature check) skipped on /v1/ paths, which a
    bearer token guards instead (:func:`openai_middleware`): OpenAI clients cannot sign."""

    def skip_api(inner):
        @web.middleware
        async def middleware(request: web.Request, handler):
            if is_api_path(request.path):
                return await handler(request)
            return await inner(request, handler)

        return middleware

    return [skip_api(m) for m in middlewares]


def add_completion_routes(app: web.Application) -> None:
    """The /v1/ routes, and their client session to the stage servers (signed like the coordinator's own)."""
    settings = app[SETTINGS]
    app[COMPLETIONS] = CompletionService(
        settings, lambda: [[r["url"] for r in s["replicas"]] for s in swarm_view(app)["stages"]], app[LOG]
    )

    async def client(app: web.Application):
        async with swarm_session(settings) as http:
            app[COMPLETIONS].http = http
            yield

    app.cleanup_ctx.append(client)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
