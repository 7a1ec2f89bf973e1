"""Scoring through the coordinator's /v1/completions (echo, logprobs, token-id prompts, lists
of prompts) and its tokenizer endpoints, as lm-evaluation-harness' ``local-completions``
model uses them, against four in-process stage servers of an untrained model (seed 0, fp32
wire): every position's log-probability equals the same model's in one process; requests it
cannot serve get OpenAI's error shape."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from shared.model import build_model, config_from_preset
from tests.service import test_completions
from tests.service.test_completions import RUN_ID, SECRET, expect_error, greedy

start_swarm = test_completions.start_swarm  # the fixture: four stage servers and a coordinator

PROMPTS = ["ROMEO:\nBut soft, what light", "To be, or not"]
ATOL = 1e-5  # fp32 wire; a padded batch against one prompt at a time


def text_of(token: int) -> str:
    """A byte's text in ``logprobs``: OpenAI's ``bytes:\\xNN`` past ASCII."""
    return chr(token) if token < 0x80 else f"bytes:\\x{token:02x}"


def one_process(ids: list[int]) -> torch.Tensor:
    """Log-probabilities (T, vocab) of every position of ``ids`` by the whole model (seed 0)."""
    model = build_model(config_from_preset("tiny"), seed=0).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0], dim=-1)


async def complete(http, swarm, **body) -> dict:
    async with http.post(swarm.url + "/v1/completions", json={"model": RUN_ID, **body}) as resp:
        reply = await resp.json()
        assert resp.status == 200, reply
        return reply


async def test_lm_evals_loglikelihood_request_gets_every_positions_log_probability(start_swarm, http_session):
    swarm = await start_swarm()
    prompts = [list(p.encode()) for p in PROMPTS]  # lm-eval: a batch of token-id prompts, context + continuation
    with capture_logs() as logs:
        reply = await complete(
            http_session, swarm, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
        )
    assert reply["object"] == "text_completion" and [c["index"] for c in reply["choices"]] == [0, 1]
    for ids, choice in zip(prompts, reply["choices"]):
        expected = one_process(ids)
        logprobs = choice["logprobs"]
        n = len(ids)
        assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert all(len(v) == n + 1 for v in logprobs.values())  # the prompt, then the drawn token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        got = torch.tensor(logprobs["token_logprobs"][1:n])
        assert torch.allclose(got, expected[torch.arange(n - 1), torch.tensor(ids[1:])], atol=ATOL)
        for t, top in enumerate(logprobs["top_logprobs"][1:], start=1):  # the most likely token at each position
            assert len(top) == 1 and list(top.values())[0] == pytest.approx(float(expected[t - 1].max()), abs=ATOL)
        greedy_token = int(expected[-1].argmax())  # temperature 0
        assert logprobs["tokens"][-1] == text_of(greedy_token)
        assert logprobs["token_logprobs"][-1] == list(logprobs["top_logprobs"][-1].values())[0]  # is_greedy holds
        assert logprobs["tokens"][:n] == list(bytes(ids).decode())
        assert logprobs["text_offset"] == list(range(n + 1))
        assert choice["text"] == bytes(ids + [greedy_token]).decode(errors="replace")
        assert choice["finish_reason"] == "length"
    assert reply["usage"] == {
        "prompt_tokens": sum(map(len, prompts)),
        "completion_tokens": 2,
        "total_tokens": sum(map(len, prompts)) + 2,
    }
    scored = [e for e in logs if e["event"] == "completion.scored"]
    assert len(scored) == 1 and scored[0]["steps"] == 1 and scored[0]["weights_steps"] == [0]  # one pass
    assert swarm.open_sessions() == 0


async def test_text_prompts_echo_their_scores_and_logprobs_alone_score_the_drawn_token(start_swarm, http_session):
    swarm = await start_swarm()
    echoed = await complete(http_session, swarm, prompt=PROMPTS, echo=True, logprobs=3, max_tokens=0)
    for text, choice in zip(PROMPTS, echoed["choices"]):
        ids = list(text.encode())  # exactly the text's tokens: no beginning-of-text token
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == list(text)
        expected = one_process(ids)
        for t, top in enumerate(choice["logprobs"]["top_logprobs"][1:], start=1):
            values = expected[t - 1].topk(3)
            assert list(top) == [text_of(i) for i in values.indices.tolist()]
            assert torch.allclose(torch.tensor(list(top.values())), values.values, atol=ATOL)
    assert echoed["usage"]["completion_tokens"] == 0

    plain = await complete(http_session, swarm, prompt=PROMPTS[0], echo=True, max_tokens=0)
    assert plain["choices"][0]["text"] == PROMPTS[0] and plain["choices"][0]["logprobs"] is None

    drawn = await complete(http_session, swarm, prompt=PROMPTS[0], logprobs=2, max_tokens=1, temperature=0)
    choice = drawn["choices"][0]
    expected_text, _, _ = await greedy(PROMPTS[0], 1)
    last = one_process(list(PROMPTS[0].encode()))[-1]
    assert choice["text"] == expected_text and choice["logprobs"]["tokens"] == [text_of(int(last.argmax()))]
    assert choice["logprobs"]["text_offset"] == [0] and len(choice["logprobs"]["top_logprobs"][0]) == 2
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(float(last.max()), abs=ATOL)


async def test_token_id_and_listed_prompts_generate_one_choice_each(start_swarm, http_session):
    swarm = await start_swarm()
    expected = [await greedy(p, 6) for p in PROMPTS]
    by_ids = await complete(
        http_session, swarm, prompt=[list(p.encode()) for p in PROMPTS], max_tokens=6, temperature=0
    )
    by_text = await complete(http_session, swarm, prompt=PROMPTS, max_tokens=6, temperature=0)
    for reply in (by_ids, by_text):
        assert [(c["index"], c["text"], c["finish_reason"]) for c in reply["choices"]] == [
            (i, text, finish) for i, (text, finish, _) in enumerate(expected)
        ]
        assert reply["usage"]["completion_tokens"] == sum(tokens for _, _, tokens in expected)
    one = await complete(http_session, swarm, prompt=list(PROMPTS[1].encode()), max_tokens=6, temperature=0)
    assert one["choices"][0]["text"] == expected[1][0]
    assert swarm.open_sessions() == 0


async def test_the_tokenizer_endpoints_are_vllms_and_serve_the_swarms_tokenizer(start_swarm, http_session):
    swarm = await start_swarm()
    async with http_session.get(swarm.url + "/tokenizer_info") as resp:
        info = await resp.json()
    assert resp.status == 200 and info["eos_token"] == "\x00" and info["bos_token"] is None
    assert info["model_max_length"] == 128 and info["tokenizer_class"] == "ByteTokenizer"
    for special in (False, True):  # bytes have no beginning-of-text token
        async with http_session.post(
            swarm.url + "/tokenize", json={"prompt": "Héllo", "add_special_tokens": special}
        ) as resp:
            assert await resp.json() == {"count": 6, "max_model_len": 128, "tokens": list("Héllo".encode())}
    async with http_session.post(swarm.url + "/tokenize", json={"prompt": info["eos_token"]}) as resp:
        assert (await resp.json())["tokens"] == [0]  # lm-eval's remote tokenizer finds the end of text so
    async with http_session.post(swarm.url + "/detokenize", json={"tokens": list("Héllo".encode())}) as resp:
        assert await resp.json() == {"prompt": "Héllo"}
    post = lambda path, body: http_session.post(swarm.url + path, json=body)  # noqa: E731
    await expect_error(await post("/tokenize", {"prompt": [1, 2]}), 400, "prompt")
    await expect_error(await post("/tokenize", {"prompt": "x", "add_special_tokens": "no"}), 400, "add_special_tokens")
    await expect_error(await post("/detokenize", {"tokens": [1, 256]}), 400, "tokens")
    await expect_error(await post("/detokenize", {"tokens": "abc"}), 400, "tokens")

    secured = await start_swarm(secret=SECRET)
    await expect_error(await http_session.get(secured.url + "/tokenizer_info"), 401, None, "invalid_api_key")
    async with http_session.post(
        secured.url + "/tokenize", json={"prompt": "a"}, headers={"Authorization": f"Bearer {SECRET}"}
    ) as resp:
        assert resp.status == 200 and (await resp.json())["tokens"] == [97]


async def test_scoring_requests_it_cannot_serve_get_openai_errors(start_swarm, http_session):
    swarm = await start_swarm()
    ok = {"model": RUN_ID, "prompt": [[1, 2, 3]], "echo": True, "logprobs": 1, "max_tokens": 1}
    post = lambda body: http_session.post(swarm.url + "/v1/completions", json=body)  # noqa: E731
    await expect_error(await post({**ok, "prompt": ""}), 400, "prompt")  # nothing to score
    await expect_error(await post({**ok, "prompt": [[1, 2], [3, 300]]}), 400, "prompt")
    error = await expect_error(await post({**ok, "prompt": [[1] * 129]}), 400, "prompt", "context_length_exceeded")
    assert "128" in error["message"]
    await expect_error(await post({**ok, "max_tokens": 2}), 400, "echo")
    await expect_error(await post({**ok, "stream": True}), 400, "stream")
    await expect_error(await post({**ok, "logprobs": 50}), 400, "logprobs")
    await expect_error(await post({**ok, "prompt": [[1]] * 257}), 400, "prompt")
    # a batch larger than any session may hold on the stage servers: the swarm cannot score it
    small = await start_swarm(stage={"session_max_mb": 1 / 1024})
    error = await expect_error(
        await http_session.post(small.url + "/v1/completions", json={**ok, "prompt": [[1] * 100] * 8}),
        503,
        None,
        "scoring_failed",
    )
    assert "SWARM_SESSION_MAX_MB" in error["message"]
    assert swarm.open_sessions() == 0 and small.open_sessions() == 0
