"""LoRA on a stage (shared.lora): which modules it targets and the errors a person can act
on, the layer against peft's on the same Hugging Face model (adapters out, merged weights),
a stage runtime that trains only the adapters and never touches the base, states that carry
the adapters and refuse another base, and the memory estimate."""

from __future__ import annotations

import json

import peft  # a test dependency (the dev extra): these tests fail, never skip, without it
import pytest
import torch
import transformers

from services.stage_server.memory import check_stage_memory
from services.stage_server.runtime import Accumulated, OptimizerConfig, StageRuntime
from services.stage_server.state import load_stage_state, stage_state
from shared.errors import WrongStage
from shared.hf import load_stage_from_hf, read_hf_config
from shared.lora import (
    ADAPTER_CONFIG,
    LoraConfig,
    LoraError,
    LoraLinear,
    adapter_parameters,
    apply_lora,
    base_fingerprint,
    merge_into,
    save_peft,
    target_modules,
)
from shared.model import config_from_preset, partition
from tests.hf_models import gpt2_config, llama_config, save_model_dir

LLAMA_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("llama"), llama_config(), tokenizer=False)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("gpt2"), gpt2_config(), tokenizer=False)


def whole_lora_model(model_dir, lora: LoraConfig, seed: int = 0):
    cfg = read_hf_config(model_dir)
    model, _ = load_stage_from_hf(model_dir, cfg, partition(cfg, 1)[0])
    apply_lora(model, cfg, lora, seed)
    return cfg, model.eval()


def randomize_adapters(model, seed: int = 1) -> dict[str, torch.Tensor]:
    """B starts at zero (the base model): give every adapter values, as training would."""
    gen = torch.Generator().manual_seed(seed)
    adapters = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                adapters[name] = p.detach().clone()
    return adapters


# ---------------------------------------------------------------- targets
def test_all_linear_targets_every_block_linear_but_never_the_lm_head(llama_dir):
    cfg = read_hf_config(llama_dir)
    chosen = target_modules(cfg, LoraConfig(4))
    assert len(chosen) == 7 * cfg.n_layer and not any("lm_head" in m for m in chosen)
    qv = target_modules(cfg, LoraConfig(4, target_modules=("q_proj", "self_attn.v_proj")))
    assert sorted(qv) == sorted(f"blocks.{i}.attn.{w}" for i in range(cfg.n_layer) for w in ("wq", "wv"))
    one = target_modules(cfg, LoraConfig(4, target_modules=("model.layers.2.mlp.down_proj",)))
    assert list(one) == ["blocks.2.mlp.w2"]
    # a stage holds only its own layers' targets
    specs = partition(cfg, 2)
    assert all(m.startswith(("blocks.0.", "blocks.1.")) for m in target_modules(cfg, LoraConfig(4), specs[0]))
    assert adapter_parameters(cfg, LoraConfig(4), specs[0]) + adapter_parameters(
        cfg, LoraConfig(4), specs[1]
    ) == adapter_parameters(cfg, LoraConfig(4))


def test_gpt2_targets_take_the_conv1d_names(gpt2_dir):
    cfg = read_hf_config(gpt2_dir)
    chosen = target_modules(cfg, LoraConfig(4, target_modules=("c_proj",)))
    assert sorted(chosen) == sorted(f"blocks.{i}.{m}.c_proj" for i in range(cfg.n_layer) for m in ("attn", "mlp"))


def test_a_target_the_model_lacks_and_a_rank_too_large_are_refused_naming_the_setting(llama_dir):
    cfg = read_hf_config(llama_dir)
    with pytest.raises(LoraError) as missing:
        target_modules(cfg, LoraConfig(4, target_modules=("q_proj", "query_key_value")))
    message = str(missing.value)
    assert "SWARM_LORA_TARGET_MODULES" in message and "'query_key_value'" in message
    assert all(name in message for name in LLAMA_LINEARS)
    with pytest.raises(LoraError, match=r"SWARM_LORA_RANK=40 .*v_proj allows \(64 -> 32: at most 32\)"):
        target_modules(cfg, LoraConfig(40, target_modules=("v_proj",)))
    for bad in (dict(rank=0), dict(rank=2, dropout=1.0), dict(rank=2, base_dtype="fp8")):
        with pytest.raises(LoraError):
            LoraConfig(**bad)


# ---------------------------------------------------------------- the layer and peft
def test_adapters_start_at_the_base_model_and_alike_in_any_cut(llama_dir):
    cfg, whole = whole_lora_model(llama_dir, LoraConfig(4), seed=3)
    base, _ = load_stage_from_hf(llama_dir, cfg, partition(cfg, 1)[0])
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(whole(x), base.eval()(x))  # B = 0
    adapters = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    for spec in partition(cfg, 2):
        stage, _ = load_stage_from_hf(llama_dir, cfg, spec)
        apply_lora(stage, cfg, LoraConfig(4), 3)
        for name, p in stage.named_parameters():
            if p.requires_grad:
                assert torch.equal(p, adapters[name]), name


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_peft_loads_the_adapters_onto_the_base_and_computes_the_same_logits(which, llama_dir, gpt2_dir, tmp_path):
    model_dir = llama_dir if which == "llama" else gpt2_dir
    lora = LoraConfig(4, alpha=16, target_modules=("all-linear",))
    cfg, ours = whole_lora_model(model_dir, lora)
    adapters = randomize_adapters(ours)
    save_peft(tmp_path / "adapter", adapters, cfg, lora, base_model=str(model_dir))
    written = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 16 and written["fan_in_fan_out"] == (which == "gpt2")

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    lora_params = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert len(lora_params) == len(adapters)  # every adapter has a place: none loaded as nothing
    assert all(p.abs().sum() > 0 for p in lora_params.values())  # and holds the values written (B is 0 unloaded)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        theirs, mine = loaded(x).logits, ours(x)
    assert torch.allclose(theirs, mine, atol=1e-5), (theirs - mine).abs().max()

    # merged: W + B A alpha / r in the base weights is the same model
    params = {n: t.clone() for n, t in ours.state_dict().items() if ".lora_" not in n}
    merge_into(params, adapters, lora)
    merged, _ = load_stage_from_hf(model_dir, cfg, partition(cfg, 1)[0])
    merged.load_state_dict(params, strict=True)
    with torch.no_grad():
        gap = (merged.eval()(x) - mine).abs().max()
    assert gap < 1e-4, gap  # the same sums in another order (measured: a few 1e-6)


@pytest.mark.parametrize("base_dtype", ["bf16", "int8"])
def test_a_base_held_in_bf16_or_int8_computes_close_to_fp32_in_less_memory(base_dtype, llama_dir):
    _, full = whole_lora_model(llama_dir, LoraConfig(4))
    _, small = whole_lora_model(llama_dir, LoraConfig(4, base_dtype=base_dtype))
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        a, b = full(x), small(x)
    assert (a - b).abs().max() < 0.05 * a.abs().max()

    def linear_bytes(model):
        return sum(
            t.numel() * t.element_size()
            for m in model.modules()
            if isinstance(m, LoraLinear)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
            if not t.requires_grad
        )

    assert linear_bytes(small) < 0.55 * linear_bytes(full)


# ---------------------------------------------------------------- the runtime
def lora_runtime(model_dir, stage: int, num_stages: int, lora: LoraConfig, **kw) -> StageRuntime:
    cfg = read_hf_config(model_dir)
    model, report = load_stage_from_hf(model_dir, cfg, partition(cfg, num_stages)[stage])
    rt = StageRuntime(cfg, stage, num_stages, model=model, lora=lora, solo=False, **kw)
    rt.load_report = report
    return rt


def train_step(stages: list[list[StageRuntime]], step: int, gen: torch.Generator) -> None:
    """One global step of a 2-stage pipeline with 2 replicas per stage: each replica pair runs
    one microbatch, the stage's mean gradient is what the all-reduce would give every member."""
    for r in range(2):
        x = torch.randint(0, 320, (2, 16), generator=gen)
        first, last = stages[0][r], stages[1][r]
        h = first.forward(f"{step}-{r}", step, x, None)
        back = last.backward(f"{step}-{r}", step, h, torch.roll(x, -1, 1), None)
        first.backward(f"{step}-{r}", step, x, None, back.grad_inputs, forward_step=step)
    for replicas in stages:
        taken = [rt.take_gradients() for rt in replicas]
        mean = sum(t.mean * t.samples for t in taken) / sum(t.samples for t in taken)
        for rt, t in zip(replicas, taken):
            rt.apply_step(Accumulated(mean, sum(x.samples for x in taken), t.microbatch_ids))


def test_only_adapters_train_replicas_stay_bit_identical_and_the_base_never_changes(llama_dir):
    lora = LoraConfig(4, target_modules=("q_proj", "v_proj"))
    optim = OptimizerConfig(lr=1e-2, global_batch=4)
    stages = [[lora_runtime(llama_dir, s, 2, lora, optim=optim) for _ in range(2)] for s in range(2)]
    base_before = [base_fingerprint(rt.model) for rt in stages[0] + stages[1]]
    for rt in stages[0] + stages[1]:
        assert rt.param_names and all(".lora_" in n for n in rt.param_names)
        assert all(p.requires_grad == (".lora_" in n) for n, p in rt.model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        train_step(stages, step, gen)
        for replicas in stages:
            assert replicas[0].digest() == replicas[1].digest(), f"step {step}"
            states = [stage_state(rt)[0] for rt in replicas]
            assert states[0].keys() == states[1].keys()
            assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert [base_fingerprint(rt.model) for rt in stages[0] + stages[1]] == base_before
    assert stages[1][0].optimizer.state, "AdamW holds state for the adapters"
    assert all(".lora_" in n for n in stage_state(stages[1][0])[0] if not n.startswith("optim/"))
    assert any(p.abs().sum() > 0 for n, p in stages[1][0].named_params() if n.endswith("lora_B"))


def test_a_state_carries_the_adapters_and_is_refused_on_another_base_or_other_settings(llama_dir, tmp_path):
    lora = LoraConfig(4)
    donor = lora_runtime(llama_dir, 1, 2, lora, optim=OptimizerConfig(lr=1e-2, global_batch=2))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 320, (2, 16), generator=gen)
    h = torch.randn(2, 16, 64, generator=gen)
    donor.backward("m", 0, h, x, None)
    donor.apply_step(donor.take_gradients())
    tensors, meta = stage_state(donor)
    assert meta["lora"]["rank"] == 4 and meta["base_fingerprint"] == donor.lora_report.base_fingerprint
    assert meta["base_model"] == str(llama_dir)

    joiner = lora_runtime(llama_dir, 1, 2, lora)
    load_stage_state(joiner, tensors, meta)
    assert joiner.digest() == donor.digest() and joiner.step == 1

    other_dir = save_model_dir(tmp_path / "other", llama_config(), seed=1, tokenizer=False)  # same config
    stranger = lora_runtime(other_dir, 1, 2, lora)
    with pytest.raises(WrongStage, match="another base model"):
        load_stage_state(stranger, tensors, meta)
    with pytest.raises(WrongStage, match="LoRA settings"):
        load_stage_state(lora_runtime(llama_dir, 1, 2, LoraConfig(8)), tensors, meta)


def test_a_stage_with_no_target_module_trains_nothing_and_passes_gradients_on(llama_dir):
    lora = LoraConfig(2, target_modules=("model.layers.3.self_attn.q_proj",))
    first, last = (lora_runtime(llama_dir, s, 2, lora, optim=OptimizerConfig(global_batch=2)) for s in range(2))
    assert first.lora_report.targets == () and first.params == [] and last.lora_report.trainable > 0
    x = torch.randint(0, 320, (2, 16))
    h = first.forward("m", 0, x, None)
    back = last.backward("m", 0, h, x, None)
    assert back.grad_inputs is not None and back.grad_inputs.abs().sum() > 0
    first.backward("m", 0, x, None, back.grad_inputs, forward_step=0)
    fp = base_fingerprint(first.model)
    first.apply_step(first.take_gradients())
    assert first.step == 1 and base_fingerprint(first.model) == fp


def test_the_memory_estimate_counts_optimizer_state_for_the_adapters_only():
    cfg = config_from_preset("llama-tiny")
    spec = partition(cfg, 2)[0]
    full = check_stage_memory(cfg, spec, "cpu", free_bytes=2**40)
    lora = LoraConfig(8, target_modules=("q_proj", "v_proj"))
    adapted = check_stage_memory(cfg, spec, "cpu", free_bytes=2**40, lora=lora)
    int8 = check_stage_memory(cfg, spec, "cpu", free_bytes=2**40, lora=LoraConfig(8, base_dtype="int8"))
    assert adapted < full / 4 and int8 < adapted
    with pytest.raises(ValueError, match="bytes per adapter parameter"):
        check_stage_memory(cfg, spec, "cpu", free_bytes=1, lora=lora)


def test_generation_with_the_kv_cache_runs_through_the_adapters(llama_dir):
    """Inference sessions (``swarm generate``, ``/v1/``) run the stage's model with a KV cache:
    token by token, base plus adapters give the logits of the whole sequence at once."""
    from shared.kv_cache import KVCache

    cfg, model = whole_lora_model(llama_dir, LoraConfig(4))
    randomize_adapters(model)
    base, _ = load_stage_from_hf(llama_dir, cfg, partition(cfg, 1)[0])
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        whole = model(x)
        cache = KVCache(capacity=16)
        prefix = model(x[:, :8], None, cache)
        steps = [model(x[:, i : i + 1], None, cache) for i in range(8, 12)]
        assert not torch.allclose(whole, base.eval()(x), atol=1e-3)  # the adapters change the model
    assert torch.allclose(torch.cat([prefix, *steps], dim=1), whole, atol=1e-5)
