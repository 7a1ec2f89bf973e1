"""The OpenAI-compatible API of the coordinator: text generation through the live swarm.

::

    GET  /v1/models                -> {object: "list", data: [{id: <run_id>, object: "model", created,
                                       owned_by: "swarm-mesh"}]}
    GET  /v1/models/{model}        -> that model, or 404 model_not_found
    POST /v1/completions           {model, prompt, max_tokens?, temperature?, top_p?, seed?, stop?, stream?,
                                    stream_options?, echo?, logprobs?}
    POST /v1/chat/completions      {model, messages: [{role, content}], max_tokens? (or max_completion_tokens?),
                                    ... as above but echo and logprobs}
    GET  /tokenizer_info           -> {eos_token, bos_token, pad_token, model_max_length, ...}
    POST /tokenize                 {prompt, add_special_tokens? (default true: the BOS, if any)}
                                   -> {tokens, count, max_model_len}
    POST /detokenize               {tokens} -> {prompt}

The model is the run: its id is the coordinator's run id (SWARM_RUN_ID). Replies are
OpenAI's: a ``text_completion`` / ``chat.completion`` object with ``usage`` {prompt_tokens,
completion_tokens, total_tokens}, or with ``stream: true`` server-sent events, ``data:
{chunk}\\n\\n`` each (``choices[0].text`` / ``choices[0].delta.content``), a last chunk with
the ``finish_reason`` ("stop": a stop string or the end-of-text token ended it; "length":
``max_tokens`` did), a usage chunk if ``stream_options.include_usage``, then ``data: [DONE]``.
A failure after the stream began is one ``data: {"error": ...}`` event that ends it.

Parameters: ``prompt`` a string, a list of strings, a list of token ids or a list of
lists of token ids (OpenAI's four forms; up to 256 prompts, one choice each, generated one
after the other; ``stream`` takes one); ``max_tokens`` 1 .. the model's block_size minus
the prompt's tokens (default 16 for completions, the rest of the context for chat, as
OpenAI); ``temperature`` 0..2 (default 1; 0: greedy); ``top_p`` (0, 1]; ``seed``; ``stop``
a string or up to 4. ``n``, ``best_of`` other than 1, ``suffix``, penalties,
``logit_bias`` and tools are refused with 400 (never silently ignored); other unknown
fields are ignored. Token ids are the model's as given: no beginning-of-text token is
added to them.

Scoring (lm-evaluation-harness' ``local-completions`` model sends ``echo: true,
logprobs: 1, max_tokens: 1`` with token ids for its log-likelihood tasks): ``echo`` and
``logprobs`` N (0..20) take ``max_tokens`` 0 or 1 and no ``stream``. Every prompt of the
request (at most the model's block_size tokens each; a text prompt is its tokens exactly,
no beginning-of-text token) goes through the swarm in ONE pass, a session of the whole
batch (``SwarmSession.score``): each stage computes every position of every prompt at
once, on one weights version of that stage (stages step apart while a run trains: the
log line ``completion.scored`` names their steps). With ``max_tokens`` 1 one token is
drawn from each prompt's last position. ``echo`` puts the prompt before the completion's
text, and with ``logprobs`` its tokens before the completion's in OpenAI's legacy
``logprobs`` object: ``tokens``, ``token_logprobs`` (the first prompt token's null),
``top_logprobs`` (N alternatives per token, as {token text: log-probability}; the first
null) and ``text_offset`` (see ``scoring.py``).

Tokenizer: ``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` are vLLM's, which
lm-eval's ``local-completions`` finds by itself (``tokenizer_backend=auto``, its default,
probes them): it then tokenizes with the swarm's own tokenizer, bytes for the byte-level
presets included, and needs no tokenizer files.

Chat template: plain text, one line per message and the assistant's turn open at the end,
whatever the tokenizer (a Hugging Face tokenizer's own chat template is not used)::

    system: You are terse.
    user: Hello
    assistant:

("developer" messages count as "system"); the answer ends at "\\nuser:" (the model
writing the next turn), besides the request's stop strings.

Generation (the plain objects in ``serving.py``): the registry's replicas (``swarm_view``)
fill a :class:`ReplicaBalancer`; the model's config comes from a stage server's ``GET
/info`` (kept until the registry's replicas change or a generation fails); the tokenizer
is SWARM_TOKENIZER, else the servers' model directory's if it exists here, else bytes for
a 256-token vocabulary. A
:class:`~shared.inference.SwarmSession` (fp32 hidden states: greedy text equals one
process's) of ``max_length`` prompt + max_tokens runs the decoding, failing over between
replicas and re-reading the registry when a stage runs out of them; it is closed at the
end, also when the client goes away mid-stream. An empty prompt starts from the
end-of-text token (the document separator); a tokenizer with a distinct beginning-of-text
token gets it first.

Auth: with a swarm secret, /v1/* and the tokenizer's paths want ``Authorization: Bearer
<the secret>`` (401 otherwise) instead of the swarm's HMAC signature; without one they are
open like the rest of an unsigned swarm. Limits: SWARM_MAX_GENERATIONS requests at once
(429 past it), bodies of 8 MiB (a batch of prompts as token ids; 413 past it). Errors are
OpenAI's ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from typing import AsyncIterator

from aiohttp import web

from services.coordinator.openai_format import (
    GenerationRequest,
    OpenAIError,
    Prompt,
    ReplyFormat,
    event,
    parse_request,
    sampling_params,
    scoring_params,
    usage,
)
from services.coordinator.routes import LOG, SETTINGS, swarm_view
from services.coordinator.scoring import ScoringBatch, choice_logprobs
from services.coordinator.serving import CompletionService, Generation, SwarmModel
from shared.config import CoordinatorSettings
from shared.errors import RemoteError, SwarmError
from shared.http import swarm_session
from shared.inference import SamplingParams, Scores, SessionFailed, SwarmSession, TextStream, generate, sample

API_PREFIX = "/v1/"
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's, which lm-eval's remote tokenizer calls
OWNER = "swarm-mesh"
MAX_API_BODY_BYTES = 8 * 2**20  # a batch of prompts as token ids (lm-eval's batch_size x context)
STEP_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ handlers
COMPLETIONS = web.AppKey("completions", CompletionService)


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def get_model(request: web.Request) -> web.Response:
    _check_model(request, request.match_info["model"])
    return web.json_response(_model_card(request))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def tokenizer_info(request: web.Request) -> web.Response:
    return web.json_response((await request.app[COMPLETIONS].model()).tokenizer_info())


async def tokenize(request: web.Request) -> web.Response:
    body = await _read_body(request)
    text, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(text, str):
        raise OpenAIError(400, f"prompt must be a string, got {type(text).__name__}", param="prompt")
    if not isinstance(special, bool):
        raise OpenAIError(400, f"add_special_tokens must be a boolean, got {special!r}", param="add_special_tokens")
    model = await request.app[COMPLETIONS].model()
    ids = model.tokenize(text, bos=special)
    return web.json_response({"count": len(ids), "max_model_len": model.config.block_size, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    body = await _read_body(request)
    model = await request.app[COMPLETIONS].model()
    tokens, vocab = body.get("tokens"), model.config.vocab_size
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise OpenAIError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
    return web.json_response({"prompt": model.tokenizer.decode(tokens)})


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
    """The JSON object of a /v1/ request, at most MAX_API_BODY_BYTES (the coordinator's other
    routes keep their 64 KiB: this reads past the app's ``client_max_size``). A larger body is
    read on and dropped up to twice the limit before the 413, so that a client still sending
    it reads the answer (aiohttp would otherwise linger 10 s on the unread rest)."""
    raw, seen = bytearray(), 0
    too_large = request.content_length is not None and request.content_length > MAX_API_BODY_BYTES
    async for chunk in request.content.iter_chunked(2**16):
        seen += len(chunk)
        too_large = too_large or seen > MAX_API_BODY_BYTES
        if not too_large:
            raw += chunk
        elif seen > 2 * MAX_API_BODY_BYTES:
            break
    if too_large:
        raise OpenAIError(413, f"the body exceeds {MAX_API_BODY_BYTES} bytes", code="request_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object", code="invalid_json")
    return body


async def _complete(request: web.Request, *, chat: bool) -> web.StreamResponse:
    service = request.app[COMPLETIONS]
    body = await _read_body(request)
    _check_model(request, body.get("model"))
    req = parse_request(body, chat=chat)
    with service.slot():
        model = await service.model()
        reply = ReplyFormat(
            chat, request.app[SETTINGS].run_id, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        )
        if req.scoring:
            return await _score(request, model, req, reply)
        prompts = [model.tokens(prompt, i, echo=False) for i, prompt in enumerate(req.prompts)]
        params = [sampling_params(req, len(ids), model.config.block_size) for ids in prompts]
        if req.stream:
            async with _generation(request, model, req, prompts[0], params[0]) as (gen, pieces):
                return await _stream(
                    request, reply, gen, pieces, include_usage=req.include_usage, prompt_tokens=len(prompts[0])
                )
            return _client_gone()
        choices, completion_tokens = [], 0
        for ids, sampling in zip(prompts, params):  # one after the other, in this request's one slot
            async with _generation(request, model, req, ids, sampling) as (gen, pieces):
                choices.append(("".join([piece async for piece in pieces]), gen.finish_reason, None))
                completion_tokens += gen.completion_tokens
            if gen.abandoned:
                return _client_gone()
        return web.json_response(
            reply.whole_choices(choices, usage(sum(len(ids) for ids in prompts), completion_tokens))
        )


def _client_gone() -> web.Response:
    return web.Response(status=499, text="the client went away")  # nobody reads it


@contextlib.asynccontextmanager
async def _generation(
    request: web.Request, model: SwarmModel, req: GenerationRequest, ids: list[int], params: SamplingParams
) -> AsyncIterator[tuple[Generation, AsyncIterator[str]]]:
    """One prompt's generation in a :class:`SwarmSession`, closed at the end, and its log line.
    A client that went away ends it quietly (``gen.abandoned``): the body of the ``async with`` is left."""
    service, started = request.app[COMPLETIONS], time.perf_counter()
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
            yield gen, pieces
    except OpenAIError:
        service.forget_model()  # the next request reads the model again
        raise
    except ConnectionResetError:  # nobody to answer
        gen.abandoned = True
    except asyncio.CancelledError:  # the server stops, or cancels the handlers of clients that went away
        request.app[LOG].info("completion.cancelled", completion_tokens=gen.completion_tokens)
        raise
    request.app[LOG].info(
        "completion.done",
        chat=req.chat,
        stream=req.stream,
        prompt_tokens=len(ids),
        completion_tokens=gen.completion_tokens,
        finish_reason=gen.finish_reason,
        seconds=round(time.perf_counter() - started, 3),
        **session.stats.to_dict(),
    )


async def _score(request: web.Request, model: SwarmModel, req: GenerationRequest, reply: ReplyFormat) -> web.Response:
    """``echo`` / ``logprobs``: every prompt's tokens scored in one pass through the swarm (a
    session of the whole batch: each stage computes every position on one weights version),
    then at most one token drawn from each prompt's last position."""
    service, started = request.app[COMPLETIONS], time.perf_counter()
    prompts = [model.tokens(prompt, i, echo=True) for i, prompt in enumerate(req.prompts)]
    if empty := [i for i, ids in enumerate(prompts) if not ids]:
        raise OpenAIError(400, f"prompt(s) {empty[:8]} have no tokens: nothing to score", param="prompt")
    params = scoring_params(req, [len(ids) for ids in prompts], model.config.block_size)
    batch = ScoringBatch.of(prompts, pad_id=model.tokenizer.eos_id)
    session = SwarmSession(
        service.http,
        service.balancer,
        run_id=request.app[SETTINGS].run_id,
        max_length=batch.ids.shape[1],
        batch=len(prompts),
        timeout_s=STEP_TIMEOUT_S,
        refresh=service.refresh,
        log=service.log,
    )
    try:
        async with session:
            scores = await session.score(
                batch.ids, batch.targets, top_logprobs=req.logprobs or 0, logits_at=batch.logits_at
            )
    except (SessionFailed, RemoteError) as exc:
        service.forget_model()
        raise OpenAIError(
            503,
            f"scoring {len(prompts)} prompts of up to {batch.ids.shape[1]} tokens failed: {exc}",
            code="scoring_failed",
        ) from None
    choices = _scored_choices(model, req, prompts, scores, params)
    request.app[LOG].info(
        "completion.scored",
        prompts=len(prompts),
        prompt_tokens=sum(batch.lengths),
        padded_positions=batch.ids.numel(),
        max_tokens=req.max_tokens,
        logprobs=req.logprobs,
        seconds=round(time.perf_counter() - started, 3),
        **session.stats.to_dict(),
    )
    return web.json_response(reply.whole_choices(choices, usage(sum(batch.lengths), len(prompts) if params else 0)))


def _scored_choices(
    model: SwarmModel, req: GenerationRequest, prompts: list[list[int]], scores: Scores, params: SamplingParams | None
) -> list[tuple[str, str, dict | None]]:
    """(text, finish_reason, logprobs) of each scored prompt, its token drawn (``params``: one) from its last logits."""
    generator = params.generator() if params else None
    choices = []
    for row, (prompt, ids) in enumerate(zip(req.prompts, prompts)):
        completion = [sample(scores.logits[row], params, generator)] if params else []
        logprobs = None
        if req.logprobs is not None:
            logprobs = choice_logprobs(
                scores, row, ids, completion, echo=req.echo, token_text=model.token_text, decode=model.tokenizer.decode
            )
        choices.append((*_scored_text(model, prompt, ids, completion, params, echo=req.echo), logprobs))
    return choices


def _scored_text(
    model: SwarmModel,
    prompt: Prompt,
    ids: list[int],
    completion: list[int],
    params: SamplingParams | None,
    *,
    echo: bool,
) -> tuple[str, str]:
    """A scored choice's text (the prompt as given with ``echo``, then the drawn token's text) and finish_reason."""
    text = (prompt if isinstance(prompt, str) else model.tokenizer.decode(ids)) if echo else ""
    if not completion:
        return text, "length"
    if completion[0] == model.tokenizer.eos_id:
        return text, "stop"
    stream = TextStream(model.tokenizer.decode, params.stop)
    piece = stream.push(completion[0]) + stream.flush()
    return text + piece, "stop" if stream.stopped else "length"


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
    return path.startswith(API_PREFIX) or path in TOKENIZER_PATHS


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
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
