"""The arena's reference run with the mesh's numerics emulated in one process:
``python -m bench.arena_trajectory [CONFIG ...]`` (``--steps N``; ``--list``).

The arena's target is the held-out loss one process reaches after 8 global steps
(``bench.arena.reference_targets``): the same model in 4 stages, the stage servers' AdamW,
schedule and clipping, 4 microbatches of 8 samples a step. A side that computes exactly
that reaches it at step 8; every lossy or late number on the mesh's path moves the
trajectory, and at 4 decimals a step's loss can land just above the target. This bench
replays the reference with one of the mesh's deviations at a time, in this process, so
that what each costs in steps is known without the arena's network and noise:

- ``wire=C``: the activations and their gradients between stages through the wire codec
  ``C`` (``shared.codec`` encode and decode, as a chain hop does);
- ``round=C``: the stage's gradient all-reduced by two replicas in a step round of codec
  ``C`` (3 microbatches on one replica, 1 on the other; each reducer loads its part as the
  codec gives it back, as ``allreduce.py`` does); ``+ef``: with error feedback;
- ``stale=F``: a fraction ``F`` of each step's microbatches computed on the weights of the
  step before (the ``async`` schedule's delay of one step); ``+predict``: on weights
  predicted one step ahead from the AdamW moments instead (``w - lr (m^/(sqrt(v^)+eps) + wd w)``,
  SpecTrain-style weight prediction).

Prints the held-out loss after each step and the first step at or below the target, per
config. About 30 s a config on one core here.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from bench.arena import FULL, reference_step, reference_targets
from bench.arena_eval import held_out_loss
from bench.arena_pipelining import loss_fn, stock_optimizer, stock_optimizer_config
from shared.codec import FLOAT_CODECS, decode_tensor, encode_tensor, pack_message, unpack_message
from shared.model import build_stage

STAGES, TARGET_STEPS = 4, 8
DEFAULT_CONFIGS = (
    "exact",
    "wire=int8",
    "wire=int8,round=fp32",
    "wire=int8,round=int8",
    "wire=int8,round=int4",
    "wire=int8,round=int4+ef",
    "stale=0.5",
    "stale=0.5+predict",
    "stale=1",
    "stale=1+predict",
)


def through(t: torch.Tensor, codec: str) -> torch.Tensor:
    """``t`` as it comes out of the wire in ``codec`` (packed and unpacked, as a hop sends it)."""
    if codec == "fp32":
        return t
    return decode_tensor(unpack_message(pack_message({"t": encode_tensor(t, codec)}))["t"]).to(t.dtype)


class _Wire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, codec):
        ctx.codec = codec
        return through(x, codec)

    @staticmethod
    def backward(ctx, g):
        return through(g, ctx.codec), None


def parse(config: str) -> dict:
    out = {"wire": "fp32", "round": None, "ef": False, "stale": 0.0, "predict": False}
    if config == "exact":
        return out
    for item in config.split(","):
        key, _, value = item.partition("=")
        flags = value.split("+")
        if key == "wire" and flags[0] in FLOAT_CODECS:
            out["wire"] = flags[0]
        elif key == "round" and flags[0] in FLOAT_CODECS and set(flags[1:]) <= {"ef"}:
            out["round"], out["ef"] = flags[0], "ef" in flags[1:]
        elif key == "stale" and set(flags[1:]) <= {"predict"}:
            out["stale"], out["predict"] = float(flags[0]), "predict" in flags[1:]
            if not 0 <= out["stale"] <= 1:
                raise ValueError(f"stale takes a fraction in [0, 1], got {flags[0]}")
        else:
            raise ValueError(f"unknown config item {item!r} (e.g. wire=int8,round=int4+ef or stale=0.5+predict)")
    return out


@torch.no_grad()
def predicted(models: list[torch.nn.Module], optimizers, lr: float, enabled: bool) -> list[torch.nn.Module]:
    """Copies of ``models``, moved one AdamW update ahead with the current moments (``enabled``)."""
    out = [copy.deepcopy(m) for m in models]
    for shadow, m, opt in zip(out, models, optimizers):
        shadow.zero_grad(set_to_none=True)
        if not enabled:
            continue
        own = dict(zip((id(p) for p in m.parameters()), shadow.parameters()))
        for group in opt.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = opt.state.get(p)
                if not state:
                    continue
                t = float(state["step"])
                update = (state["exp_avg"] / (1 - b1**t)) / ((state["exp_avg_sq"] / (1 - b2**t)).sqrt() + group["eps"])
                own[id(p)].add_(update + group["weight_decay"] * p, alpha=-lr)
    return out


def _grads(models: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in models]


def _round(flats: list[torch.Tensor], weights: list[int], codec: str, residuals: dict | None) -> torch.Tensor:
    """Two replicas' mean gradient through a butterfly step round of ``codec``: each reduces its
    half (its own values exact, the other's through the codec) and loads what the codec gives
    back; ``residuals`` (error feedback): what the codec lost last time goes in again."""
    n, total = flats[0].numel(), sum(weights)
    half = n // 2
    parts = []
    for reducer, (lo, hi) in enumerate(((0, half), (half, n))):
        sender = 1 - reducer
        sent = flats[sender][lo:hi]
        if residuals is not None:
            sent = sent + residuals.get(("sent", sender, reducer), 0.0)
        received = through(sent, codec)
        if residuals is not None:
            residuals[("sent", sender, reducer)] = sent - received
        mean = (weights[reducer] * flats[reducer][lo:hi] + weights[sender] * received) / total
        if residuals is not None:
            mean = mean + residuals.get(("reduced", reducer), 0.0)
        out = through(mean, codec)
        if residuals is not None:
            residuals[("reduced", reducer)] = mean - out
        parts.append(out)
    return torch.cat(parts)


def run(config: str, steps: int) -> list[float]:
    """Held-out loss after each of ``steps`` global steps of the reference run under ``config``."""
    c = parse(config)
    work = FULL.work
    optim = stock_optimizer_config()
    models = [build_stage(work.gpt_config(), s, STAGES, seed=0) for s in range(STAGES)]
    optimizers = [stock_optimizer(m, optim) for m in models]
    batcher, n = work.batcher(), work.microbatches_per_step
    stale_n = round(c["stale"] * n)
    residuals: list[dict] | None = [{} for _ in models] if c["ef"] else None

    def loss_of(stage_models, mb) -> torch.Tensor:
        x = mb.inputs
        for i, m in enumerate(stage_models):
            x = m(x)
            if i < len(stage_models) - 1:
                x = _Wire.apply(x, c["wire"])
        return loss_fn(x, mb.targets)

    older, losses = None, []
    for step in range(steps):
        ahead = predicted(models, optimizers, optim.lr_at(step), c["predict"]) if stale_n else None
        replicas = (range(3), range(3, n)) if c["round"] else (range(n),)
        flats, weights = [], []
        for idx in replicas:
            for i in idx:
                mb = batcher.microbatch(step * n + i)
                on = older if (i < stale_n and older is not None) else models
                (loss_of(on, mb) / len(idx)).backward()
                if on is not models:
                    for shadow, m in zip(on, models):
                        for sp, p in zip(shadow.parameters(), m.parameters()):
                            p.grad = sp.grad.clone() if p.grad is None else p.grad + sp.grad
                        shadow.zero_grad(set_to_none=True)
            flats.append(_grads(models))
            weights.append(len(idx))
            for m in models:
                m.zero_grad(set_to_none=True)
        for s, m in enumerate(models):
            mean = (
                _round([f[s] for f in flats], weights, c["round"], residuals[s] if residuals is not None else None)
                if c["round"]
                else flats[0][s]
            )
            offset = 0
            for p in m.parameters():
                p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        older = ahead
        reference_step(models, optimizers, optim, step)
        losses.append(held_out_loss(models, work))
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.arena_trajectory", description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="*", metavar="CONFIG", help=f"default: {' '.join(DEFAULT_CONFIGS)}")
    p.add_argument("--steps", type=int, default=12, help="global steps per config (default 12)")
    p.add_argument("--list", action="store_true", help="print the default configs and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(DEFAULT_CONFIGS))
        return 0
    configs = args.configs or list(DEFAULT_CONFIGS)
    for config in configs:
        try:
            parse(config)
        except ValueError as exc:
            p.error(str(exc))
    torch.set_num_threads(1)
    target = reference_targets(FULL.work, STAGES, {TARGET_STEPS})[TARGET_STEPS]
    print(f"target {target:.4f} (one process after {TARGET_STEPS} steps)", flush=True)
    for config in configs:
        started = time.monotonic()
        losses = run(config, args.steps)
        reached = next((k + 1 for k, loss in enumerate(losses) if loss <= target), None)
        print(
            f"{config:<26} reached at step {reached or f'>{args.steps}'}; step {TARGET_STEPS}: "
            f"{losses[TARGET_STEPS - 1]:.4f}; losses {' '.join(f'{x:.4f}' for x in losses)} "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
