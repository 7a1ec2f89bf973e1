"""The plain objects behind the OpenAI-compatible API (``completions.py``): the run's model
as a stage server describes it (:class:`SwarmModel`: config and tokenizer, prompts into
token ids), the service that reads and caches it and bounds the requests running at once
(:class:`CompletionService`), and one generation's text as it becomes final (:class:`Generation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import aiohttp

from services.coordinator.openai_format import OpenAIError, Prompt
from shared.config import CoordinatorSettings
from shared.errors import RemoteError
from shared.hf import is_hf_dir
from shared.http import get_json
from shared.inference import SamplingParams, SessionFailed, TextStream
from shared.model import ModelConfig, config_from_dict
from shared.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from shared.wiring import ReplicaBalancer

INFO_TIMEOUT_S, INFO_TRIES = 5.0, 3


# ------------------------------------------------------------------ the swarm's model
@dataclass(frozen=True)
class SwarmModel:
    """What generation needs of the run's model (from a stage server's GET /info)."""

    config: ModelConfig
    tokenizer: ByteTokenizer | HFTokenizer
    replicas: tuple[tuple[str, ...], ...]  # the registry's replicas it was read under

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's beginning-of-text token, if it has one distinct from the end of text."""
        bos = getattr(self.tokenizer, "bos_id", None)
        return bos if bos is not None and bos != self.tokenizer.eos_id else None

    def tokenize(self, text: str, *, bos: bool) -> list[int]:
        ids = self.tokenizer.encode_batch([text])[0]
        return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

    def encode(self, text: str) -> list[int]:
        """A text prompt to generate from: the beginning-of-text token first, if any."""
        return self.tokenize(text, bos=True) or [self.tokenizer.eos_id]  # nothing to continue: start a document

    def tokens(self, prompt: Prompt, index: int, *, echo: bool) -> list[int]:
        """Prompt ``index``'s token ids: token ids as given, text encoded (to generate from, as
        :meth:`encode`; echoed, exactly the text's tokens). OpenAIError 400 for an id past the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, bos=False) if echo else self.encode(prompt)
        vocab = self.config.vocab_size
        if bad := [t for t in prompt if t >= vocab]:
            raise OpenAIError(
                400, f"prompt {index} holds token ids past the model's vocabulary of {vocab}: {bad[:8]}", param="prompt"
            )
        return list(prompt)

    def token_text(self, token: int) -> str:
        """A token's text in ``logprobs``: its decoding, or where that is not whole characters (a
        byte of a longer UTF-8 character) OpenAI's ``bytes:\\xNN`` (bytes) or the vocabulary's name of it."""
        text = self.tokenizer.decode([token])
        if "\ufffd" not in text:
            return text
        if isinstance(self.tokenizer, ByteTokenizer):
            return f"bytes:\\x{token:02x}"
        return self.tokenizer.token(token) or text

    def tokenizer_info(self) -> dict:
        """``GET /tokenizer_info``: vLLM's fields that lm-eval's remote tokenizer reads."""
        bos = self.bos_id
        return {
            "tokenizer_class": type(self.tokenizer).__name__,
            "name": self.tokenizer.name,
            "eos_token": self.token_text(self.tokenizer.eos_id),
            "bos_token": None if bos is None else self.token_text(bos),
            "pad_token": None,
            "vocab_size": self.tokenizer.vocab_size,
            "model_max_length": self.config.block_size,
        }


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
