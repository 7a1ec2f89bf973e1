"""The ``llama`` family: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

The layout of Llama, Qwen2, Mistral, SmolLM and TinyLlama (pre-norm blocks, no biases
except Qwen2's on q/k/v, an optional tie of the LM head to the token embedding). Like
``shared.model``'s GPT, it knows nothing about the network: :class:`LlamaStage` holds a
contiguous range of blocks plus, on the first stage, the token embedding and, on the last,
the final norm, LM head and loss. Parameter names (the Hugging Face names are mapped in
``shared.hf``)::

    wte.weight                                  token embedding (V, C)
    blocks.{i}.attn_norm.weight                 RMSNorm before attention (C)
    blocks.{i}.attn.{wq,wk,wv,wo}.weight        (nh*hd, C), (nkv*hd, C), (nkv*hd, C), (C, nh*hd)
    blocks.{i}.mlp_norm.weight                  RMSNorm before the MLP (C)
    blocks.{i}.mlp.{w1,w3,w2}.weight            gate (F, C), up (F, C), down (C, F)
    norm.weight, lm_head.weight                 final RMSNorm (C), LM head (V, C)

A tied LM head is the embedding itself when one stage holds both; cut into two or more
stages, the last stage holds its own copy (initialised equal to the embedding), and the two
train as separate tensors: tying across servers would need an all-reduce between the first
and the last stage every step.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shared.kv_cache import KVCache, LayerCache, causal_attention

if TYPE_CHECKING:
    from shared.model import StageSpec


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    block_size: int = 2048  # longest sequence the model is trained for (RoPE itself has no table)
    n_layer: int = 32
    n_head: int = 32
    # grouped-query attention: n_head / n_kv_head query heads share a key/value head (0: n_head, plain multi-head)
    n_kv_head: int = 0
    d_model: int = 4096
    ffn_dim: int = 11008  # SwiGLU hidden width
    head_dim: int = 0  # 0: d_model // n_head
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    dropout: float = 0.0  # attention dropout

    family: ClassVar[str] = "llama"

    def __post_init__(self):
        if self.head_dim == 0:
            assert self.d_model % self.n_head == 0, (
                f"d_model {self.d_model} must be divisible by n_head {self.n_head} (or give head_dim)"
            )
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        if self.n_kv_head == 0:
            object.__setattr__(self, "n_kv_head", self.n_head)
        assert self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even (rotary positions rotate pairs)"
        assert self.n_head % self.n_kv_head == 0, (
            f"n_head {self.n_head} must be a multiple of n_kv_head {self.n_kv_head}"
        )
        assert self.n_layer >= 1 and self.vocab_size >= 2 and self.block_size >= 1, f"invalid config {self}"
        assert 0.0 <= self.dropout < 1.0, f"dropout {self.dropout} must be in [0, 1)"

    def to_dict(self) -> dict:
        return {"family": self.family, **asdict(self)}


def count_llama_parameters(cfg: LlamaConfig) -> int:
    """Parameters of the whole model (a tied head counted once), by formula."""
    C, hd = cfg.d_model, cfg.head_dim
    attn = C * cfg.n_head * hd * 2 + C * cfg.n_kv_head * hd * 2  # wq, wo, wk, wv
    if cfg.qkv_bias:
        attn += (cfg.n_head + 2 * cfg.n_kv_head) * hd
    block = attn + 3 * C * cfg.ffn_dim + 2 * C  # SwiGLU and two norms
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * C
    return cfg.vocab_size * C + cfg.n_layer * block + C + head


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(cfg: LlamaConfig, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (T, head_dim): each frequency twice (halves layout)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))  # (hd/2,)
    angles = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + hd/2]) of every head by its position's angle. x: (B, nh, T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.dropout = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.dropout
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerCache | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:
            k, v = kv.extend(k, v)  # every position so far
        groups = self.n_head // self.n_kv_head  # query heads per key/value head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, nh, S, hd)
        y = causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, decoding=kv is not None)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerCache | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        return x + self.mlp(self.mlp_norm(x))


class LlamaStage(nn.Module):
    """One pipeline stage. Input: token ids (B, T) on the first stage, hidden (B, T, C) after.

    Output: hidden (B, T, C); on the last stage the mean cross-entropy loss when targets
    are given, else logits (B, T, vocab). ``checkpoint_blocks``: recompute each block's
    activations in the backward instead of keeping them (less memory, ~1/3 more compute).
    ``cache``: the positions of ``x`` follow those already in the cache (``shared.kv_cache``).
    """

    def __init__(self, cfg: LlamaConfig, spec: StageSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        self.checkpoint_blocks = False
        if spec.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): LlamaBlock(cfg) for i in spec.layers})
        if spec.is_last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if spec.is_first and cfg.tie_embeddings:
                self.lm_head.weight = self.wte.weight

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        if self.spec.is_first:
            x = self.wte(x)  # (B, T, C)
        start, T = (cache.length if cache is not None else 0), x.shape[1]
        assert start + T <= self.cfg.block_size, f"sequence length {start + T} exceeds block_size {self.cfg.block_size}"
        cos, sin = rotary_tables(self.cfg, start + T, x.device)
        cos, sin = cos[start:], sin[start:]  # the new positions' angles
        for name, block in self.blocks.items():
            if cache is not None:
                x = block(x, cos, sin, cache.layer(name))
            elif self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        if cache is not None:
            cache.advance(T)
        if not self.spec.is_last:
            return x
        logits = self.lm_head(self.norm(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


class Llama(LlamaStage):
    """The whole model in one process: the single stage that holds every layer."""

    def __init__(self, cfg: LlamaConfig):
        from shared.model import StageSpec

        super().__init__(cfg, StageSpec(0, 1, range(cfg.n_layer)))


def init_llama_parameters(module: LlamaStage, seed: int) -> None:
    """Every parameter from ``(seed, name)`` alone: normal(0, 0.02), output projections
    scaled by 1/sqrt(2 n_layer), norms one, biases zero. An untied copy of a tied LM head
    starts equal to the embedding."""
    cfg = module.cfg
    std_out = 0.02 / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = "wte.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            if name.endswith("bias"):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = std_out if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
