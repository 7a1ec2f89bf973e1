"""How a reducer combines the members' values of one part of an averaging round
(``allreduce.py``, whose default is the weighted mean): CenteredClip against faulty or malicious
members (``SWARM_AVERAGING_AGGREGATOR``); each member's weight; and the fault injection
that tests of robust aggregation send instead of a member's values. Plain tensor maths."""

from __future__ import annotations

from collections.abc import Mapping

import torch

EPSILON_WEIGHT = 1e-3  # the weight of a replica that processed no sample since its last round


AGGREGATORS = ("mean", "centered_clip")
CLIP_MAX_ITERS = 50
CLIP_TOL = 1e-7  # relative change of the centre at which CenteredClip has converged


def centered_clip(
    contributions: Mapping[int, tuple[float, torch.Tensor]],
    *,
    tau: float | None = None,
    max_iters: int = CLIP_MAX_ITERS,
    tol: float = CLIP_TOL,
) -> tuple[torch.Tensor, int]:
    """CenteredClip (Karimireddy, He and Jaggi, 2021; the aggregator of BTARD, Gorbunov et
    al., 2022) over ``{member: (w, x)}``: the fixed point of
    ``v <- v + sum(w_i (x_i - v) min(1, tau / |x_i - v|)) / sum(w_i)``, iterated from the
    coordinate-wise median. Returns (centre in fp32, iterations).

    A member can move the result by at most ``tau`` times its share of the weight, however
    far it sends its values. Robust choices where the caller gives none:
    - ``tau`` = the median distance of the contributions from the coordinate-wise median
      (the honest spread while honest members are a majority; 0 when most agree exactly,
      and then the median is the answer);
    - weights are capped at the median weight, since a member reports its own weight.
    """
    members = sorted(contributions)
    xs = torch.stack([contributions[m][1].to(torch.float64) for m in members])
    w = torch.tensor([contributions[m][0] for m in members], dtype=torch.float64)
    w = torch.minimum(w, w.median())
    if float(w.sum()) <= 0:  # the median weight is 0: most members served nothing
        w = torch.ones_like(w)
    w = w / w.sum()
    v = xs.median(dim=0).values if len(members) > 2 else xs.mean(dim=0)
    if tau is None:
        tau = float((xs - v).norm(dim=1).median())
    if tau <= 0.0:
        return v.to(torch.float32), 0
    for iteration in range(1, max_iters + 1):
        diff = xs - v
        norms = diff.norm(dim=1)
        scale = torch.where(norms > tau, tau / norms.clamp_min(1e-300), torch.ones_like(norms))
        step = (w * scale) @ diff
        v = v + step
        if float(step.norm()) <= tol * (float(v.norm()) + 1e-12):
            return v.to(torch.float32), iteration
    return v.to(torch.float32), max_iters


BYZANTINE_MODES = ("sign_flip", "scale", "random")


def byzantine_values(flat: torch.Tensor, mode: str, factor: float, seed: int) -> torch.Tensor:
    """Fault injection (``inject.byzantine``): what a faulty or malicious replica sends into
    a round instead of its parameters: ``-factor x``, ``factor x``, or noise of ``factor`` x
    the parameters' scale. Tests of robust aggregation use it; never on in a real swarm."""
    if mode == "sign_flip":
        return flat * -factor
    if mode == "scale":
        return flat * factor
    if mode == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randn(flat.shape, generator=g) * (factor * float(flat.abs().mean()))
    raise ValueError(f"byzantine mode must be one of {BYZANTINE_MODES}, got {mode!r}")


def sample_weight(samples: int, samples_at_last_round: int) -> float:
    """A member's weight in a round: samples since its last completed round, else ``EPSILON_WEIGHT``."""
    return float(samples - samples_at_last_round) if samples > samples_at_last_round else EPSILON_WEIGHT
