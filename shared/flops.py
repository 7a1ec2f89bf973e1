"""Model FLOPs of a pipeline stage: what MFU (model FLOPs utilisation) divides by the device's peak.

Counted are the matrix multiplications of the stage's own layers, 2 FLOPs per multiply-add:

- per block, the projections: GPT ``c_attn`` (C -> 3C), ``c_proj`` (C -> C) and the MLP
  (C -> 4C -> C): ``12 C^2`` weights; Llama ``wq``, ``wo`` (C <-> n_head hd), ``wk``, ``wv``
  (C -> n_kv_head hd) and SwiGLU's ``w1``, ``w3``, ``w2`` (C <-> F): ``C hd (2 n_head +
  2 n_kv_head) + 3 C F`` weights. Each weight costs 2 FLOPs per token.
- per block, attention's two products, scores ``q k^T`` and the weighted values ``p v``:
  ``2 * 2 n_head hd`` FLOPs per (query, key) pair. Counted over the **full square** of
  pairs, ``T^2`` per sequence of T tokens although a causal mask leaves only the half
  ``T (T + 1) / 2`` of them useful, as PaLM's MFU (Chowdhery et al. 2022, appendix B),
  nanoGPT's ``estimate_mfu`` and torchtitan do, so that figures compare with theirs (a
  causal kernel that skips the masked half does about half this attention work).
- on the last stage, the LM head (C -> vocab); on every stage nothing else: embedding
  lookups, position tables, norms, activations, softmax, biases, residual adds and the
  loss cost 0 model FLOPs.

A backward costs twice its forward (the gradients of each product's two operands), so a
trained token costs 3 forwards. With LoRA (``shared.lora``) the adapters' products count
like any other (``r (in + out)`` weights per target), and a frozen weight gets no gradient:
its backward is the input's gradient alone, one forward's worth. Re-runs of a microbatch,
forwards recomputed in a backward and activation checkpointing's recompute are no model
FLOPs: what a stage counts as done is
the tokens whose gradient it accumulated (3 forwards each) and those it evaluated (1).

Because attention's work grows with the sequence length, a stage's FLOPs are a function of
two sums over its microbatches of B sequences of T tokens: tokens ``B T`` and (query, key)
pairs ``B T^2``; see :meth:`StageFlops.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model import ModelConfig, StageSpec, partition

FLOPS_PER_MULTIPLY_ADD = 2
BACKWARD_PER_FORWARD = 2  # a backward's matmuls: the gradient of each of a product's two operands


@dataclass(frozen=True)
class StageFlops:
    """The model FLOPs of one stage of a model, per token and per (query, key) pair."""

    matmul_weights: int  # weights of the stage's matrix multiplications (each: 2 FLOPs per token)
    attention_width: int  # sum over the stage's blocks of n_head x head_dim (each: 4 FLOPs per pair)
    trainable_weights: int | None = None  # those that get a gradient (None: all; LoRA: the adapters')

    def forward(self, tokens: int | float, token_pairs: int | float) -> float:
        """FLOPs of the forward of microbatches of ``tokens`` tokens (sum of B T) and
        ``token_pairs`` (query, key) pairs (sum of B T^2, the full square)."""
        per_token = FLOPS_PER_MULTIPLY_ADD * self.matmul_weights
        per_pair = 2 * FLOPS_PER_MULTIPLY_ADD * self.attention_width  # q k^T, then p v
        return per_token * tokens + per_pair * token_pairs

    def train(self, tokens: int | float, token_pairs: int | float) -> float:
        """FLOPs of forward and backward of the same microbatches (3 forwards; less where
        weights are frozen: their products' backward computes the input's gradient only)."""
        if self.trainable_weights is None or self.trainable_weights == self.matmul_weights:
            return (1 + BACKWARD_PER_FORWARD) * self.forward(tokens, token_pairs)
        frozen = self.matmul_weights - self.trainable_weights
        return (1 + BACKWARD_PER_FORWARD) * self.forward(tokens, token_pairs) - FLOPS_PER_MULTIPLY_ADD * frozen * tokens

    def per_token(self, seq_len: int, *, train: bool = True) -> float:
        """FLOPs per token of sequences of ``seq_len`` tokens: forward and backward (``train``) or forward only."""
        flops = self.train if train else self.forward
        return flops(1, seq_len)


def block_matmul_weights(cfg: ModelConfig) -> int:
    """Weights of one block's matrix multiplications (biases and norms are not)."""
    C = cfg.d_model
    if cfg.family == "llama":
        return C * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.n_kv_head) + 3 * C * cfg.ffn_dim
    return 3 * C * C + C * C + 2 * 4 * C * C  # c_attn, attention's c_proj, the MLP's c_fc and c_proj


def block_attention_width(cfg: ModelConfig) -> int:
    """n_head x head_dim of one block: the width of its query heads (grouped key/value heads
    are shared, each query head still scores every key)."""
    head_dim = cfg.head_dim if cfg.family == "llama" else cfg.d_model // cfg.n_head
    return cfg.n_head * head_dim


def stage_flops(cfg: ModelConfig, spec: StageSpec, lora=None) -> StageFlops:
    """The model FLOPs of the stage ``spec`` of ``cfg`` (either family); ``lora``
    (``shared.lora.LoraConfig``): the frozen stage with its adapters."""
    layers = len(spec.layers)
    head = cfg.d_model * cfg.vocab_size if spec.is_last else 0
    weights, width = layers * block_matmul_weights(cfg) + head, layers * block_attention_width(cfg)
    if lora is None:
        return StageFlops(weights, width)
    from shared.lora import adapter_parameters

    adapters = adapter_parameters(cfg, lora, spec)
    return StageFlops(weights + adapters, width, trainable_weights=adapters)


def model_flops(cfg: ModelConfig) -> StageFlops:
    """The model FLOPs of the whole model in one process (the one stage holding every layer)."""
    (whole,) = partition(cfg, 1)
    return stage_flops(cfg, whole)
