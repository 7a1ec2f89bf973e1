"""Hugging Face model directories in and out: config.json, safetensors, names.

In: :func:`read_hf_config` turns a directory's ``config.json`` into our config (the
architectures of :data:`SUPPORTED`; anything else is refused naming them), :func:`check_hf_dir`
checks at start that every weight file and tensor the model needs is there, and
:func:`load_stage_from_hf` builds one stage from the tensors of its own layers only: each
safetensors file is opened lazily (``safe_open``) and only the stage's tensors are read,
so a stage of a 7B model never loads the whole file. Out: :func:`save_hf` writes
``config.json``, ``generation_config.json`` and ``model.safetensors`` (sharded past a size,
with ``model.safetensors.index.json``) that ``transformers.AutoModelForCausalLM`` loads.

Names (ours <-> Hugging Face's), per layer ``i``::

    llama  wte.weight <-> model.embed_tokens.weight, blocks.i. <-> model.layers.i.,
           attn_norm <-> input_layernorm, attn.wq|wk|wv|wo <-> self_attn.q_proj|k_proj|v_proj|o_proj,
           mlp_norm <-> post_attention_layernorm, mlp.w1|w3|w2 <-> mlp.gate_proj|up_proj|down_proj,
           norm.weight <-> model.norm.weight, lm_head.weight <-> lm_head.weight
    gpt    wte|wpe|ln_f <-> transformer.wte|wpe|ln_f, blocks.i. <-> transformer.h.i., the rest
           alike; GPT-2's Conv1D weights (c_attn, c_proj, c_fc) are stored transposed

A tied LM head (``tie_word_embeddings``) is read from the embedding's tensor.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from shared.llama import LlamaConfig
from shared.model import GPTConfig, ModelConfig, StageSpec, stage_model, whole_model

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt",
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
_SUPPORTED_TEXT = "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM (llama family), GPT2LMHeadModel (gpt family)"

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w3": "mlp.up_proj",
    "mlp.w2": "mlp.down_proj",
}
_LLAMA_TOP = {
    "wte.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_GPT_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


class HFModelError(ValueError):
    """A Hugging Face model directory that cannot be used; the message names the file."""


def is_hf_dir(model: str) -> bool:
    """True when SWARM_MODEL names a directory (rather than a preset)."""
    return bool(model) and Path(model).is_dir()


# ---------------------------------------------------------------- config in
def read_hf_config(model_dir: str | Path) -> ModelConfig:
    """Our config of the Hugging Face model in ``model_dir``; :class:`HFModelError` naming
    the file and the setting when it is missing, malformed or of an unsupported architecture."""
    path = Path(model_dir) / CONFIG
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFModelError(
            f"{path} does not exist: SWARM_MODEL must be a preset or a "
            "Hugging Face model directory (config.json + safetensors)"
        ) from None
    except (OSError, ValueError) as exc:
        raise HFModelError(f"{path} is not readable JSON: {exc} (setting SWARM_MODEL)") from None
    arch = hf_architecture(hf, path)
    try:
        return _gpt_config(hf, path) if SUPPORTED[arch] == "gpt" else _llama_config(hf, arch, path)
    except (KeyError, TypeError, AssertionError) as exc:
        raise HFModelError(f"{path}: cannot read a {arch} config: {exc!r} (setting SWARM_MODEL)") from None


def hf_architecture(hf: dict, path: Path) -> str:
    archs = hf.get("architectures") or [_MODEL_TYPES.get(hf.get("model_type", ""), hf.get("model_type", "?"))]
    arch = archs[0] if isinstance(archs, list) and archs else str(archs)
    if arch not in SUPPORTED:
        raise HFModelError(
            f"{path}: architecture {arch!r} is not supported; supported: {_SUPPORTED_TEXT} (setting SWARM_MODEL)"
        )
    return arch


def _unsupported(path: Path, what: str) -> HFModelError:
    return HFModelError(f"{path}: {what} is not supported (setting SWARM_MODEL)")


def _llama_config(hf: dict, arch: str, path: Path) -> LlamaConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, f"hidden_act {hf['hidden_act']!r} (only silu)")
    if hf.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and hf.get("attention_bias")):
        raise _unsupported(path, "a bias on the MLP or on every attention projection")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _unsupported(path, f"rope type {rope_type!r} (only the default rotary positions)")
    block_size = int(hf["max_position_embeddings"])
    window = hf.get("sliding_window") if arch == "MistralForCausalLM" or hf.get("use_sliding_window") else None
    if window:  # sequences no longer than the window attend fully: the window never applies
        block_size = min(block_size, int(window))
    heads = int(hf["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        block_size=block_size,
        n_layer=int(hf["num_hidden_layers"]),
        n_head=heads,
        n_kv_head=int(hf.get("num_key_value_heads") or heads),
        d_model=int(hf["hidden_size"]),
        ffn_dim=int(hf["intermediate_size"]),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        dropout=float(hf.get("attention_dropout", 0.0)),
    )


def _gpt_config(hf: dict, path: Path) -> GPTConfig:
    n_embd = int(hf["n_embd"])
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise _unsupported(path, f"n_inner {hf['n_inner']} (the gpt family's MLP is 4 x n_embd)")
    if (
        hf.get("scale_attn_by_inverse_layer_idx")
        or hf.get("reorder_and_upcast_attn")
        or hf.get("scale_attn_weights") is False
    ):
        raise _unsupported(path, "GPT-2 attention other than softmax(q k / sqrt(head_dim))")
    activation = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(
        hf.get("activation_function", "gelu_new")
    )
    if activation is None:
        raise _unsupported(path, f"activation_function {hf['activation_function']!r} (gelu, gelu_new)")
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        block_size=int(hf["n_positions"]),
        n_layer=int(hf["n_layer"]),
        n_head=int(hf["n_head"]),
        d_model=n_embd,
        dropout=float(hf.get("resid_pdrop", 0.1)),
        bias=True,
        activation=activation,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        head_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def config_fingerprint(cfg: ModelConfig) -> str:
    """What members of a run compare instead of a path (machines hold a directory at different paths)."""
    return "hf-" + hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- names
def hf_name(cfg: ModelConfig, name: str) -> str:
    """The Hugging Face name of our parameter ``name``."""
    if m := _BLOCK.fullmatch(name):
        layer, rest = m.groups()
        if cfg.family == "gpt":
            return f"transformer.h.{layer}.{rest}"
        module, _, kind = rest.rpartition(".")
        return f"model.layers.{layer}.{_LLAMA_LAYER[module]}.{kind}"
    if cfg.family == "gpt":
        return name if name == "lm_head.weight" else f"transformer.{name}"
    return _LLAMA_TOP[name]


def is_transposed(cfg: ModelConfig, name: str) -> bool:
    """GPT-2 stores its Conv1D weights as (in, out), the transpose of a Linear's."""
    return cfg.family == "gpt" and name.startswith("blocks.") and name.endswith(_GPT_CONV1D)


def _embedding_name(cfg: ModelConfig) -> str:
    return hf_name(cfg, "wte.weight")


# ---------------------------------------------------------------- weights in
def weight_map(model_dir: str | Path) -> dict[str, str]:
    """HF tensor name -> file name, from the index of a sharded checkpoint or the single file's header."""
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        try:
            mapping = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise HFModelError(
                f"{root / INDEX_FILE} is not a safetensors index: {exc!r} (setting SWARM_MODEL)"
            ) from None
        missing = sorted({f for f in mapping.values() if not (root / f).is_file()})
        if missing:
            raise HFModelError(
                f"{root / missing[0]} is missing: {INDEX_FILE} lists {len(missing)} shard file(s) that are not there: "
                f"{missing} (setting SWARM_MODEL)"
            )
        return dict(mapping)
    if (root / SINGLE_FILE).is_file():
        try:
            with safetensors.safe_open(str(root / SINGLE_FILE), framework="pt") as f:
                return {name: SINGLE_FILE for name in f.keys()}
        except (OSError, safetensors.SafetensorError) as exc:
            raise HFModelError(f"{root / SINGLE_FILE} is not a safetensors file: {exc} (setting SWARM_MODEL)") from None
    raise HFModelError(
        f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are read; setting SWARM_MODEL)"
    )


def _source_name(cfg: ModelConfig, name: str, available: dict[str, str]) -> str:
    """The stored tensor that holds our parameter ``name`` (a tied head: the embedding)."""
    wanted = hf_name(cfg, name)
    if name == "lm_head.weight" and (cfg.tie_embeddings or wanted not in available):
        wanted = _embedding_name(cfg)
    if wanted not in available and cfg.family == "gpt" and wanted.removeprefix("transformer.") in available:
        wanted = wanted.removeprefix("transformer.")  # the original GPT-2 files name the body without the prefix
    return wanted


def check_hf_dir(model_dir: str | Path) -> ModelConfig:
    """The config, once every weight file exists and holds every tensor of the whole model;
    :class:`HFModelError` naming the file (or tensor) otherwise. Reads headers only."""
    cfg = read_hf_config(model_dir)
    available = weight_map(model_dir)
    with torch.device("meta"):
        names = [n for n, _ in whole_model(_untied(cfg)).named_parameters()]
    missing = [hf for hf in (_source_name(cfg, n, available) for n in names) if hf not in available]
    if missing:
        raise HFModelError(
            f"{model_dir}: the weight files lack {len(missing)} tensor(s) "
            f"the model needs, e.g. {missing[:3]} (setting SWARM_MODEL)"
        )
    return cfg


def _untied(cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, tie_embeddings=False) if cfg.tie_embeddings else cfg


@dataclass
class LoadReport:
    """What one stage read from a model directory: HF tensor names by file, and their bytes."""

    model_dir: str
    tensors: dict[str, list[str]] = field(default_factory=dict)
    bytes_read: int = 0

    @property
    def names(self) -> set[str]:
        return {n for names in self.tensors.values() for n in names}


def load_stage_from_hf(
    model_dir: str | Path, cfg: ModelConfig, spec: StageSpec, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, LoadReport]:
    """Stage ``spec`` of ``cfg`` with the weights of ``model_dir`` (fp32), reading only its
    own tensors; the model is built on the meta device first, so nothing is initialised twice."""
    root = Path(model_dir)
    with torch.device("meta"):
        model = stage_model(cfg, spec)
    model.to_empty(device=device)
    if spec.is_first and spec.is_last and cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight  # to_empty gives each module its own new tensor
    available = weight_map(root)
    wanted = {name: _source_name(cfg, name, available) for name, _ in model.named_parameters()}
    by_file: dict[str, list[str]] = {}
    for name, hf in wanted.items():
        if hf not in available:
            raise HFModelError(f"{model_dir}: no tensor {hf!r} for {name!r} in the weight files (setting SWARM_MODEL)")
        by_file.setdefault(available[hf], []).append(name)
    report = LoadReport(str(root))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with safetensors.safe_open(str(root / file), framework="pt") as f:
                for name in names:
                    t = f.get_tensor(wanted[name])
                    report.tensors.setdefault(file, []).append(wanted[name])
                    report.bytes_read += t.numel() * t.element_size()
                    t = t.t() if is_transposed(cfg, name) else t
                    if tuple(t.shape) != tuple(params[name].shape):
                        raise HFModelError(
                            f"{root / file}: {wanted[name]!r} has shape {list(t.shape)}, {name!r} needs "
                            f"{list(params[name].shape)} (setting SWARM_MODEL)"
                        )
                    params[name].copy_(t.to(torch.float32))
    return model, report


# ---------------------------------------------------------------- out
def hf_config_dict(
    cfg: ModelConfig, *, bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None
) -> dict:
    """``config.json`` of ``cfg`` for ``transformers`` (written here, without transformers)."""
    tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if cfg.family == "gpt":
        if not cfg.bias or cfg.head_bias:
            raise ValueError(
                "only GPT-2-layout gpt models export to Hugging Face (biases everywhere but on the LM head, as a model "
                "loaded from a GPT-2 checkpoint); export this one with --format safetensors"
            )
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.block_size,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,
            "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "dtype": "float32",
            "torch_dtype": "float32",
            **tokens,
        }
    body = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": "float32",
        "torch_dtype": "float32",
        "use_cache": True,
        **tokens,
    }
    if cfg.qkv_bias:  # Qwen2's layout: biases on q, k, v only
        if cfg.head_dim != cfg.d_model // cfg.n_head:
            raise ValueError(f"a Qwen2-layout model needs head_dim = d_model / n_head, got {cfg.head_dim}")
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **body,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.n_layer,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **body,
        "head_dim": cfg.head_dim,
        "attention_bias": False,
        "mlp_bias": False,
    }


def save_hf(
    out_dir: str | Path,
    params: dict[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    max_shard_bytes: int,
    bos_token_id=None,
    eos_token_id=None,
) -> list[Path]:
    """Write ``params`` (the whole model's, our names) as a Hugging Face model directory:
    config.json, generation_config.json, and model.safetensors or, past ``max_shard_bytes``,
    shards with their index. Returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(cfg, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    tensors = {}
    for name, t in params.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # transformers ties it to the embedding
        t = t.detach().to("cpu", torch.float32)
        tensors[hf_name(cfg, name)] = (t.t() if is_transposed(cfg, name) else t).contiguous()
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensors[name], size + nbytes
    shards.append(current)
    written = [_write_json(out / CONFIG, config)]
    written.append(
        _write_json(
            out / "generation_config.json",
            {"_from_model_config": True, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id},
        )
    )
    if len(shards) == 1:
        safetensors.torch.save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        return [*written, out / SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, file in zip(shards, names):
        safetensors.torch.save_file(shard, str(out / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {n: file for shard, file in zip(shards, names) for n in shard},
    }
    written.append(_write_json(out / INDEX_FILE, index))
    return [*written, *(out / f for f in names)]


def _write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return path
