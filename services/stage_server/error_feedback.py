"""Error feedback for compressed step rounds: what one replica's compression lost in its
last step round, added back before it compresses the next one (Seide et al., 2014;
Karimireddy et al., 2019; the memory of PowerSGD). Plain logic, no I/O.

A step round (``allreduce.py``, ``stepping.StepRound``) compresses twice, with the round's codec:

1. reduce-scatter: member ``i`` sends part ``j`` of its gradient ``g_i`` to member ``j``
   (its own part ``i`` stays with it, uncompressed);
2. all-gather: member ``j`` reduces part ``j`` to ``m_j = sum(w g) / sum(w)`` and every
   member, ``j`` included, loads the decoded ``Q(m_j)``.

So a replica keeps two residuals, each of its own contribution:

- ``sent`` (``P`` values): ``x - Q(x)`` of the parts it sent, where ``x = g_i + sent`` (0 on
  the part it reduced itself, which travelled as it is). The next step it sends ``g_i +
  sent``. In gradient units: the next step's weight (samples) scales it as it scales the
  gradient; a replica that serves no sample in a step contributes nothing, so it adds
  nothing then and keeps its residual for a step it serves.
- ``reduced`` (its part's values): ``y - Q(y)`` of the part it reduced, where ``y = m_j +
  reduced``. The next step it serves ``Q(m_j + reduced)``. Every member loads those values,
  so the replicas stay bit-identical: the residuals change what a member sends, never
  what the members agree on. A part whose bounds moved (the round's members changed)
  takes the residual of the values it shares with the last one; the rest is dropped.

The residuals are this replica's alone: not in its digest, its state (``GET /state``) or a
checkpoint. They belong to the weights version they were made after (``(version, step)``
of the runtime right after the step): any other write of the weights (a resync, a join, a
drift repair, a state loaded by hand, a catch-up, a step alone while the coordinator is
away) leaves them behind, and the next round starts from none. A round after which this
member did not step (its gradient went back to the bucket) changes nothing: the next
round sends the same gradient with the same residuals.
"""

from __future__ import annotations

import torch

Tag = tuple[int, int]  # (weights version, step) of a runtime


class ErrorFeedback:
    """One replica's residuals of its compressed step rounds (see the module docstring)."""

    def __init__(self, num_params: int):
        self.num_params = num_params
        self.sent: torch.Tensor | None = None  # (P,) fp32
        self.reduced: tuple[int, torch.Tensor] | None = None  # (start, values) of the part reduced here
        self.made_at: Tag | None = None
        self.resets = 0  # residuals left behind because the weights changed otherwise (metrics, tests)

    def held(self, at: Tag) -> bool:
        """Whether residuals made for weights ``at`` are held; residuals of other weights are dropped."""
        if self.made_at is not None and self.made_at != at:
            self.reset()
            self.resets += 1
        return self.made_at is not None

    def reset(self) -> None:
        self.sent, self.reduced, self.made_at = None, None, None

    def contribution(self, gradient: torch.Tensor, weight: float, at: Tag) -> torch.Tensor:
        """What this member puts into the round for ``gradient`` of ``weight`` samples: the
        gradient plus the ``sent`` residual (a new tensor), or the gradient itself."""
        assert gradient.numel() == self.num_params, f"expected {self.num_params} values, got {gradient.numel()}"
        held = self.held(at)  # first: residuals of other weights go now, whatever the weight
        if weight <= 0 or not held or self.sent is None:
            return gradient
        return gradient + self.sent

    def for_part(self, start: int, stop: int, at: Tag) -> torch.Tensor:
        """The ``reduced`` residual on ``[start, stop)``, the part this member reduces now (zeros where none)."""
        out = torch.zeros(stop - start)
        if self.held(at) and self.reduced is not None:
            rstart, values = self.reduced
            lo, hi = max(start, rstart), min(stop, rstart + values.numel())
            if lo < hi:
                out[lo - start : hi - start] = values[lo - rstart : hi - rstart]
        return out

    def commit(self, sent: torch.Tensor | None, reduced: tuple[int, torch.Tensor] | None, at: Tag) -> None:
        """After this member stepped (its weights now ``at``): the residuals of the round.
        ``sent`` None: this member contributed no sample, its ``sent`` residual stays."""
        if sent is not None:
            assert sent.numel() == self.num_params, f"expected {self.num_params} values, got {sent.numel()}"
            self.sent = sent
        self.reduced, self.made_at = reduced, at

    def norms(self) -> dict:
        """The residuals' L2 norms (0 when none): how much compression error waits to be sent."""
        return {
            "sent": float(self.sent.norm()) if self.sent is not None else 0.0,
            "reduced": float(self.reduced[1].norm()) if self.reduced is not None else 0.0,
        }
