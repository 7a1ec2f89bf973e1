"""Tiny random Hugging Face models and tokenizers, created with ``transformers`` and saved
to a directory, as a user's model directory would be (config.json, safetensors, tokenizer).

Callers skip when ``transformers`` is missing (``pytest.importorskip``): it is a test
dependency only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.tokenizer import train_bpe

TEXT = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles. "
) * 40
VOCAB = 320  # the models' vocabulary; the tokenizers trained here have 300 tokens


def save_tokenizer_dir(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens in ``path`` (tokenizer.json, tokenizer_config.json)."""
    train_bpe([TEXT, TEXT.upper()], vocab_size, path)
    return path


def llama_config(arch: str = "llama", **overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    common.update(overrides)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    if arch == "mistral":
        return transformers.MistralConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, sliding_window=48
        )
    return transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def gpt2_config(**overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    common.update(overrides)
    return transformers.GPT2Config(**common)


def save_model_dir(
    path: Path, config, *, seed: int = 0, max_shard_size: str | None = None, tokenizer: bool = True
) -> Path:
    """A random model of ``config`` saved with ``save_pretrained`` into ``path`` (sharded past
    ``max_shard_size``), with a tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norms and biases too, so that a weight read wrongly shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        save_tokenizer_dir(path)
    return path


def load_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
