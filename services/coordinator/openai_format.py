"""OpenAI's API as plain data: requests checked, replies and errors shaped (no networking).

The coordinator's handlers (``completions.py``) decode a body, call :func:`parse_request`
and :func:`sampling_params`, and encode what :class:`ReplyFormat` builds. The contract of
the endpoints (fields, defaults, the chat template) is in ``completions.py``'s docstring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union

from shared.inference import SamplingParams

COMPLETION_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
MAX_STOP = 4
MAX_PROMPTS = 256  # prompts in one /v1/completions request (a batch of lm-evaluation-harness)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's legacy completions allow 5)
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
CHAT_END = "\nuser:"  # the chat template's next turn: the assistant's answer ends before it
# Fields whose other values this server cannot honour: refused rather than ignored.
UNSUPPORTED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
}


class OpenAIError(Exception):
    """A refusal in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


Prompt = Union[str, tuple[int, ...]]  # text, or token ids


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: its prompts (texts or token ids) and how to sample (``max_tokens``
    None: the default). ``echo`` or ``logprobs`` (N alternatives per token) make it a scoring
    request: every prompt's tokens scored in one pass, then at most one token sampled."""

    chat: bool
    prompts: tuple[Prompt, ...]
    max_tokens: int | None
    max_tokens_param: str  # the field that gave it, named in errors
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    @property
    def scoring(self) -> bool:
        return self.echo or self.logprobs is not None


def parse_request(body: dict, *, chat: bool) -> GenerationRequest:
    """Check a /v1/completions or /v1/chat/completions body (the model aside); OpenAIError 400."""
    unsupported = {**UNSUPPORTED, "echo": (None, False), "logprobs": (None, False)} if chat else UNSUPPORTED
    for name, allowed in unsupported.items():
        if body.get(name) not in allowed:
            raise OpenAIError(
                400, f"{name}={body[name]!r} is not supported by this server (only {allowed[-1]!r})", param=name
            )
    prompts = (render_chat(body.get("messages")),) if chat else _prompts(body.get("prompt"))
    echo, logprobs = (False, None) if chat else _scoring_fields(body)
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(limit)
    least = 0 if echo else 1  # echo with max_tokens 0: the prompt scored, nothing generated
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < least):
        raise OpenAIError(
            400,
            f"{limit} must be an integer >= {least}{' (0 with echo)' * (not echo)}, got {max_tokens!r}",
            param=limit,
        )
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise OpenAIError(400, f"seed must be an integer in [0, 2**63), got {seed!r}", param="seed")
    stream, options = body.get("stream") or False, body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise OpenAIError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise OpenAIError(400, "stream_options must be {include_usage: boolean}", param="stream_options")
    if echo or logprobs is not None:
        name = "echo" if echo else "logprobs"
        if stream:
            raise OpenAIError(400, f"{name} is not supported with stream: true", param="stream")
        if (COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens) > 1:
            raise OpenAIError(
                400,
                (
                    f"{name} scores the prompt here: max_tokens must be 0 or 1 with it, got "
                    f"{max_tokens if max_tokens is not None else f'{COMPLETION_MAX_TOKENS} (the default)'}"
                ),
                param=name,
            )
    elif stream and len(prompts) > 1:
        raise OpenAIError(400, f"stream: true takes one prompt, got {len(prompts)}", param="prompt")
    return GenerationRequest(
        chat=chat,
        prompts=prompts,
        max_tokens=max_tokens,
        max_tokens_param=limit,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        seed=seed,
        stop=((CHAT_END,) if chat else ()) + _stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        echo=echo,
        logprobs=logprobs,
    )


def _scoring_fields(body: dict) -> tuple[bool, int | None]:
    echo, logprobs = body.get("echo") or False, body.get("logprobs")
    if not isinstance(echo, bool):
        raise OpenAIError(400, f"echo must be a boolean, got {echo!r}", param="echo")
    if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_LOGPROBS):
        raise OpenAIError(
            400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}", param="logprobs"
        )
    return echo, logprobs


def render_chat(messages) -> str:
    """The plain-text chat template: a ``role: content`` line per message, then ``assistant:``."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages must be a non-empty list of {role, content}", param="messages")
    lines = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES:
            raise OpenAIError(
                400,
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
            )
        lines.append(f"{CHAT_ROLES[role]}: {_content(message.get('content'), role, i)}")
    return "\n".join(lines) + "\nassistant:"


def _content(content, role: str, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise OpenAIError(
        400, f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content"
    )


def _prompts(prompt) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids (OpenAI's four forms)."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPTS:
        if all(_is_token(t) for t in prompt):
            return (tuple(prompt),)
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return tuple(tuple(p) for p in prompt)
    raise OpenAIError(
        400,
        (
            "prompt must be a string, a list of strings, a list of token ids (ints >= 0) or a list of non-empty lists "
            f"of token ids; at most {MAX_PROMPTS} prompts"
        ),
        param="prompt",
    )


def _is_token(t) -> bool:
    return type(t) is int and t >= 0


def _stop(stop) -> tuple[str, ...]:
    stop = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return ()
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", param="stop")
    return tuple(stop)


def _number(body: dict, name: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (low < value <= high if open_low else low <= value <= high)
    ):
        raise OpenAIError(
            400, f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], got {value!r}", param=name
        )
    return float(value)


def sampling_params(req: GenerationRequest, prompt_tokens: int, block_size: int) -> SamplingParams:
    """How to sample ``req``'s completion of a ``prompt_tokens`` prompt for a model of ``block_size`` positions."""
    room = block_size - prompt_tokens
    if room < 1:
        raise OpenAIError(
            400,
            (
                f"the prompt is {prompt_tokens} tokens; the model's context is {block_size}, with at least one left "
                "for the completion"
            ),
            param=req.prompt_param,
            code="context_length_exceeded",
        )
    max_tokens = (
        req.max_tokens if req.max_tokens is not None else room if req.chat else min(room, COMPLETION_MAX_TOKENS)
    )
    if not 1 <= max_tokens <= room:
        raise OpenAIError(
            400,
            f"{req.max_tokens_param} must be in [1, {room}]: the model's context is {block_size} tokens and the prompt "
            f"takes {prompt_tokens}, got {max_tokens}",
            param=req.max_tokens_param,
        )
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop, seed=req.seed
    )


def scoring_params(req: GenerationRequest, prompt_tokens: list[int], block_size: int) -> SamplingParams | None:
    """How to draw the one token of a scoring request (None: ``max_tokens`` 0, none); every
    prompt must fit the model's context (its last position's logits give that token)."""
    for i, n in enumerate(prompt_tokens):
        if n > block_size:
            raise OpenAIError(
                400,
                f"prompt {i} is {n} tokens; the model's context is {block_size}",
                param="prompt",
                code="context_length_exceeded",
            )
    if not req.max_tokens:
        return None
    return SamplingParams(max_tokens=1, temperature=req.temperature, top_p=req.top_p, stop=req.stop, seed=req.seed)


@dataclass(frozen=True)
class ReplyFormat:
    """OpenAI's reply objects of one request."""

    chat: bool
    model: str
    id: str
    created: int

    def whole(self, text: str, finish: str, usage: dict) -> dict:
        return self.whole_choices([(text, finish, None)], usage)

    def whole_choices(self, choices: list[tuple[str, str, dict | None]], usage: dict) -> dict:
        """A whole reply of (text, finish_reason, logprobs) choices, indexed in order (one per prompt)."""
        return {
            **self._head(False),
            "choices": [
                {
                    "index": i,
                    **({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}),
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
                for i, (text, finish, logprobs) in enumerate(choices)
            ],
            "usage": usage,
        }

    def chunk(self, text: str | None, finish: str | None = None, *, first: bool = False) -> bytes:
        """A stream event: ``text`` (None: the last chunk, with ``finish``)."""
        if self.chat:
            delta = {} if text is None else {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        return event({**self._head(True), "choices": [{**choice, "logprobs": None, "finish_reason": finish}]})

    def usage_chunk(self, usage: dict) -> bytes:
        return event({**self._head(True), "choices": [], "usage": usage})

    def _head(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def event(obj: dict | str) -> bytes:
    """One server-sent event."""
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
