"""Keys and values of the positions a stage has already seen: incremental decoding.

Generation runs a stage once per new token. Without a cache every step runs the whole
prefix again (quadratic in the length); with one, the stage keeps the attention keys and
values of every earlier position of a sequence and a step computes only the new
positions, attending to the kept ones. A :class:`KVCache` belongs to one sequence batch
on one stage (a stage server keeps one per inference session); its memory is fixed when
it is made (``capacity`` positions), so a server can bound it before accepting a session.

Both model families use it the same way: a block's attention calls
``cache.layer(i).extend(k, v)`` with the new positions' keys and values (after rotary
positions, before grouped-query heads are repeated) and attends to what it returns;
the stage calls :meth:`KVCache.advance` once every block has run. A forward with no cache
is exactly the training forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class KVCache:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a KV cache needs a capacity of at least 1 position, got {capacity}")
        self.capacity = capacity
        self.length = 0  # positions cached so far
        self._layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, name: str) -> LayerCache:
        return LayerCache(self, name)

    def advance(self, positions: int) -> None:
        """The stage's forward of ``positions`` new positions has run through every block."""
        self.length += positions

    @property
    def nbytes(self) -> int:
        """Bytes held now (every layer's buffers are allocated at their first use)."""
        return sum(k.numel() * k.element_size() * 2 for k, _ in self._layers.values())

    def _extend(self, name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, new = self.length, k.shape[2]
        if start + new > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions: {start} cached + {new} new do not fit")
        if name not in self._layers:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self._layers[name] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self._layers[name]
        if keys.shape[:2] != k.shape[:2] or keys.shape[3] != k.shape[3]:
            raise ValueError(f"keys of shape {list(k.shape)} do not fit a cache of {list(keys.shape)}")
        keys[:, :, start : start + new] = k
        values[:, :, start : start + new] = v
        return keys[:, :, : start + new], values[:, :, : start + new]


class LayerCache:
    """One attention layer's view of a :class:`KVCache`."""

    def __init__(self, cache: KVCache, name: str):
        self.cache, self.name = cache, name

    @property
    def start(self) -> int:
        """The position of the first new token."""
        return self.cache.length

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values (B, heads, T, head_dim); every position's so far."""
        return self.cache._extend(self.name, k, v)


def kv_cache_bytes(cfg, layers: int, batch: int, capacity: int, *, element_size: int = 4) -> int:
    """Bytes of a KV cache of ``capacity`` positions for ``layers`` blocks of ``cfg`` (either family)."""
    kv_heads = getattr(cfg, "n_kv_head", cfg.n_head)
    head_dim = getattr(cfg, "head_dim", cfg.d_model // cfg.n_head)
    return 2 * layers * batch * kv_heads * capacity * head_dim * element_size


_DECODING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0, decoding: bool = False
) -> torch.Tensor:
    """Causal attention of the T positions of ``q`` (B, h, T, hd), the last T of the S in ``k``
    and ``v``: position i of q sees the keys up to S - T + i.

    ``decoding``: the keys come from a :class:`KVCache`, so S grows by a step's tokens every
    call. cuDNN's attention builds a plan for every new shape (tens of milliseconds on an
    H100, every token in bf16: generation ran 10x slower), so a decoding call leaves it out
    and takes flash, memory-efficient or plain attention, which need no plan."""
    with sdpa_kernel(_DECODING_BACKENDS) if decoding else contextlib.nullcontext():
        T, S = q.shape[2], k.shape[2]
        if S == T:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        if T == 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
