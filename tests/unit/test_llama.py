"""The llama family and the stage interface both families share, without networking."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from shared.llama import Attention, LlamaConfig, LlamaStage, apply_rotary, rotary_tables
from shared.model import (
    PRESETS,
    GPTConfig,
    build_model,
    build_stage,
    config_from_dict,
    count_parameters,
    partition,
    whole_model,
    whole_parameters,
)

CFG = PRESETS["llama-tiny"]


def tokens(cfg, batch=2, seq=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


# ---------------------------------------------------------------- presets and counts
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_counts_its_parameters_on_meta_as_the_formula_does(name):
    cfg = PRESETS[name]
    with torch.device("meta"):  # a 7B model counted without memory
        model = whole_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)


def test_llama_presets_span_about_ten_million_to_seven_billion_with_the_known_shapes():
    assert 9e6 < count_parameters(PRESETS["llama-10m"]) < 12e6
    assert count_parameters(PRESETS["llama-135m"]) == 134_515_008  # SmolLM-135M
    assert count_parameters(PRESETS["llama-1b"]) == 1_100_048_384  # TinyLlama-1.1B
    assert count_parameters(PRESETS["llama-7b"]) == 6_738_415_616  # Llama-2-7B


@pytest.mark.parametrize("name", ["llama-135m", "llama-7b"])
def test_preset_count_equals_transformers_model_of_the_same_config(name):
    transformers = pytest.importorskip("transformers")
    from shared.hf import hf_config_dict

    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in hf_config_dict(PRESETS[name]).items() if k != "architectures"}
    )
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in theirs.parameters()) == count_parameters(PRESETS[name])


# ---------------------------------------------------------------- stages
def test_llama_stages_together_are_the_whole_model_with_the_same_weights():
    whole = build_model(CFG, seed=3).state_dict()
    parts = {}
    for s in range(4):
        state = build_stage(CFG, s, 4, seed=3).state_dict()
        assert not parts.keys() & state.keys()
        parts.update(state)
    assert parts.keys() == whole.keys() | {"lm_head.weight"}  # the tied head: a copy on the last stage
    for name, value in whole.items():
        assert torch.equal(parts[name], value), name
    assert torch.equal(parts["lm_head.weight"], whole["wte.weight"])


def test_chained_llama_stages_compute_the_whole_model_loss_and_logits():
    x, y = tokens(CFG)
    stages = [build_stage(CFG, s, 4, seed=0) for s in range(4)]
    h = x
    for stage in stages[:-1]:
        h = stage(h)
        assert h.shape == (*x.shape, CFG.d_model)
    whole = build_model(CFG, seed=0)
    assert torch.allclose(stages[-1](h, y), whole(x, y), rtol=1e-6)
    assert torch.allclose(stages[-1](h), whole(x), atol=1e-6)
    assert abs(whole(x, y).item() - math.log(CFG.vocab_size)) < 0.1  # untrained: near uniform


def test_a_tied_head_is_the_embedding_on_one_stage_and_a_copy_on_two():
    whole = build_model(CFG, seed=0)
    assert whole.lm_head.weight is whole.wte.weight
    assert "lm_head.weight" not in dict(whole.named_parameters())
    first, last = build_stage(CFG, 0, 2, seed=0), build_stage(CFG, 1, 2, seed=0)
    assert torch.equal(first.wte.weight, last.lm_head.weight) and first.wte.weight is not last.lm_head.weight


def test_whole_parameters_keep_the_tie_until_the_copies_differ():
    params = {**build_stage(CFG, 0, 2, seed=0).state_dict(), **build_stage(CFG, 1, 2, seed=0).state_dict()}
    kept, cfg = whole_parameters(params, CFG)
    assert cfg.tie_embeddings and "lm_head.weight" not in kept
    params["lm_head.weight"] = params["lm_head.weight"] + 1e-3  # trained apart on two stages
    untied, cfg = whole_parameters(params, CFG)
    assert not cfg.tie_embeddings and torch.equal(untied["lm_head.weight"], params["lm_head.weight"])
    whole_model(cfg).load_state_dict(untied, strict=True)


# ---------------------------------------------------------------- the maths
def test_grouped_query_attention_equals_attention_with_each_kv_head_shared_by_its_group():
    cfg = replace(CFG, n_head=4, n_kv_head=2)
    attn = Attention(cfg)
    torch.nn.init.normal_(attn.wq.weight, std=0.2), torch.nn.init.normal_(attn.wk.weight, std=0.2)
    x = torch.randn(2, 10, cfg.d_model, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary_tables(cfg, 10, x.device)
    B, T, hd = 2, 10, cfg.head_dim
    q = apply_rotary(attn.wq(x).view(B, T, 4, hd).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.wk(x).view(B, T, 2, hd).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(B, T, 2, hd).transpose(1, 2)
    heads = []
    for h in range(4):  # query head h reads key/value head h // 2
        scores = q[:, h] @ k[:, h // 2].transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        heads.append(F.softmax(scores, dim=-1) @ v[:, h // 2])
    expected = attn.wo(torch.stack(heads, dim=2).reshape(B, T, 4 * hd))
    assert torch.allclose(attn(x, cos, sin), expected, atol=1e-5)


def test_rotary_positions_keep_norms_and_make_scores_depend_on_the_offset_only():
    cfg = replace(CFG, rope_theta=500.0)
    cos, sin = rotary_tables(cfg, 32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(cfg.head_dim, generator=gen), torch.randn(cfg.head_dim, generator=gen)
    rotated = apply_rotary(q.expand(1, 1, 32, -1), cos, sin)[0, 0]
    assert torch.allclose(rotated.norm(dim=-1), q.norm().expand(32), rtol=1e-5)
    rk = apply_rotary(k.expand(1, 1, 32, -1), cos, sin)[0, 0]
    assert torch.allclose(rotated[5] @ rk[2], rotated[20] @ rk[17], rtol=1e-4)  # both 3 apart
    assert not torch.allclose(rotated[5] @ rk[2], rotated[5] @ rk[4], rtol=1e-2)


def test_rms_norm_scales_to_unit_root_mean_square():
    block = LlamaStage(CFG, partition(CFG, 4)[1]).blocks["1"]
    x = 3 * torch.randn(2, 5, CFG.d_model)
    y = block.attn_norm(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(2, 5), rtol=1e-3)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_activation_checkpointing_gives_the_same_gradients(name):
    cfg = PRESETS[name]
    x, y = tokens(cfg)
    grads = []
    for checkpointed in (False, True):
        model = build_model(cfg, seed=0)
        model.checkpoint_blocks = checkpointed
        model(x, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize("cfg", [PRESETS["tiny"], CFG, replace(CFG, qkv_bias=True, head_dim=64, n_head=2, n_kv_head=1)])
def test_config_round_trips_through_its_dict_and_names_its_family(cfg):
    d = cfg.to_dict()
    assert d["family"] == cfg.family
    assert config_from_dict(d) == cfg


def test_a_dict_without_family_is_a_gpt_of_before_the_llama_family():
    old = {
        k: v
        for k, v in PRESETS["tiny"].to_dict().items()
        if k in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "dropout", "bias")
    }
    assert config_from_dict(old) == PRESETS["tiny"]
    with pytest.raises(ValueError, match="family"):
        config_from_dict({**old, "family": "mamba"})
    with pytest.raises(ValueError):
        config_from_dict({"family": "llama", "n_heads": 3})


def test_gpt_presets_keep_their_layout():
    cfg = PRESETS["tiny"]
    assert isinstance(cfg, GPTConfig) and cfg.head_bias and not cfg.tie_embeddings and cfg.activation == "gelu"
    assert build_model(cfg, seed=0).lm_head.bias is not None


def test_llama_config_checks_its_heads():
    with pytest.raises(AssertionError, match="n_kv_head"):
        LlamaConfig(n_head=6, n_kv_head=4, d_model=96)
    assert LlamaConfig(n_head=4, d_model=64).head_dim == 16
