"""``SWARM_SYNC=local``: DiLoCo's outer step (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models") for a stage's replicas. Plain maths on
flat fp32 vectors, no networking.

In ``local`` mode the replicas of a stage do not all-reduce gradients. Each takes one inner
AdamW step per global step with the gradient of the samples it served itself (its own
share of the global batch; the coordinator still counts global steps). Every ``every``
global steps a step round all-reduces, weighted by the samples each replica served since
the last outer step, the *outer gradient*: how far each replica moved from the weights the
replicas last agreed on (``anchor - weights``). Every replica then applies the same outer
step, SGD with Nesterov momentum, to the anchor:

    m      <- momentum * m + delta
    anchor <- anchor - lr * (delta + momentum * m)        (momentum 0: anchor - lr * delta)

and continues from the new anchor. With ``lr`` 1 and ``momentum`` 0 this is plain periodic
averaging of the replicas' weights. The inner AdamW states stay each replica's own, as in
DiLoCo; the anchor and the momentum are the same on every replica (a joiner takes them
with a live replica's state), and they are what the coordinator's digest check compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterConfig:
    every: int = 10  # H: global (inner) steps between outer steps
    lr: float = 0.7  # DiLoCo's outer learning rate
    momentum: float = 0.5  # Nesterov momentum of the outer step; 0: none (DiLoCo: 0.9, for H in the hundreds)

    def __post_init__(self):
        assert self.every >= 1, f"an outer step needs every >= 1 inner steps, got {self.every}"
        assert self.lr > 0, f"outer lr must be > 0, got {self.lr}"
        assert 0 <= self.momentum < 1, f"outer momentum must be in [0, 1), got {self.momentum}"


class OuterOptimizer:
    """The anchor (the weights the replicas last agreed on), the outer momentum and the
    samples this replica served since the anchor."""

    def __init__(self, cfg: OuterConfig, weights: torch.Tensor):
        self.cfg = cfg
        self.reset(weights)

    def reset(self, weights: torch.Tensor, momentum: torch.Tensor | None = None) -> None:
        """Start again from ``weights`` (fp32 flat), e.g. a loaded state; momentum zero unless given."""
        self.anchor = weights.detach().to(torch.float32).clone()
        self.momentum = (
            torch.zeros_like(self.anchor) if momentum is None else momentum.detach().to(torch.float32).clone()
        )
        self.samples = 0
        self.steps = 0  # outer steps applied here

    def due(self, step: int) -> bool:
        """After inner step ``step`` (the stage's step once it applied), an outer step?"""
        return step > 0 and step % self.cfg.every == 0

    def outer_gradient(self, weights: torch.Tensor) -> torch.Tensor:
        """How far this replica moved since the anchor: ``anchor - weights``."""
        return self.anchor - weights.to(torch.float32)

    def step(self, delta: torch.Tensor) -> torch.Tensor:
        """Apply the replicas' mean outer gradient ``delta``; returns the new weights (the new anchor)."""
        assert delta.shape == self.anchor.shape, (
            f"outer gradient of shape {list(delta.shape)}, the anchor has {list(self.anchor.shape)}"
        )
        mu = self.cfg.momentum
        update = delta
        if mu:
            self.momentum.mul_(mu).add_(delta)
            update = delta + mu * self.momentum
        self.anchor = self.anchor - self.cfg.lr * update
        self.samples = 0
        self.steps += 1
        return self.anchor.clone()
