"""Inference sessions on stage servers (services/stage_server/sessions.py) driven by the
client of shared/inference.py, all in this process on loopback."""

from __future__ import annotations

import pytest
import torch

from services.stage_server.routes import RUNTIME, SESSIONS
from services.stage_server.sessions import SessionStore
from shared.codec import encode_tensor
from shared.errors import RemoteError
from shared.http import post_message
from shared.inference import LocalSession, SamplingParams, SwarmSession, generate
from shared.model import build_model, config_from_preset
from tests.conftest import balancer_for, stage_settings

PROMPT = [ord(c) for c in "ROMEO:\nBut soft"]


async def local_tokens(preset: str, prompt: list[int], params: SamplingParams, max_length: int) -> list[int]:
    session = LocalSession(build_model(config_from_preset(preset), seed=0), max_length)
    return [t async for t in generate(session.step, prompt, params)]


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
async def test_greedy_generation_through_four_stages_equals_one_process(start_stages, http_session, preset):
    _, urls = await start_stages([[stage_settings(s, model=preset)] for s in range(4)])
    params = SamplingParams(max_tokens=64)
    max_length = len(PROMPT) + 64
    async with SwarmSession(http_session, balancer_for(urls), run_id="test", max_length=max_length) as session:
        tokens = [t async for t in generate(session.step, PROMPT, params)]
    assert tokens == await local_tokens(preset, PROMPT, params, max_length)
    assert len(tokens) == 64 and session.stats.steps == 64 and session.stats.failovers == 0
    assert session.stats.weights_steps == {0}


async def test_sampling_through_the_swarm_with_a_seed_equals_one_process(start_stages, http_session):
    _, urls = await start_stages([[stage_settings(s)] for s in range(4)])
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    async with SwarmSession(http_session, balancer_for(urls), run_id="test", max_length=64) as session:
        tokens = [t async for t in generate(session.step, PROMPT, params)]
    assert tokens == await local_tokens("tiny", PROMPT, params, 64)


async def test_a_replica_that_goes_away_mid_generation_is_replaced_and_the_text_is_unchanged(
    start_stages, http_session
):
    apps, urls = await start_stages(
        [[stage_settings(0)], [stage_settings(1)], [stage_settings(2), stage_settings(2)], [stage_settings(3)]]
    )
    params = SamplingParams(max_tokens=32)
    session = SwarmSession(http_session, balancer_for(urls), run_id="test", max_length=64)
    tokens = []
    async for token in generate(session.step, PROMPT, params):
        tokens.append(token)
        if len(tokens) == 12:
            gone = session.route[2]
            apps[2][urls[2].index(gone)][SESSIONS].close(
                session.session_id
            )  # as a restarted server: the session is lost
    await session.close()
    assert tokens == await local_tokens("tiny", PROMPT, params, 64)
    assert session.stats.failovers == 1 and session.stats.failed[0].endswith("session_not_found")
    assert session.stats.replayed_positions == len(PROMPT) + 11  # everything stage 2 had seen


async def post(http, url: str, path: str, **msg) -> dict:
    return await post_message(http, url + path, {"v": 1, "run_id": "test", **msg}, timeout_s=10)


async def test_positions_out_of_sync_unknown_sessions_and_bad_inputs_are_refused(start_stages, http_session):
    _, urls = await start_stages([[stage_settings(0, num_stages=2)], [stage_settings(1, num_stages=2)]])
    s0 = urls[0][0]
    ids = torch.tensor([PROMPT], dtype=torch.long)
    with pytest.raises(RemoteError) as err:
        await post(
            http_session, s0, "/session/step", stage=0, session_id="nope", position=0, inputs=encode_tensor(ids, "raw")
        )
    assert err.value.status == 404 and err.value.code == "session_not_found"
    await post(http_session, s0, "/session/open", stage=0, session_id="a", batch=1, max_length=32)
    first = await post(
        http_session, s0, "/session/step", stage=0, session_id="a", position=0, inputs=encode_tensor(ids, "raw")
    )
    assert first["position"] == len(PROMPT)
    with pytest.raises(RemoteError) as err:  # the client thinks the session is empty: it must replay
        await post(
            http_session,
            s0,
            "/session/step",
            stage=0,
            session_id="a",
            position=0,
            inputs=encode_tensor(ids[:, :1], "raw"),
        )
    assert err.value.status == 409 and err.value.code == "session_out_of_sync"
    too_long = torch.zeros(1, 32 - len(PROMPT) + 1, dtype=torch.long)
    for bad, match in [
        (dict(inputs=encode_tensor(torch.tensor([[300]]), "raw")), "token ids"),
        (dict(inputs=encode_tensor(too_long, "raw")), "max_length"),
        (dict(inputs=encode_tensor(torch.zeros(2, 1, dtype=torch.long), "raw")), "batch 1"),
        (dict(inputs=encode_tensor(ids[:, :2], "raw"), chunks=[1]), "chunks"),
    ]:
        with pytest.raises(RemoteError) as err:
            await post(http_session, s0, "/session/step", stage=0, session_id="a", position=len(PROMPT), **bad)
        assert err.value.status == 400 and match in str(err.value), (match, err.value)
    for bad in [
        dict(batch=0, max_length=8),
        dict(batch=1, max_length=10**6),
        dict(batch=1, max_length=8, session_id=""),
    ]:
        with pytest.raises(RemoteError) as err:
            await post(http_session, s0, "/session/open", stage=0, **{"session_id": "b", **bad})
        assert err.value.status == 400
    with pytest.raises(RemoteError) as err:
        await post(http_session, s0, "/session/open", stage=1, session_id="b", batch=1, max_length=8)
    assert err.value.status == 409 and err.value.code == "wrong_stage"
    closed = await post(http_session, s0, "/session/close", stage=0, session_id="a")
    assert closed["closed"] is True


async def test_a_replay_in_chunks_rebuilds_the_cache_exactly(start_stages, http_session):
    _, urls = await start_stages(
        [[stage_settings(0, num_stages=2), stage_settings(0, num_stages=2)], [stage_settings(1, num_stages=2)]]
    )
    a, b = urls[0]
    hidden = []
    ids = torch.tensor([PROMPT], dtype=torch.long)
    await post(http_session, a, "/session/open", stage=0, session_id="s", batch=1, max_length=32)
    for start, stop in [(0, 10), (10, 11), (11, 12), (12, len(PROMPT))]:
        reply = await post(
            http_session,
            a,
            "/session/step",
            stage=0,
            session_id="s",
            position=start,
            inputs=encode_tensor(ids[:, start:stop], "raw"),
        )
        hidden.append(reply["outputs"])
    await post(http_session, b, "/session/open", stage=0, session_id="s", batch=1, max_length=32)
    replay = await post(
        http_session,
        b,
        "/session/step",
        stage=0,
        session_id="s",
        position=0,
        inputs=encode_tensor(ids, "raw"),
        chunks=[10, 1, 1, len(PROMPT) - 12],
    )
    assert (
        replay["position"] == len(PROMPT) and replay["outputs"]["data"] == hidden[-1]["data"]
    )  # the last chunk's output, bit for bit


async def test_session_memory_is_bounded_per_server_and_per_session(start_stages, http_session):
    cfg = config_from_preset("tiny")
    per_position = 2 * 1 * cfg.n_head * (cfg.d_model // cfg.n_head) * 4  # stage 0 of 4 holds one block
    budget_mb = 100 * per_position / 2**20  # room for 100 positions
    _, urls = await start_stages([[stage_settings(0, session_memory_mb=budget_mb, session_max_mb=budget_mb * 0.8)]])
    s0 = urls[0][0]
    opened = await post(http_session, s0, "/session/open", stage=0, session_id="a", batch=1, max_length=60)
    assert opened["bytes"] == 60 * per_position
    with pytest.raises(RemoteError) as err:  # 60 + 60 > 100: the server is full for now
        await post(http_session, s0, "/session/open", stage=0, session_id="b", batch=1, max_length=60)
    assert err.value.status == 503 and err.value.code == "overloaded" and err.value.retry_after_s
    with pytest.raises(RemoteError) as err:  # 90 > 80: no session may be this large here
        await post(http_session, s0, "/session/open", stage=0, session_id="c", batch=1, max_length=90)
    assert err.value.status == 400 and "SWARM_SESSION_MAX_MB" in str(err.value)
    await post(http_session, s0, "/session/close", stage=0, session_id="a")
    await post(http_session, s0, "/session/open", stage=0, session_id="b", batch=1, max_length=60)
    async with http_session.get(s0 + "/health") as resp:
        sessions = (await resp.json())["sessions"]
    assert (
        sessions["open"] == 1
        and sessions["opened"] == 2
        and sessions["refused"] == 2
        and sessions["reserved_mb"] == round(60 * per_position / 2**20, 3)
    )


def test_idle_sessions_expire_after_the_ttl_and_free_their_memory():
    now = [0.0]
    store = SessionStore(memory_bytes=1000, session_bytes=1000, ttl_s=10, clock=lambda: now[0])
    store.open("a", 1, 4, 400)
    store.open("b", 1, 4, 400)
    now[0] = 6
    store.get("b")  # b was used: its idle time starts again
    now[0] = 12
    assert store.expire() == 1 and len(store) == 1 and store.reserved_bytes == 400
    store.open("c", 1, 4, 600)
    now[0] = 30
    assert store.expire() == 2 and store.reserved_bytes == 0 and store.expired == 3


async def test_sessions_run_beside_training_and_never_change_the_weights(start_stages, http_session):
    apps, urls = await start_stages([[stage_settings(0, num_stages=1, global_batch=2)]])
    runtime = apps[0][0][RUNTIME]
    session = SwarmSession(http_session, balancer_for(urls), run_id="test", max_length=32)
    digest, version = runtime.digest(), runtime.version
    await session.step(PROMPT)
    await session.step([10])
    assert (runtime.digest(), runtime.version, runtime.stats.backwards) == (
        digest,
        version,
        0,
    )  # sessions leave weights and stats alone
    ids = torch.tensor([PROMPT, PROMPT[::-1]], dtype=torch.long)
    trained = await post(
        http_session,
        urls[0][0],
        "/backward",
        stage=0,
        microbatch_id="train-0",
        seed=0,
        inputs=encode_tensor(ids[:, :-1], "raw"),
        targets=encode_tensor(ids[:, 1:], "raw"),
    )
    assert trained["stage_step"] == 1 and runtime.digest() != digest  # a global batch of 2: the stage stepped
    await session.step([11])  # the session goes on, on the new weights
    assert session.stats.weights_steps == {0, 1}
    await session.close()


async def test_a_scoring_prefill_gives_every_positions_log_probabilities_of_one_process(start_stages, http_session):
    _, urls = await start_stages([[stage_settings(s)] for s in range(4)])
    prompts = [PROMPT, PROMPT[:5]]
    ids = torch.zeros(2, len(PROMPT), dtype=torch.long)  # right-padded with 0
    targets = torch.full((2, len(PROMPT)), -1, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(p)
        targets[row, : len(p) - 1] = torch.tensor(p[1:])
    session = SwarmSession(http_session, balancer_for(urls), run_id="test", max_length=len(PROMPT), batch=2)
    async with session:
        scores = await session.score(ids, targets, top_logprobs=3, logits_at=[len(p) - 1 for p in prompts])
    assert session.stats.steps == 1 and session.stats.weights_steps == {0}  # one pass, one weights version

    model = build_model(config_from_preset("tiny"), seed=0).eval()
    for row, p in enumerate(prompts):
        with torch.no_grad():
            logits = model(torch.tensor([p]))[0]  # (T, vocab): the prompt alone, unpadded
        expected = torch.log_softmax(logits, dim=-1)
        n = len(p)
        got = scores.target_logprobs[row, : n - 1]
        assert torch.allclose(got, expected[torch.arange(n - 1), torch.tensor(p[1:])], atol=1e-5)
        assert (scores.target_logprobs[row, n - 1 :] == 0).all()  # no target past the prompt
        assert (scores.top_ids[row, :n] == expected.topk(3, dim=-1).indices).all()
        assert torch.allclose(scores.top_logprobs[row, :n], expected.topk(3, dim=-1).values, atol=1e-5)
        assert torch.allclose(scores.logits[row], logits[-1], atol=1e-5)  # the row's last position, not the padding's


async def test_scoring_fields_are_checked_and_only_the_last_stage_takes_them(start_stages, http_session):
    _, urls = await start_stages([[stage_settings(0, num_stages=2)], [stage_settings(1, num_stages=2)]])
    ids = torch.tensor([PROMPT[:4]], dtype=torch.long)
    hidden = torch.zeros(1, 4, config_from_preset("tiny").d_model)
    targets = encode_tensor(torch.tensor([[1, 2, 3, -1]]), "raw")
    for s, url in enumerate(u for (u,) in urls):
        await post(http_session, url, "/session/open", stage=s, session_id="a", batch=1, max_length=8)
    with pytest.raises(RemoteError) as err:
        await post(
            http_session,
            urls[0][0],
            "/session/step",
            stage=0,
            session_id="a",
            position=0,
            inputs=encode_tensor(ids, "raw"),
            targets=targets,
        )
    assert err.value.status == 400 and "last stage" in str(err.value)
    for bad, match in [
        (dict(targets=encode_tensor(torch.tensor([[1, 2, 3]]), "raw")), "shape"),
        (dict(targets=encode_tensor(torch.tensor([[1, 2, 3, 256]]), "raw")), "must lie in"),
        (dict(targets=encode_tensor(torch.zeros(1, 4), "fp32")), "integer"),
        (dict(targets=targets, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "needs 'targets'"),
        (dict(logits_at=[4]), "logits_at"),
        (dict(logits_at=[0, 1]), "logits_at"),
    ]:
        with pytest.raises(RemoteError) as err:
            await post(
                http_session,
                urls[1][0],
                "/session/step",
                stage=1,
                session_id="a",
                position=0,
                inputs=encode_tensor(hidden, "fp32"),
                **bad,
            )
        assert err.value.status == 400 and match in str(err.value), (match, err.value)
    reply = await post(
        http_session,
        urls[1][0],
        "/session/step",
        stage=1,
        session_id="a",
        position=0,
        inputs=encode_tensor(hidden, "fp32"),
        targets=targets,
        logits_at=[1],
    )
    assert reply["target_logprobs"]["shape"] == [1, 4] and reply["logits"]["shape"] == [1, 256]
    assert "top_ids" not in reply
