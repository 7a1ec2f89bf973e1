"""Generation: sampling, a model in one process, and sessions through the live swarm.

:class:`SwarmSession` holds one generation's chain of inference sessions, one replica per
stage, chosen by the trainers' wiring (``shared.wiring``: speed-weighted, failed replicas
banned). Each server keeps the attention cache of its layers (see
``services/stage_server/sessions.py``); a step sends the new tokens through the chain and
gets the last position's logits. The client relays the hidden states between stages: a
step's tensors are one position's (a few kilobytes), so the relay costs a round trip per
stage, not bandwidth. :meth:`SwarmSession.score` is a prefill of a batch of sequences
that gets every position's log-probabilities instead (:class:`Scores`): scoring, as
lm-evaluation-harness asks of ``/v1/completions``.

Fault tolerance (Petals' approach): the client keeps every input it sent to every stage.
When a server fails (unreachable, timed out, 5xx, or it lost the session: restarted or
expired), the client opens a session on another replica of that stage (or the same URL, if
it came back) and replays the stage's inputs so far into it in one request, as the same
chunks they were first computed in, so the new cache is what the old one held; the step
then goes on. Greedy decoding through a failure thus gives the same tokens as without it.

:func:`generate` is the decoding loop over any ``step(ids) -> logits``: the swarm's
(:meth:`SwarmSession.step`) or one process's (:class:`LocalSession`), so both decode the
same way. :class:`TextStream` turns token ids into text as they come, holding back an
incomplete UTF-8 character or the start of a stop string.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

import aiohttp
import torch

from shared.codec import decode_tensor, encode_tensor
from shared.errors import RemoteError
from shared.http import post_message
from shared.kv_cache import KVCache
from shared.wiring import NoReplica, ReplicaBalancer

MAX_STOP_STRINGS = 8


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked. ``temperature`` 0: greedy (the most likely token)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # nucleus: the smallest set of tokens with this much probability
    stop: tuple[str, ...] = ()
    seed: int | None = None  # the sampling generator's; None: a random one

    def __post_init__(self):
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and 0 <= self.temperature <= 100
        ):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if len(self.stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token from the last position's ``logits`` (vocab,)."""
    logits = logits.detach().float().reshape(-1).cpu()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # tokens after the nucleus is full
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


Step = Callable[[list[int]], Awaitable[torch.Tensor]]


async def generate(
    step: Step, prompt: Sequence[int], params: SamplingParams, *, eos_id: int | None = None
) -> AsyncIterator[int]:
    """Token ids after ``prompt``, one at a time: ``step(ids)`` takes the new ids and gives
    the logits of the last position. Stops after ``max_tokens``, or at ``eos_id`` (not yielded)."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    gen = params.generator()
    logits = await step(list(prompt))
    for n in range(1, params.max_tokens + 1):
        token = sample(logits, params, gen)
        if eos_id is not None and token == eos_id:
            return
        yield token
        if n < params.max_tokens:
            logits = await step([token])


class LocalSession:
    """Generation with a whole model in this process: the reference the swarm must equal."""

    def __init__(self, model: torch.nn.Module, max_length: int):
        self.model, self.cache = model, KVCache(max_length)
        self.device = next(model.parameters()).device

    async def step(self, ids: list[int]) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids], dtype=torch.long, device=self.device), None, self.cache)
        finally:
            self.model.train(was_training)
        return logits[0, -1].float().cpu()


@dataclass(frozen=True)
class Scores:
    """A scored batch: ``logits`` (B, vocab) at the positions asked for; ``target_logprobs`` (B, T)
    of each position's target (0 where none); ``top_ids``, ``top_logprobs`` (B, T, N): each
    position's N most likely next tokens, most likely first (N = 0: empty)."""

    logits: torch.Tensor
    target_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


class SessionFailed(RuntimeError):
    """A stage had no replica that could serve the session's step within the tries allowed."""


@dataclass
class SessionStats:
    failovers: int = 0  # servers replaced mid-session
    replayed_positions: int = 0  # positions sent again to a replacement
    steps: int = 0
    weights_steps: set[int] = field(
        default_factory=set
    )  # the stages' global steps the session's positions were computed at
    failed: list[str] = field(default_factory=list)  # "stage s url: error" of each failure

    def to_dict(self) -> dict:
        return {
            "failovers": self.failovers,
            "replayed_positions": self.replayed_positions,
            "steps": self.steps,
            "weights_steps": sorted(self.weights_steps),
            "failed": self.failed[-8:],
        }


class SwarmSession:
    """One generation through the swarm (batch 1), or one scoring pass (``batch`` sequences).
    ``balancer`` holds the stages' replicas (the caller keeps it filled, e.g. from the
    coordinator's ``GET /swarm``); ``refresh``, if given, is awaited when a stage has no usable
    replica left. Use as an async context manager, or call :meth:`close`."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        balancer: ReplicaBalancer,
        *,
        run_id: str,
        max_length: int,
        batch: int = 1,
        codec: str = "fp32",
        timeout_s: float = 30.0,
        max_failovers: int = 8,
        refresh: Callable[[], Awaitable[object]] | None = None,
        log=None,
    ):
        self.http, self.balancer, self.run_id = http, balancer, run_id
        self.max_length, self.batch, self.codec, self.timeout_s = max_length, batch, codec, timeout_s
        self.max_failovers, self.refresh, self.log = max_failovers, refresh, log
        self.session_id = uuid.uuid4().hex
        self.num_stages = balancer.num_stages
        self.route: list[str | None] = [None] * self.num_stages
        self._history: list[list[torch.Tensor]] = [[] for _ in range(self.num_stages)]  # every input sent to each stage
        self.position = 0
        self.stats = SessionStats()

    async def __aenter__(self) -> SwarmSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def step(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` (the next tokens) through every stage; the last position's logits (vocab,)."""
        reply = await self._forward(torch.tensor([ids], dtype=torch.long), {})
        return decode_tensor(reply["logits"], name="logits").float()[0]

    async def score(
        self, ids: torch.Tensor, targets: torch.Tensor, *, top_logprobs: int, logits_at: list[int]
    ) -> Scores:
        """Feed ``ids`` (B, T) through every stage in one pass and score each position against
        ``targets`` (B, T; -1: none) on the last stage, with its ``top_logprobs`` most likely
        tokens; ``logits_at``: the position of each row whose logits come back."""
        last = {"targets": encode_tensor(targets, "raw"), "top_logprobs": top_logprobs, "logits_at": logits_at}
        reply = await self._forward(ids, last)
        if top_logprobs:
            top_ids = decode_tensor(reply["top_ids"], name="top_ids").long()
            top_values = decode_tensor(reply["top_logprobs"], name="top_logprobs").float()
        else:
            top_ids, top_values = torch.zeros(*targets.shape, 0, dtype=torch.long), torch.zeros(*targets.shape, 0)
        return Scores(
            logits=decode_tensor(reply["logits"], name="logits").float(),
            target_logprobs=decode_tensor(reply["target_logprobs"], name="target_logprobs").float(),
            top_ids=top_ids,
            top_logprobs=top_values,
        )

    async def _forward(self, ids: torch.Tensor, last: dict) -> dict:
        """``ids`` (batch, T) through every stage; the last stage's reply (``last``: its extra fields)."""
        T = ids.shape[1]
        if T < 1 or ids.shape[0] != self.batch:
            raise ValueError(f"a step needs (batch {self.batch}, at least one token), got {list(ids.shape)}")
        if self.position + T > self.max_length:
            raise ValueError(f"{self.position} + {T} tokens exceed the session's max_length {self.max_length}")
        x = ids
        for stage in range(self.num_stages):
            reply = await self._stage_step(stage, x, last if stage == self.num_stages - 1 else {})
            if stage < self.num_stages - 1:
                x = decode_tensor(reply["outputs"], name="outputs").float()
        self.position += T
        self.stats.steps += 1
        return reply

    async def _stage_step(self, stage: int, x: torch.Tensor, fields: dict) -> dict:
        tries = 0
        while True:
            url = self.route[stage]
            try:
                if url is None:
                    url = await self._open(stage)
                    history = self._history[stage]
                    inputs = torch.cat(history + [x], dim=1) if history else x
                    reply = await self._post(
                        url,
                        "/session/step",
                        stage,
                        position=0,
                        inputs=inputs,
                        chunks=[h.shape[1] for h in history] + [x.shape[1]],
                        **fields,
                    )
                    self.stats.replayed_positions += sum(h.shape[1] for h in history)
                else:
                    reply = await self._post(url, "/session/step", stage, position=self.position, inputs=x, **fields)
            except RemoteError as exc:
                if (
                    exc.status is not None
                    and 400 <= exc.status < 500
                    and exc.code not in ("session_not_found", "session_out_of_sync", "wrong_stage")
                ):
                    raise  # the request itself is wrong: another replica would refuse it too
                tries += 1
                self._failed(stage, url, exc)
                if tries > self.max_failovers:
                    raise SessionFailed(
                        f"stage {stage}: no replica served the session's step in {tries} tries; last: {exc}"
                    ) from None
                await self._wait_for_replica(stage, exc)
                continue
            self._history[stage].append(x)
            self.stats.weights_steps.add(int(reply.get("step", 0)))
            return reply

    async def _open(self, stage: int) -> str:
        try:
            url = self.balancer.choose(stage, kind="forward", batch_size=self.batch)
        except NoReplica:
            raise RemoteError(f"stage {stage}", None, "no_replica", "the stage has no known replica") from None
        self.route[stage] = url
        msg = {"session_id": self.session_id, "batch": self.batch, "max_length": self.max_length}
        await self._post(url, "/session/open", stage, **msg)
        return url

    async def _post(self, url: str, path: str, stage: int, *, inputs: torch.Tensor | None = None, **fields) -> dict:
        msg = {"v": 1, "run_id": self.run_id, "stage": stage, "session_id": self.session_id, **fields}
        if inputs is not None:
            msg["inputs"] = encode_tensor(inputs, self.codec)
            msg["codec"] = self.codec
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await post_message(self.http, url + path, msg, timeout_s=self.timeout_s)
        if path == "/session/step":
            self.balancer.report_success(stage, url, loop.time() - started, self.batch, "forward")
        return reply

    def _failed(self, stage: int, url: str | None, exc: RemoteError) -> None:
        self.stats.failovers += 1
        self.stats.failed.append(f"stage {stage} {url}: {exc.code}")
        if url is not None and exc.code != "session_out_of_sync":
            self.balancer.report_failure(stage, url)
        self.route[stage] = None
        if self.log:
            self.log.warning(
                "session.failover",
                session=self.session_id,
                stage=stage,
                replica=url,
                error=exc.code,
                message=str(exc)[:200],
            )

    async def _wait_for_replica(self, stage: int, exc: RemoteError) -> None:
        if not self.balancer.has_usable(stage):
            if self.refresh is not None:
                await self.refresh()
            if not self.balancer.has_usable(stage):
                wait = self.balancer.next_usable_in(stage)
                await asyncio.sleep(min(5.0, wait if wait is not None else 1.0))
        elif exc.code == "overloaded" and exc.retry_after_s:
            await asyncio.sleep(min(5.0, exc.retry_after_s))

    async def close(self) -> None:
        """Free the servers' caches (best effort: a server that is gone frees it by its TTL)."""
        for stage, url in enumerate(self.route):
            if url is not None:
                try:
                    await self._post(url, "/session/close", stage)
                except RemoteError:
                    pass
        self.route = [None] * self.num_stages


class TextStream:
    """Token ids in, text out as it becomes final: an incomplete UTF-8 character (shown as
    U+FFFD while its bytes are missing) and a possible start of a stop string are held back;
    at a stop string the text ends before it."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode, self.stop = decode, tuple(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already given out
        self.out = ""  # the text given out
        self.stopped = False

    def push(self, token: int) -> str:
        """The new final text after ``token`` ('' if none yet)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.decode(self.ids)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                return self._emit(text[:at])
        final = len(text)
        while final > self.sent and text[final - 1] == "\ufffd":  # bytes of a character still to come
            final -= 1
        for s in self.stop:  # keep back a tail that may grow into a stop string
            for k in range(min(len(s) - 1, final - self.sent), 0, -1):
                if text[final - k : final] == s[:k]:
                    final -= k
                    break
        return self._emit(text[:final])

    def flush(self) -> str:
        """What is left at the end of the generation."""
        if self.stopped:
            return ""
        return self._emit(self.decode(self.ids))

    def _emit(self, text: str) -> str:
        new = text[self.sent :]
        self.sent = max(self.sent, len(text))
        self.out += new
        return new
