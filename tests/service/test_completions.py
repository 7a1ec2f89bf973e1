"""The coordinator's OpenAI-compatible API (services/coordinator/completions.py) against four
in-process stage servers of an untrained model (seed 0, fp32 wire): the official ``openai``
client and ``curl`` get exactly the text that greedy decoding of the same model in one
process gives, streamed or not, with bytes or a BPE tokenizer (SWARM_TOKENIZER); bad
requests get OpenAI's error shape; a swarm with a secret wants it as the bearer token; past
SWARM_MAX_GENERATIONS a request gets 429; a client that goes away ends the generation and
frees the servers' caches; a swarm that fails answers 503, or an error event mid-stream.

The coordinator runs as ``web.run_app`` serves it (an AppRunner: a handler is not cancelled
when its client goes away), not in aiohttp's TestServer, which cancels it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from services.coordinator.app import create_app
from services.coordinator.completions import COMPLETIONS
from services.stage_server.routes import SESSIONS
from shared.config import FaultInjection
from shared.http import swarm_session
from shared.inference import LocalSession, SamplingParams, TextStream, generate
from shared.model import build_model, config_from_preset
from shared.tokenizer import ByteTokenizer, train_bpe
from tests.conftest import coordinator_settings, stage_settings, until

RUN_ID = "test"
SECRET = "a-test-secret-of-32-characters!!"
PROMPT = "Hello"
ERROR_FIELDS = {"message", "type", "param", "code"}
WAIT_S = 10.0


@dataclass
class Swarm:
    url: str  # the coordinator's
    app: web.Application
    stages: list[web.Application]

    def open_sessions(self) -> int:
        return sum(len(app[SESSIONS]) for app in self.stages)


@pytest.fixture
async def start_swarm(start_stages):
    """``await start_swarm(register=True, stage=dict(...), **coordinator_overrides)`` -> Swarm."""
    runners: list[web.AppRunner] = []

    async def start(*, register: bool = True, stage: dict | None = None, **overrides) -> Swarm:
        settings = coordinator_settings(run_id=RUN_ID, **overrides)
        stage = {"secret": settings.secret.get_secret_value(), **(stage or {})}
        apps, urls = await start_stages([[stage_settings(s, run_id=RUN_ID, **stage)] for s in range(4)])
        app = create_app(settings)
        runner = web.AppRunner(app)  # as web.run_app serves it: a handler is not cancelled when its client goes away
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        async with swarm_session(settings) as http:  # signed, as the servers' own registrations
            for s, (group,) in enumerate(urls) if register else ():
                body = {
                    "run_id": RUN_ID,
                    "server_id": f"s{s}",
                    "stage": s,
                    "url": group,
                    "version": "t",
                    "throughput": 1.0,
                    "queue_length": 0,
                }
                async with http.post(url + "/register", json=body) as resp:
                    assert resp.status == 200, await resp.text()
        return Swarm(url, app, [a for group in apps for a in group])

    yield start
    for runner in runners:
        await runner.cleanup()


async def greedy(
    prompt: str, max_tokens: int, stop: tuple[str, ...] = (), *, preset: str = "tiny", tokenizer=None
) -> tuple[str, str, int]:
    """(text, finish_reason, tokens) of greedy decoding by the whole model (seed 0) in this process."""
    tokenizer = tokenizer or ByteTokenizer()
    ids = tokenizer.encode_batch([prompt])[0]
    session = LocalSession(build_model(config_from_preset(preset), seed=0), len(ids) + max_tokens)
    text, tokens = TextStream(tokenizer.decode, stop), []
    async for token in generate(
        session.step, ids, SamplingParams(max_tokens=max_tokens, stop=stop), eos_id=tokenizer.eos_id
    ):
        tokens.append(token)
        text.push(token)
        if text.stopped:
            break
    text.flush()
    if not stop:
        assert text.out == tokenizer.decode(tokens)
    return text.out, "length" if len(tokens) == max_tokens and not text.stopped else "stop", len(tokens)


async def wait_for(condition, what: str, timeout_s: float = WAIT_S):
    return await until(condition, timeout_s, what)


def client_of(swarm: Swarm, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.url + "/v1", api_key=api_key, max_retries=0, timeout=60.0)


async def test_the_openai_client_gets_the_greedy_text_of_the_model_in_one_process(start_swarm):
    swarm = await start_swarm()
    expected, finish, tokens = await greedy(PROMPT, 12)
    client = client_of(swarm)
    try:
        assert [(m.id, m.owned_by) for m in (await client.models.list()).data] == [(RUN_ID, "swarm-mesh")]
        done = await client.completions.create(model=RUN_ID, prompt=PROMPT, max_tokens=12, temperature=0)
        assert done.object == "text_completion" and done.model == RUN_ID
        assert (done.choices[0].text, done.choices[0].finish_reason) == (expected, finish)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
            len(PROMPT),
            tokens,
            len(PROMPT) + tokens,
        )
        assert swarm.open_sessions() == 0  # closed before the answer went out

        stream = await client.completions.create(
            model=RUN_ID,
            prompt=[PROMPT],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        texts = [c for c in chunks if c.choices]
        assert len(texts) >= 3 and "".join(c.choices[0].text for c in texts) == expected
        assert [c.choices[0].finish_reason for c in texts] == [None] * (len(texts) - 1) + [finish]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == tokens  # the usage chunk, last

        # a stop string: the text ends before it, and says so
        stop = expected[2:4]
        stopped, stop_finish, _ = await greedy(PROMPT, 12, (stop,))
        done = await client.completions.create(model=RUN_ID, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
        assert (
            (done.choices[0].text, done.choices[0].finish_reason)
            == (stopped, stop_finish)
            == (expected[: expected.index(stop)], "stop")
        )

        # chat: the plain-text template, the answer ending at the next user turn
        chat_expected, chat_finish, _ = await greedy("system: Be brief.\nuser: Hello\nassistant:", 12, ("\nuser:",))
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        chat = await client.chat.completions.create(model=RUN_ID, messages=messages, max_tokens=12, temperature=0)
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (chat_expected, chat_finish)
        stream = await client.chat.completions.create(
            model=RUN_ID, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == chat_finish
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_expected

        # sampling with a seed is reproducible
        sampled = [
            (
                await client.completions.create(
                    model=RUN_ID, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, seed=11
                )
            )
            .choices[0]
            .text
            for _ in range(2)
        ]
        assert sampled[0] == sampled[1]
    finally:
        await client.close()
    await wait_for(lambda: swarm.open_sessions() == 0, "the streamed generations' sessions to close")


async def test_a_bpe_tokenizer_from_swarm_tokenizer_serves_a_llama(start_swarm, tmp_path):
    documents = [
        "To be, or not to be, that is the question.",
        "ROMEO: But soft, what light through yonder window breaks?",
    ] * 20
    tokenizer = train_bpe(documents, 300, tmp_path / "tokenizer")
    swarm = await start_swarm(stage={"model": "llama-tiny"}, tokenizer=str(tmp_path / "tokenizer"))
    expected, finish, tokens = await greedy("ROMEO: But", 10, preset="llama-tiny", tokenizer=tokenizer)
    client = client_of(swarm)
    try:
        done = await client.completions.create(model=RUN_ID, prompt="ROMEO: But", max_tokens=10, temperature=0)
    finally:
        await client.close()
    assert (done.choices[0].text, done.choices[0].finish_reason, done.usage.completion_tokens) == (
        expected,
        finish,
        tokens,
    )
    assert done.usage.prompt_tokens == len(tokenizer.encode("ROMEO: But")) < len("ROMEO: But")


async def test_curl_gets_server_sent_events_ending_with_done(start_swarm):
    curl = shutil.which("curl")
    if curl is None:
        if os.environ.get("CI"):
            pytest.fail("the curl test needs curl")
        pytest.skip("curl is not installed")
    swarm = await start_swarm()
    expected, _, _ = await greedy(PROMPT, 8)
    body = json.dumps({"model": RUN_ID, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True})
    proc = await asyncio.create_subprocess_exec(
        curl,
        "-sN",
        "--max-time",
        "60",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        swarm.url + "/v1/completions",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err
    events = out.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", out[-200:]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert {c["object"] for c in chunks} == {"text_completion"} and chunks[-1]["choices"][0][
        "finish_reason"
    ] == "length"


async def expect_error(
    resp: aiohttp.ClientResponse,
    status: int,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
) -> dict:
    body = await resp.json()
    assert resp.status == status, body
    error = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert error["type"] == (kind or ("invalid_request_error" if status < 500 else "server_error")) and error["message"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    return error


async def test_bad_requests_get_openai_errors(start_swarm, http_session):
    swarm = await start_swarm()
    url, ok = swarm.url + "/v1/completions", {"model": RUN_ID, "prompt": PROMPT}
    post = lambda body, path="/v1/completions": http_session.post(swarm.url + path, json=body)  # noqa: E731
    await expect_error(await post({**ok, "model": "gpt-4"}), 404, "model", "model_not_found")
    await expect_error(await http_session.get(swarm.url + "/v1/models/gpt-4"), 404, "model", "model_not_found")
    await expect_error(await post({"prompt": PROMPT}), 400, "model")
    await expect_error(await post({**ok, "max_tokens": 0}), 400, "max_tokens")
    error = await expect_error(await post({**ok, "max_tokens": 128 - len(PROMPT) + 1}), 400, "max_tokens")
    assert f"[1, {128 - len(PROMPT)}]" in error["message"]
    await expect_error(await post({**ok, "prompt": "x" * 128}), 400, "prompt", "context_length_exceeded")
    await expect_error(
        await http_session.post(
            url, data=b'{"model": "test", "prompt": ', headers={"Content-Type": "application/json"}
        ),
        400,
        None,
        "invalid_json",
    )
    await expect_error(
        await http_session.post(url, data=b"[1, 2]", headers={"Content-Type": "application/json"}),
        400,
        None,
        "invalid_json",
    )
    await expect_error(await post({"model": RUN_ID}), 400, "prompt")
    await expect_error(await post({**ok, "prompt": [1, "a"]}), 400, "prompt")
    await expect_error(await post({**ok, "prompt": [[1, 2], [256]]}), 400, "prompt")  # past the vocabulary
    await expect_error(await post({"model": RUN_ID}, "/v1/chat/completions"), 400, "messages")
    await expect_error(
        await post({"model": RUN_ID, "messages": [{"role": "robot", "content": "hi"}]}, "/v1/chat/completions"),
        400,
        "messages[0].role",
    )
    await expect_error(await post({**ok, "n": 2}), 400, "n")
    await expect_error(await post({**ok, "echo": True}), 400, "echo")
    await expect_error(await post({**ok, "temperature": 2.5}), 400, "temperature")
    await expect_error(await post({**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop")
    await expect_error(await post({**ok, "stream": "yes"}), 400, "stream")
    await expect_error(await http_session.get(swarm.url + "/v1/engines"), 404)
    await expect_error(await post({**ok, "prompt": "x" * (8 * 2**20)}), 413, None, "request_too_large")
    async with http_session.get(swarm.url + f"/v1/models/{RUN_ID}") as resp:
        assert resp.status == 200 and (await resp.json())["id"] == RUN_ID
    assert swarm.app[COMPLETIONS].active == 0 and swarm.open_sessions() == 0


async def test_without_replicas_or_a_tokenizer_the_api_answers_503(start_swarm, http_session):
    swarm = await start_swarm(register=False)
    resp = await http_session.post(swarm.url + "/v1/completions", json={"model": RUN_ID, "prompt": PROMPT})
    error = await expect_error(resp, 503, None, "no_replicas")
    assert "no live replica" in error["message"]
    swarm = await start_swarm(
        stage={"model": "llama-tiny"}
    )  # a vocabulary of 2048: bytes do not fit, and no SWARM_TOKENIZER
    resp = await http_session.post(swarm.url + "/v1/completions", json={"model": RUN_ID, "prompt": PROMPT})
    error = await expect_error(resp, 503, None, "no_tokenizer")
    assert "SWARM_TOKENIZER" in error["message"]


async def test_with_a_secret_the_api_wants_it_as_the_bearer_token(start_swarm, http_session):
    swarm = await start_swarm(secret=SECRET)
    body = {"model": RUN_ID, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong-secret-of-some-length"}, {"Authorization": f"Basic {SECRET}"}):
        await expect_error(
            await http_session.post(swarm.url + "/v1/completions", json=body, headers=headers),
            401,
            None,
            "invalid_api_key",
        )
        await expect_error(
            await http_session.get(swarm.url + "/v1/models", headers=headers), 401, None, "invalid_api_key"
        )
    resp = await http_session.post(
        swarm.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {SECRET}"}
    )
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["text"] == (await greedy(PROMPT, 6))[0]
    client = client_of(swarm, api_key=SECRET)
    try:
        assert [m.id for m in (await client.models.list()).data] == [RUN_ID]
    finally:
        await client.close()
    # the rest of the coordinator still wants the swarm's signature; the dashboard stays open
    resp = await http_session.post(
        swarm.url + "/register", json={"run_id": RUN_ID}, headers={"Authorization": f"Bearer {SECRET}"}
    )
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
    assert (await http_session.get(swarm.url + "/")).status == 200


async def test_generations_past_the_limit_get_429_and_a_client_that_goes_away_frees_the_sessions(start_swarm):
    # stage 0 slowed to ~0.05 s per token (work = tokens / 64): a 100-token generation takes seconds
    swarm = await start_swarm(max_generations=1, stage={"inject": FaultInjection(delay_s=3.2)})
    body = {"model": RUN_ID, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True}
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
            resp = await first.post(swarm.url + "/v1/completions", json=body)
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            line = await asyncio.wait_for(resp.content.readline(), WAIT_S)
            assert line.startswith(b"data: {")
            assert swarm.open_sessions() == 4 and swarm.app[COMPLETIONS].active == 1

            busy = await second.post(swarm.url + "/v1/completions", json={**body, "stream": False})
            await expect_error(busy, 429, None, "rate_limit_exceeded", kind="requests")
            assert busy.headers["Retry-After"] == "1"

            resp.close()  # the client goes away mid-stream
            await wait_for(
                lambda: swarm.app[COMPLETIONS].active == 0 and swarm.open_sessions() == 0,
                "the generation to end and close its sessions",
            )
            assert (
                sum(app[SESSIONS].closed for app in swarm.stages) == 4
            )  # closed by the coordinator, not by their idle TTL

            with pytest.raises(asyncio.TimeoutError):  # a client of a whole answer that stops waiting
                await second.post(
                    swarm.url + "/v1/completions",
                    json={**body, "stream": False},
                    timeout=aiohttp.ClientTimeout(total=0.5),
                )
            await wait_for(
                lambda: swarm.app[COMPLETIONS].active == 0 and swarm.open_sessions() == 0,
                "the second generation to end and close its sessions",
            )
            assert sum(app[SESSIONS].closed for app in swarm.stages) == 8
    done = [e for e in logs if e["event"] == "completion.done"]
    assert [(e["finish_reason"], e["stream"]) for e in done] == [("client_gone", True), ("client_gone", False)], done
    assert all(e["completion_tokens"] < 100 for e in done), done


async def test_a_failed_generation_answers_503_before_the_stream_and_an_error_event_within_it(
    start_swarm, http_session
):
    # every stage refuses sessions larger than 1 KiB (400): the generation cannot start
    swarm = await start_swarm(stage={"session_max_mb": 1 / 1024})
    body = {"model": RUN_ID, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    for stream in (False, True):
        error = await expect_error(
            await http_session.post(swarm.url + "/v1/completions", json={**body, "stream": stream}),
            503,
            None,
            "generation_failed",
        )
        assert "SWARM_SESSION_MAX_MB" in error["message"]

    # the stream has begun when stage 2 loses its sessions and refuses new ones: an error event ends it
    swarm = await start_swarm(stage={"inject": FaultInjection(delay_s=3.2)})  # ~0.05 s per token and stage
    resp = await http_session.post(swarm.url + "/v1/completions", json={**body, "stream": True})
    assert resp.status == 200 and (await asyncio.wait_for(resp.content.readline(), WAIT_S)).startswith(b"data: {")
    store = swarm.stages[2][SESSIONS]
    store.session_bytes, store.ttl_s = 1, 0.0  # its session expires at the next step; the replay's open gets 400
    events = [e for e in (await asyncio.wait_for(resp.content.read(), WAIT_S)).decode().strip().split("\n\n")]
    assert events[-1].startswith("data: {") and "[DONE]" not in events[-1]
    error = json.loads(events[-1][len("data: ") :])["error"]
    assert set(error) == ERROR_FIELDS and (error["type"], error["code"]) == ("server_error", "generation_failed")
    await wait_for(
        lambda: swarm.app[COMPLETIONS].active == 0 and swarm.open_sessions() == 0,
        "the failed generation to close its sessions",
    )
