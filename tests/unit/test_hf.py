"""Hugging Face model directories in and out (shared/hf.py), against ``transformers``' own
models, saved by ``save_pretrained`` into temporary directories."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch

from shared import hf
from shared.hf import HFModelError, check_hf_dir, config_fingerprint, load_stage_from_hf, read_hf_config, save_hf
from shared.llama import LlamaConfig
from shared.model import PRESETS, GPTConfig, build_model, partition
from tests.hf_models import gpt2_config, llama_config, load_model, save_model_dir

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random models: llama (sharded), llama with a tied head, qwen2, gpt2 (tied)."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": save_model_dir(root / "llama", llama_config(), max_shard_size="60KB"),
        "llama-tied": save_model_dir(root / "llama-tied", llama_config(tie_word_embeddings=True), tokenizer=False),
        "qwen2": save_model_dir(root / "qwen2", llama_config("qwen2"), tokenizer=False),
        "gpt2": save_model_dir(root / "gpt2", gpt2_config(), tokenizer=False),
    }


def chained_logits(model_dir, num_stages, ids):
    cfg = read_hf_config(model_dir)
    x = ids
    for spec in partition(cfg, num_stages):
        stage, _ = load_stage_from_hf(model_dir, cfg, spec)
        x = stage(x)
    return x


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- config in
def test_configs_map_to_our_families(models, tmp_path):
    llama = read_hf_config(models["llama"])
    assert isinstance(llama, LlamaConfig)
    assert (llama.n_layer, llama.n_head, llama.n_kv_head, llama.d_model, llama.ffn_dim, llama.head_dim) == (
        4,
        4,
        2,
        64,
        96,
        16,
    )
    assert llama.rope_theta == 50000.0 and llama.norm_eps == 1e-5 and not llama.tie_embeddings and not llama.qkv_bias
    assert read_hf_config(models["llama-tied"]).tie_embeddings
    assert read_hf_config(models["qwen2"]).qkv_bias
    gpt = read_hf_config(models["gpt2"])
    assert isinstance(gpt, GPTConfig) and gpt.tie_embeddings and not gpt.head_bias and gpt.activation == "gelu_tanh"
    llama_config("mistral").save_pretrained(tmp_path)  # sliding window 48 < 64 positions: trained on 48
    assert read_hf_config(tmp_path).block_size == 48


@pytest.mark.parametrize(
    "change, words",
    [
        ({"architectures": ["BertForMaskedLM"]}, "BertForMaskedLM"),
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "Qwen3ForCausalLM"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_file_and_what_is_supported(tmp_path, change, words):
    llama_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HFModelError, match=words) as exc:
        read_hf_config(tmp_path)
    assert str(path) in str(exc.value) and "SWARM_MODEL" in str(exc.value)
    if "architectures" in change:
        assert "LlamaForCausalLM" in str(exc.value) and "GPT2LMHeadModel" in str(exc.value)


def test_a_missing_shard_is_named(models, tmp_path):
    import shutil

    broken = shutil.copytree(models["llama"], tmp_path / "broken")
    shards = sorted(broken.glob("model-*.safetensors"))
    assert len(shards) >= 3, "the fixture is sharded"
    shards[1].unlink()
    with pytest.raises(HFModelError, match=shards[1].name) as exc:
        check_hf_dir(broken)
    assert str(shards[1]) in str(exc.value)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    llama_config().save_pretrained(tmp_path)
    with pytest.raises(HFModelError, match="model.safetensors"):
        check_hf_dir(tmp_path)


def test_the_fingerprint_is_the_config_not_the_path(models, tmp_path):
    import shutil

    copy = shutil.copytree(models["llama"], tmp_path / "elsewhere")
    assert config_fingerprint(read_hf_config(copy)) == config_fingerprint(read_hf_config(models["llama"]))
    assert config_fingerprint(read_hf_config(models["qwen2"])) != config_fingerprint(read_hf_config(models["llama"]))


# ---------------------------------------------------------------- weights in
def test_a_stage_reads_only_its_own_layers_tensors(models, monkeypatch):
    """Every tensor read goes through safe_open(...).get_tensor: record them all."""
    opened, read = [], []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, path, **kwargs):
            opened.append(path)
            self.f = real_open(path, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(hf.safetensors, "safe_open", Recording)
    cfg = read_hf_config(models["llama"])
    spec = partition(cfg, 4)[1]  # a middle stage: layer 1 only
    _, report = load_stage_from_hf(models["llama"], cfg, spec)
    assert read and all(name.startswith("model.layers.1.") for name in read)
    assert len(read) == 9 == len(report.names)  # two norms, q, k, v, o, gate, up, down
    index = json.loads((models["llama"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert {p.rsplit("/", 1)[-1] for p in opened} == {index[n] for n in read}  # only the shards holding them
    assert report.bytes_read == sum(
        4 * n for n in (64, 64, 64 * 64, 32 * 64, 32 * 64, 64 * 64, 96 * 64, 96 * 64, 64 * 96)
    )


@pytest.mark.parametrize(
    "kind, stages", [("llama", 4), ("llama-tied", 2), ("llama-tied", 1), ("qwen2", 3), ("gpt2", 4)]
)
def test_stages_loaded_from_a_directory_compute_transformers_logits(models, kind, stages):
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = load_model(models[kind])(ids).logits
        ours = chained_logits(models[kind], stages, ids)
    assert relative_error(ours, theirs) < 1e-5


# ---------------------------------------------------------------- out
@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2", "gpt2"])
def test_saved_directory_loads_in_transformers_with_the_same_logits(models, kind, tmp_path):
    cfg = read_hf_config(models[kind])
    stage, _ = load_stage_from_hf(models[kind], cfg, partition(cfg, 1)[0])
    params = dict(stage.named_parameters())
    files = save_hf(tmp_path, params, cfg, max_shard_bytes=40_000, bos_token_id=0, eos_token_id=0)
    assert (tmp_path / "model.safetensors.index.json") in files and len(files) > 4  # sharded past 40 KB
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative_error(load_model(tmp_path)(ids).logits, stage(ids)) < 1e-5
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 0


def test_a_from_scratch_llama_saves_and_loads_back_through_our_reader(tmp_path):
    cfg = PRESETS["llama-tiny"]
    model = build_model(cfg, seed=0)
    save_hf(tmp_path, dict(model.named_parameters()), cfg, max_shard_bytes=2**30)
    assert (tmp_path / "model.safetensors").is_file() and read_hf_config(tmp_path) == cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        assert relative_error(load_model(tmp_path)(ids).logits, model(ids)) < 1e-5


def test_a_byte_gpt_preset_does_not_pretend_to_be_gpt2(tmp_path):
    with pytest.raises(ValueError, match="--format safetensors"):
        save_hf(tmp_path, {}, PRESETS["tiny"], max_shard_bytes=2**30)
