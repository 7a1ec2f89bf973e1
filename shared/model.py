"""A GPT-style decoder (pre-LN, scaled_dot_product_attention) that can be cut into stages.

The model knows nothing about the network. :class:`StageModel` holds a contiguous range
of blocks plus, on the first stage, the embeddings and, on the last stage, the final
norm, LM head and loss. :class:`GPT` is simply the one stage that holds everything, so the
parameter names of all stages together are exactly those of the whole model:
``wte.weight``, ``blocks.3.attn.c_attn.weight``, ``lm_head.weight``...

Parameters are initialised per name from ``(seed, name)``, so a stage built alone gets
the same weights as the same parameters of the whole model built with the same seed.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens by default
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        assert self.d_model % self.n_head == 0, f"d_model {self.d_model} must be divisible by n_head {self.n_head}"
        assert self.n_layer >= 1 and self.vocab_size >= 2 and self.block_size >= 1, f"invalid config {self}"
        assert 0.0 <= self.dropout < 1.0, f"dropout {self.dropout} must be in [0, 1)"

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128),  # ~0.9M, tests and `swarm up`
    "small": GPTConfig(n_layer=8, n_head=8, d_model=256, block_size=256),  # ~6.5M
    "base": GPTConfig(n_layer=12, n_head=12, d_model=768, block_size=1024),  # ~86M (GPT-2 small body)
    "medium": GPTConfig(n_layer=24, n_head=16, d_model=1024, block_size=1024),  # ~300M
    "large": GPTConfig(n_layer=24, n_head=16, d_model=1536, block_size=2048),  # ~680M
    "xl": GPTConfig(n_layer=24, n_head=16, d_model=2048, block_size=2048),  # ~1.2B
}


def config_from_preset(name: str, **overrides) -> GPTConfig:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
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


def partition(cfg: GPTConfig, num_stages: int) -> list[StageSpec]:
    """Cut ``cfg.n_layer`` blocks into ``num_stages`` contiguous ranges, sizes differing by at most one.

    Stage 0 also owns the embeddings and the last stage the final norm, LM head and loss,
    so the spare blocks (if any) go to the middle stages first.
    """
    if not 1 <= num_stages <= cfg.n_layer:
        raise ValueError(f"num_stages={num_stages} must be between 1 and n_layer={cfg.n_layer} (setting SWARM_NUM_STAGES)")
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
    are given, else logits (B, T, vocab).
    """

    def __init__(self, cfg: GPTConfig, spec: StageSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        if spec.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in spec.layers})
        if spec.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.spec.is_first:
            T = x.shape[1]
            assert T <= self.cfg.block_size, f"sequence length {T} exceeds block_size {self.cfg.block_size}"
            pos = torch.arange(T, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)
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
    """Initialise every parameter from ``(seed, name)`` alone (GPT-2 scheme)."""
    std_proj = 0.02 / math.sqrt(2 * module.cfg.n_layer)
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = std_proj if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_stage(cfg: GPTConfig, stage: int, num_stages: int, seed: int) -> StageModel:
    model = StageModel(cfg, partition(cfg, num_stages)[stage])
    init_parameters(model, seed)
    return model


def build_gpt(cfg: GPTConfig, seed: int) -> GPT:
    model = GPT(cfg)
    init_parameters(model, seed)
    return model
