"""Rebuilding a stage whose every replica died, from its neighbours (CheckFree).

CheckFree (Blagoev et al., Gensyn, arXiv 2506.15461) starts a lost pipeline stage again as
the average of the two stages beside it, each weighted by the norm of its last gradient,
with fresh optimizer moments; neighbouring transformer blocks are similar enough that the
stage then needs far fewer steps to be useful again than fresh weights. Here:

- **a middle stage**: block ``k`` of the lost stage is the weighted average of block ``k``
  of the previous and of the next stage (which must hold as many blocks; a neighbour with
  another count is left out, and with none left there is no rebuild);
- **the first stage**: its blocks are copies of the second stage's (a neighbour on one side
  only); its token embedding is the last stage's LM head when the model ties them (the last
  stage trains its own copy), else kept; the position embedding is kept;
- **the last stage**: its blocks are copies of the one before; its LM head is the first
  stage's token embedding when tied, else kept; its final norm is kept;
- whatever the rules do not name keeps the weights the server has (its initial ones).

The server then takes the stage's step number (``catch_up``) and, its AdamW moments being
fresh, warms its learning rate up again (``OptimizerConfig.recovery_warmup_steps``). Plain
logic over name -> tensor maps; ``app._join`` fetches the neighbours' states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shared.checkpoint import OPTIM_PREFIX

BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
TIED = {"wte.weight": "lm_head.weight", "lm_head.weight": "wte.weight"}


@dataclass(frozen=True)
class Neighbour:
    """A live neighbouring stage's state: its index, its blocks and its last gradient norm."""

    stage: int
    layers: range
    tensors: dict[str, torch.Tensor]
    grad_norm: float


def neighbour_stages(stage: int, num_stages: int) -> list[int]:
    """The stages whose states a rebuild of ``stage`` reads: the previous and the next; for an
    edge stage its one neighbour and the other end (which holds the tied embedding or head)."""
    if num_stages < 2:
        return []
    if stage == 0:
        wanted = [1, num_stages - 1]
    elif stage == num_stages - 1:
        wanted = [num_stages - 2, 0]
    else:
        wanted = [stage - 1, stage + 1]
    return list(dict.fromkeys(wanted))  # two stages: the one neighbour is also the other end


def checkfree_weights(
    own: dict[str, torch.Tensor], stage: int, num_stages: int, layers: range, neighbours: list[Neighbour], *, tied: bool
) -> tuple[dict[str, torch.Tensor], dict]:
    """The lost stage's weights rebuilt from ``neighbours`` (see the module's docstring), and
    what was done (for the log): ``{"blocks_from": {stage: weight}, "copied": [names], "kept":
    [names]}``. ``own``: the server's current weights, name -> tensor, for what is kept.
    Raises ``ValueError`` when no neighbour's blocks fit (nothing to rebuild from)."""
    sides = [n for n in neighbours if abs(n.stage - stage) == 1 and len(n.layers) == len(layers)]
    if not sides and any(BLOCK.match(name) for name in own):
        raise ValueError(
            f"no neighbouring stage of stage {stage} holds {len(layers)} blocks "
            f"(theirs: {[(n.stage, len(n.layers)) for n in neighbours]}): CheckFree needs equal cuts"
        )
    norms = [max(0.0, n.grad_norm) for n in sides]
    weights = [w / sum(norms) for w in norms] if sum(norms) > 0 else [1.0 / len(sides)] * len(sides)
    rebuilt: dict[str, torch.Tensor] = {}
    done: dict = {"blocks_from": {n.stage: round(w, 4) for n, w in zip(sides, weights)}, "copied": [], "kept": []}
    for name, tensor in own.items():
        if name.startswith(OPTIM_PREFIX):
            continue
        if m := BLOCK.match(name):
            k = int(m.group(1)) - layers.start
            parts = [n.tensors[f"blocks.{n.layers.start + k}.{m.group(2)}"] for n in sides]
            mean = sum(w * p.to(torch.float32) for w, p in zip(weights, parts))
            rebuilt[name] = mean.to(tensor.dtype)
            continue
        other = TIED.get(name) if tied else None
        source = next((n for n in neighbours if other and other in n.tensors), None)
        if source is not None and source.tensors[other].shape == tensor.shape:
            rebuilt[name] = source.tensors[other].to(tensor.dtype).clone()
            done["copied"].append(f"{name} <- stage {source.stage} {other}")
        else:
            rebuilt[name] = tensor.clone()
            done["kept"].append(name)
    return rebuilt, done
