"""Model families behind one stage interface, and the GPT family.

The model knows nothing about the network. A stage model holds a contiguous range of
blocks plus, on the first stage, the embeddings and, on the last stage, the final norm, LM
head and loss; :func:`partition` cuts a model into stages, :func:`build_stage` builds one.
Families: ``gpt`` (this module: pre-LN, learned positions, GELU MLP, biases) and ``llama``
(``shared.llama``: RMSNorm, rotary positions, SwiGLU, grouped-query attention). A config
names its family (``cfg.family``; ``config_from_dict`` reads one back), and
:data:`PRESETS` holds both families' presets.

:class:`GPT` is simply the one stage that holds everything, so the parameter names of all
stages together are exactly those of the whole model: ``wte.weight``,
``blocks.3.attn.c_attn.weight``, ``lm_head.weight``...

Parameters are initialised per name from ``(seed, name)``, so a stage built alone gets
the same weights as the same parameters of the whole model built with the same seed.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace
from typing import ClassVar, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shared.kv_cache import KVCache, LayerCache, causal_attention
from shared.llama import Llama, LlamaConfig, LlamaStage, count_llama_parameters, init_llama_parameters


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens by default
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    bias: bool = True
    activation: str = "gelu"  # the MLP's: "gelu" (exact) or "gelu_tanh" (GPT-2's tanh approximation)
    norm_eps: float = 1e-5
    head_bias: bool = True  # a bias on the LM head (GPT-2 has none)
    tie_embeddings: bool = False  # the LM head is the token embedding (GPT-2); see shared.llama on stages

    family: ClassVar[str] = "gpt"

    def __post_init__(self):
        assert self.d_model % self.n_head == 0, f"d_model {self.d_model} must be divisible by n_head {self.n_head}"
        assert self.n_layer >= 1 and self.vocab_size >= 2 and self.block_size >= 1, f"invalid config {self}"
        assert 0.0 <= self.dropout < 1.0, f"dropout {self.dropout} must be in [0, 1)"
        assert self.activation in ("gelu", "gelu_tanh"), (
            f"activation must be 'gelu' or 'gelu_tanh', got {self.activation!r}"
        )

    def to_dict(self) -> dict:
        return {"family": self.family, **asdict(self)}


ModelConfig = Union[GPTConfig, LlamaConfig]
FAMILIES: dict[str, type] = {"gpt": GPTConfig, "llama": LlamaConfig}


def config_from_dict(d: dict) -> ModelConfig:
    """The config of :meth:`to_dict` (a dict without ``family`` is a GPT's, as written before
    the llama family); ValueError if it is not one."""
    d = dict(d)
    family = d.pop("family", "gpt")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")
    try:
        return FAMILIES[family](**d)
    except (TypeError, AssertionError) as exc:
        raise ValueError(f"not a {family} model config: {exc}") from None


PRESETS: dict[str, ModelConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128),  # ~0.9M, tests and `swarm up`
    "small": GPTConfig(n_layer=8, n_head=8, d_model=256, block_size=256),  # ~6.5M
    "base": GPTConfig(n_layer=12, n_head=12, d_model=768, block_size=1024),  # ~86M (GPT-2 small body)
    "medium": GPTConfig(n_layer=24, n_head=16, d_model=1024, block_size=1024),  # ~300M
    "large": GPTConfig(n_layer=24, n_head=16, d_model=1536, block_size=2048),  # ~680M
    "xl": GPTConfig(n_layer=24, n_head=16, d_model=2048, block_size=2048),  # ~1.2B
    # llama family: from-scratch presets take a tokenizer of at most vocab_size tokens (swarm tokenizer train)
    "llama-tiny": LlamaConfig(
        vocab_size=2048, block_size=256, n_layer=4, n_head=4, n_kv_head=2, d_model=128, ffn_dim=384, tie_embeddings=True
    ),  # ~0.9M
    "llama-10m": LlamaConfig(
        vocab_size=8192,
        block_size=512,
        n_layer=12,
        n_head=8,
        n_kv_head=4,
        d_model=256,
        ffn_dim=704,
        tie_embeddings=True,
    ),  # ~10M
    "llama-135m": LlamaConfig(
        vocab_size=49152,
        block_size=2048,
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        d_model=576,
        ffn_dim=1536,
        tie_embeddings=True,
    ),  # SmolLM-135M's shape
    "llama-1b": LlamaConfig(
        vocab_size=32000, block_size=2048, n_layer=22, n_head=32, n_kv_head=4, d_model=2048, ffn_dim=5632
    ),  # TinyLlama-1.1B's shape
    "llama-7b": LlamaConfig(
        vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_kv_head=32, d_model=4096, ffn_dim=11008
    ),  # Llama-2-7B's shape
}


def config_from_preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} (setting SWARM_MODEL)")
    return replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, kv: LayerCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv is not None:
            k, v = kv.extend(k, v)  # every position so far
        y = causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, decoding=kv is not None)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv)
        return x + self.mlp(self.ln_2(x))


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model a stage holds."""

    index: int
    num_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def partition(cfg: ModelConfig, num_stages: int) -> list[StageSpec]:
    """Cut ``cfg.n_layer`` blocks into ``num_stages`` contiguous ranges, sizes differing by at most one.

    Stage 0 also owns the embeddings and the last stage the final norm, LM head and loss,
    so the spare blocks (if any) go to the middle stages first.
    """
    if not 1 <= num_stages <= cfg.n_layer:
        raise ValueError(
            f"num_stages={num_stages} must be between 1 and n_layer={cfg.n_layer} (setting SWARM_NUM_STAGES)"
        )
    base, extra = divmod(cfg.n_layer, num_stages)
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))  # middle stages first
    sizes = [base + (1 if s in order[:extra] else 0) for s in range(num_stages)]
    specs, start = [], 0
    for s, size in enumerate(sizes):
        specs.append(StageSpec(s, num_stages, range(start, start + size)))
        start += size
    return specs


class StageModel(nn.Module):
    """One pipeline stage. Input: token ids (B, T) on the first stage, hidden (B, T, C) after.

    Output: hidden (B, T, C); on the last stage the mean cross-entropy loss when targets
    are given, else logits (B, T, vocab). ``checkpoint_blocks``: recompute each block's
    activations in the backward instead of keeping them. A tied LM head is the embedding
    only when one stage holds both (see ``shared.llama``). ``cache``: the positions of
    ``x`` follow those already in the cache (incremental decoding, ``shared.kv_cache``).
    """

    def __init__(self, cfg: GPTConfig, spec: StageSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        self.checkpoint_blocks = False
        if spec.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in spec.layers})
        if spec.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.bias and cfg.head_bias)
            if spec.is_first and cfg.tie_embeddings:
                self.lm_head.weight = self.wte.weight

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        start = cache.length if cache is not None else 0
        if self.spec.is_first:
            T = x.shape[1]
            assert start + T <= self.cfg.block_size, (
                f"sequence length {start + T} exceeds block_size {self.cfg.block_size}"
            )
            pos = torch.arange(start, start + T, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for name, block in self.blocks.items():
            if cache is not None:
                x = block(x, cache.layer(name))
            elif self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if cache is not None:
            cache.advance(x.shape[1])
        if not self.spec.is_last:
            return x
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


class GPT(StageModel):
    """The whole model in one process: the single stage that holds every layer."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg, StageSpec(0, 1, range(cfg.n_layer)))


def init_parameters(module: StageModel, seed: int) -> None:
    """Initialise every parameter from ``(seed, name)`` alone (GPT-2 scheme). An untied copy
    of a tied LM head starts equal to the embedding."""
    std_proj = 0.02 / math.sqrt(2 * module.cfg.n_layer)
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = "wte.weight" if name == "lm_head.weight" and module.cfg.tie_embeddings else name
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = std_proj if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def stage_model(cfg: ModelConfig, spec: StageSpec) -> nn.Module:
    """The uninitialised stage ``spec`` of ``cfg``'s family (build it under ``torch.device("meta")``
    for shapes only)."""
    return StageModel(cfg, spec) if cfg.family == "gpt" else LlamaStage(cfg, spec)


def whole_model(cfg: ModelConfig) -> nn.Module:
    """The uninitialised whole model (:class:`GPT` or :class:`~shared.llama.Llama`)."""
    return GPT(cfg) if cfg.family == "gpt" else Llama(cfg)


def init_stage(model: nn.Module, seed: int) -> None:
    (init_parameters if model.cfg.family == "gpt" else init_llama_parameters)(model, seed)


def build_stage(cfg: ModelConfig, stage: int, num_stages: int, seed: int) -> nn.Module:
    model = stage_model(cfg, partition(cfg, num_stages)[stage])
    init_stage(model, seed)
    return model


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The whole model of ``cfg`` (either family) in one process, initialised from ``seed``."""
    model = whole_model(cfg)
    init_stage(model, seed)
    return model


build_gpt = build_model  # the whole GPT, as the tests and benches name it


def whole_parameters(params: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The stages' parameters as the whole model's. A tied LM head that the last stage holds
    as its own copy (two or more stages) is dropped while it still equals the embedding;
    once trained apart, the whole model is untied (``tie_embeddings=False``)."""
    if cfg.tie_embeddings and "lm_head.weight" in params and "wte.weight" in params:
        if torch.equal(params["lm_head.weight"], params["wte.weight"]):
            return {k: v for k, v in params.items() if k != "lm_head.weight"}, cfg
        return params, replace(cfg, tie_embeddings=False)
    return params, cfg


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model (a tied head counted once), by formula: no memory."""
    if cfg.family == "llama":
        return count_llama_parameters(cfg)
    C, bias = cfg.d_model, int(cfg.bias)
    block = 12 * C * C + bias * 9 * C + (2 + 2 * bias) * C  # attention, MLP and their biases, two LayerNorms
    head = (0 if cfg.tie_embeddings else cfg.vocab_size * C) + int(cfg.bias and cfg.head_bias) * cfg.vocab_size
    return (cfg.vocab_size + cfg.block_size) * C + cfg.n_layer * block + (1 + bias) * C + head
