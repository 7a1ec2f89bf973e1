"""Unit tests of incremental decoding (shared.kv_cache), sampling and the text stream (shared.inference)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import shared.kv_cache as kv_cache_module
from shared.inference import LocalSession, SamplingParams, TextStream, generate, sample
from shared.kv_cache import KVCache, kv_cache_bytes
from shared.model import build_model, build_stage, config_from_preset
from shared.tokenizer import ByteTokenizer


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_cached_steps_give_the_logits_of_a_whole_forward(preset):
    cfg = config_from_preset(preset, block_size=64)
    model = build_model(cfg, seed=3).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids)  # (2, 40, V), no cache
        cache = KVCache(64)
        chunks = [model(ids[:, :17], None, cache)]  # a prompt, then one token at a time, then a chunk of 3
        for t in range(17, 37):
            chunks.append(model(ids[:, t : t + 1], None, cache))
        chunks.append(model(ids[:, 37:40], None, cache))
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(chunks, dim=1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_cached_steps_leave_cudnn_attention_out_and_training_keeps_it(preset, monkeypatch):
    """cuDNN's attention plans every new shape; a decoding step's key length is new every token
    (bf16 generation on an H100 ran at 5 tokens/s with it, 60 without). Training's shape is
    fixed, so it keeps every backend."""
    cfg = config_from_preset(preset, block_size=64)
    model = build_model(cfg, seed=3).eval()
    seen = []  # (cuDNN attention allowed, key length) of each attention call
    sdpa = kv_cache_module.F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), k.shape[2]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(kv_cache_module.F, "scaled_dot_product_attention", recording)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with torch.no_grad():
        model(ids)
        training = list(seen)
        seen.clear()
        cache = KVCache(64)
        model(ids[:, :8], None, cache)
        for t in range(8, 12):
            model(ids[:, t : t + 1], None, cache)
    assert training and all(allowed for allowed, _ in training)
    assert {length for _, length in seen} == {8, 9, 10, 11, 12}
    assert not any(allowed for allowed, _ in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_stages_with_caches_equal_the_whole_model_with_one(preset):
    cfg = config_from_preset(preset, block_size=64)
    stages = [build_stage(cfg, s, 2, seed=5).eval() for s in range(2)]
    whole = build_model(cfg, seed=5).eval()
    caches, reference = [KVCache(32), KVCache(32)], KVCache(32)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for chunk in (ids[:, :8], ids[:, 8:9], ids[:, 9:12]):
            x = chunk
            for stage, cache in zip(stages, caches):
                x = stage(x, None, cache)
            assert torch.equal(x, whole(chunk, None, reference))  # the same ops on the same values: bit for bit


def test_the_cache_refuses_positions_past_its_capacity_and_sizes_as_computed():
    cfg = config_from_preset("llama-tiny")
    model = build_model(cfg, seed=0).eval()
    cache = KVCache(8)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), None, cache)
        with pytest.raises(ValueError, match="holds 8 positions"):
            model(torch.zeros(1, 1, dtype=torch.long), None, cache)
    assert cache.nbytes == kv_cache_bytes(cfg, cfg.n_layer, 1, 8)  # n_kv_head (2), not n_head (4), heads kept
    assert kv_cache_bytes(cfg, cfg.n_layer, 1, 8) == 2 * 4 * 2 * 8 * 32 * 4


def test_sampling_params_refuse_bad_values():
    for bad in (
        {"max_tokens": 0},
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"stop": ("",)},
        {"seed": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_greedy_takes_the_argmax_and_sampling_is_reproducible_with_a_seed():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(logits, SamplingParams(), torch.Generator()) == 1
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [sample(logits, params, g) for g in [params.generator()] for _ in range(20)]
    again = [sample(logits, params, g) for g in [params.generator()] for _ in range(20)]
    assert draws == again and len(set(draws)) > 1
    top1 = SamplingParams(temperature=5.0, top_k=1, seed=1)
    assert {sample(logits, top1, top1.generator()) for _ in range(10)} == {1}
    nucleus = SamplingParams(temperature=1.0, top_p=0.5, seed=2)  # token 1 and 3 are ~0.48 each: the nucleus is {1, 3}
    assert {sample(logits, nucleus, g) for g in [nucleus.generator()] for _ in range(50)} == {1, 3}


def test_generate_stops_at_max_tokens_and_at_eos():
    cfg = config_from_preset("tiny", block_size=64)
    model = build_model(cfg, seed=0)

    async def run(params, eos_id=None):
        session = LocalSession(model, 64)
        return [t async for t in generate(session.step, [72, 105], params, eos_id=eos_id)]

    tokens = asyncio.run(run(SamplingParams(max_tokens=10)))
    assert len(tokens) == 10
    cut = asyncio.run(run(SamplingParams(max_tokens=10), eos_id=tokens[3]))
    assert cut == tokens[: tokens.index(tokens[3])]
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(run_empty(model))


async def run_empty(model):
    async for _ in generate(LocalSession(model, 8).step, [], SamplingParams()):
        pass


def test_text_stream_holds_back_partial_characters_and_stops_before_a_stop_string():
    tok = ByteTokenizer()
    stream = TextStream(tok.decode)
    out = [stream.push(b) for b in "né!".encode()]
    assert out == ["n", "", "é", "!"]  # é is two bytes: nothing until both came
    stream = TextStream(tok.decode, stop=["END"])
    pieces = [stream.push(b) for b in b"abEN"]
    assert "".join(pieces) == "ab"  # "EN" may become "END"
    assert stream.push(ord("X")) == "ENX"  # it did not
    for b in b"yEND more":
        stream.push(b)
    assert stream.stopped and stream.out == "abENXy" and stream.flush() == ""
