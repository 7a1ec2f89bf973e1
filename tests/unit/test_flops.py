"""Model FLOPs of a stage (``shared.flops``): one layer counted by hand in both families,
the whole stages against torch's own FLOP counter, and the runtime's counts of the tokens
whose work counts (trained, evaluated; not duplicates, not recomputes)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from services.stage_server.runtime import StageRuntime
from shared.flops import model_flops, stage_flops
from shared.llama import LlamaConfig
from shared.model import GPTConfig, StageSpec, build_stage, partition

GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32)
LLAMA = LlamaConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_kv_head=2, d_model=32, ffn_dim=48)
SEQ = 16


def middle(cfg) -> StageSpec:
    """The middle stage of three: one block, no embedding, no LM head."""
    spec = partition(cfg, 3)[1]
    assert spec.layers == range(1, 2)
    return spec


def test_one_gpt_layer_by_hand():
    # d_model 32, 2 heads of 16, MLP 4 x 32 = 128, a sequence of 16 tokens
    # projections, multiply-adds per token: c_attn 32 x 96 = 3072, c_proj 32 x 32 = 1024,
    # c_fc 32 x 128 = 4096, mlp c_proj 128 x 32 = 4096: 12288 (= 12 d^2), 2 FLOPs each -> 24576
    # attention, per sequence: q k^T 2 heads x 16 x 16 pairs x 16 = 8192 multiply-adds, p v the same:
    # 16384 multiply-adds = 32768 FLOPs over the full square, 32768 / 16 tokens = 2048 per token
    forward_per_token = 24576 + 2048  # 26624
    flops = stage_flops(GPT, middle(GPT))
    assert flops.per_token(SEQ, train=False) == forward_per_token
    assert flops.per_token(SEQ) == 3 * forward_per_token == 79872  # backward: twice the forward
    assert flops.forward(tokens=2 * SEQ, token_pairs=2 * SEQ**2) == 2 * SEQ * forward_per_token  # 2 sequences


def test_one_llama_layer_by_hand():
    # d_model 32, 4 query heads and 2 key/value heads of 8, SwiGLU 48, a sequence of 16 tokens
    # projections, multiply-adds per token: wq 32 x 32 = 1024, wk 32 x 16 = 512, wv 32 x 16 = 512,
    # wo 32 x 32 = 1024, w1 32 x 48 = 1536, w3 1536, w2 48 x 32 = 1536: 7680, 2 FLOPs each -> 15360
    # attention, per sequence: every one of the 4 query heads scores 16 x 16 pairs over 8 dimensions
    # (q k^T 2048 multiply-adds, p v 2048): 4096 x 4 heads = 16384 multiply-adds = 32768 FLOPs, 2048 per token
    forward_per_token = 15360 + 2048  # 17408
    flops = stage_flops(LLAMA, middle(LLAMA))
    assert flops.per_token(SEQ, train=False) == forward_per_token
    assert flops.per_token(SEQ) == 3 * forward_per_token == 52224


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_embeddings_cost_nothing_and_the_last_stage_adds_the_lm_head(cfg):
    first, mid, last = (stage_flops(cfg, spec) for spec in partition(cfg, 3))
    assert first == mid  # token (and GPT's position) embeddings: lookups, 0 FLOPs
    assert last.forward(1, 0) - mid.forward(1, 0) == 2 * 32 * 64  # the head: d_model x vocab multiply-adds
    whole = model_flops(cfg)
    assert whole.forward(SEQ, SEQ**2) == sum(s.forward(SEQ, SEQ**2) for s in (first, mid, last))


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_counts_equal_torch_flop_counter(cfg, stage):
    """torch's FlopCounterMode counts every matmul the stage runs; with the math attention
    kernel (which computes the full square of scores, then masks) it counts what
    ``shared.flops`` counts, forward and backward."""
    model = build_stage(cfg, stage, 3, seed=0)
    B = 3
    gen = torch.Generator().manual_seed(0)
    x = (
        torch.randint(0, cfg.vocab_size, (B, SEQ), generator=gen)
        if stage == 0
        else torch.randn(B, SEQ, cfg.d_model, generator=gen, requires_grad=True)
    )
    targets = torch.randint(0, cfg.vocab_size, (B, SEQ), generator=gen) if stage == 2 else None
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as forward:
        out = model(x, targets)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as backward:
        (out if stage == 2 else out.square().mean()).backward()
    flops = stage_flops(cfg, partition(cfg, 3)[stage])
    assert forward.get_total_flops() == flops.forward(B * SEQ, B * SEQ**2)
    assert backward.get_total_flops() == flops.train(B * SEQ, B * SEQ**2) - flops.forward(B * SEQ, B * SEQ**2)


def test_the_runtime_counts_trained_and_evaluated_tokens_once():
    rt = StageRuntime(GPT, 1, 3, seed=0)
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)
    rt.forward("a", 0, x, None)  # a training forward counts when its backward accumulates
    assert (rt.stats.tokens_trained, rt.stats.tokens_evaluated) == (0, 0)
    rt.backward("a", 0, x, None, g, forward_step=0)
    assert (rt.stats.tokens_trained, rt.stats.token_pairs_trained) == (2 * 8, 2 * 8**2)
    rt.backward("a", 0, x, None, g, forward_step=0)  # a duplicate: computed, not accumulated, not counted
    rt.backward("b", 0, x, None, g, bucket=-1)  # the input gradient only (past the run's last step)
    assert (rt.stats.tokens_trained, rt.stats.token_pairs_trained) == (16, 128)
    rt.forward("e", 0, x[:1, :4], None, keep_graph=False)  # an evaluation: 1 sequence of 4 tokens
    assert (rt.stats.tokens_evaluated, rt.stats.token_pairs_evaluated) == (4, 16)
    assert rt.stats.tokens_trained == 16


def test_lora_counts_the_adapters_products_and_no_weight_gradient_of_the_frozen_base():
    """A frozen product's backward is its input's gradient only: 2 forwards of it, not 3."""
    from shared.lora import LoraConfig, adapter_parameters
    from shared.model import config_from_preset

    cfg = config_from_preset("llama-tiny")
    spec = partition(cfg, 2)[1]
    lora = LoraConfig(4, target_modules=("q_proj", "v_proj"))
    full, tuned = stage_flops(cfg, spec), stage_flops(cfg, spec, lora)
    adapters = adapter_parameters(cfg, lora, spec)
    assert adapters == 2 * 4 * ((128 + 128) + (128 + 64))  # two blocks: wq (128 -> 128), wv (128 -> 64)
    assert tuned.matmul_weights == full.matmul_weights + adapters
    tokens, pairs = 32, 32 * 32
    attention = 4 * full.attention_width * pairs  # q k^T and p v, forward
    expected = (
        2 * tuned.matmul_weights * tokens
        + attention  # forward
        + 2 * tuned.matmul_weights * tokens  # every input's gradient
        + 2 * adapters * tokens  # the adapters' weight gradients only
        + 2 * attention  # attention's backward: both operands
    )
    assert tuned.train(tokens, pairs) == expected
    assert full.train(tokens, pairs) == 3 * full.forward(tokens, pairs)


def test_an_inference_session_counts_its_new_positions_against_the_cached_ones_as_torch_counts_them(monkeypatch):
    """A session's step (``sessions._step``) of n new positions after p cached ones computes n
    rows of attention over p + n keys: counted as forward FLOPs of B n tokens and B n (p + n)
    pairs, which is what torch's FLOP counter measures (on the plain attention kernel: it does
    not count the fused ones decoding may take); its time counts as compute."""
    from services.stage_server.sessions import _step
    from shared import kv_cache
    from shared.kv_cache import KVCache

    monkeypatch.setattr(kv_cache, "_DECODING_BACKENDS", [SDPBackend.MATH])

    rt = StageRuntime(GPT, 1, 3, seed=0)
    flops = stage_flops(GPT, middle(GPT))
    cache, x = KVCache(16), torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counted:
        _step(rt, cache, x[:, :5], [3, 2], None)  # a prefill in two chunks: 3 new after 0, 2 new after 3
        _step(rt, cache, x[:, 5:9], [4], None)  # 4 new after 5
    pairs = 2 * (3 * 3 + 2 * 5 + 4 * 9)
    assert (rt.stats.tokens_inferred, rt.stats.token_pairs_inferred) == (2 * 9, pairs)
    assert counted.get_total_flops() == flops.forward(2 * 9, pairs)
    assert rt.stats.compute_s > 0 and rt.stats.tokens_trained == rt.stats.tokens_evaluated == 0
