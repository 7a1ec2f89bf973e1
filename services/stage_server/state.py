"""A stage's whole state (weights and AdamW moments) out of and into a StageRuntime.

Plain logic, no networking. Both functions touch the parameters, so the server calls them
on its compute worker, where they never race a step. The byte format (safetensors) lives
in :mod:`shared.checkpoint`, shared with checkpoints and ``swarm export``.

Tensors: parameters by their model names and ``optim/<name>/exp_avg``,
``optim/<name>/exp_avg_sq`` for every parameter the optimizer has stepped, and in
``SWARM_SYNC=local`` mode ``optim/outer/anchor`` and ``optim/outer/momentum`` (flat fp32:
the weights the replicas last agreed on and the outer momentum; a state without them
starts a local-mode replica's anchor at its weights). Metadata::

    {stage, num_stages, layers: [start, stop], model_config, weights_version,
     optimizer_steps, samples, adam_step: {param name: AdamW step count},
     mu_product: {param name: NAdam's product of look-ahead momenta} (SWARM_OPTIMIZER=nadamw),
     caught_up: [step numbers these weights took without their updates (catch_up)],
     recovered_at: the step the learning rate warms up again from (null: no recovery),
     grad_norm: the norm of the last step's gradient}

With LoRA (``shared.lora``) the parameters are the stage's adapters alone (``...lora_A``,
``...lora_B``) and their AdamW moments; the frozen base comes from the model directory. The
metadata then adds ``lora`` ({rank, alpha, dropout, target_modules}), ``base_fingerprint``
(of the base the adapters were trained on: it must equal this stage's) and ``base_model``
(the model directory the base was read from, on that server's machine).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from services.stage_server.runtime import StageRuntime
from shared.checkpoint import (
    OPTIM_PREFIX,
    stage_file_name,
    state_from_bytes,
    state_to_bytes,
    step_dir,
)
from shared.errors import BadPayload, WrongStage
from shared.log import get_logger
from shared.model import config_from_dict

__all__ = ["StepSnapshots", "load_stage_state", "nadam_mu_product", "stage_state", "state_from_bytes", "state_to_bytes"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
OUTER_ANCHOR, OUTER_MOMENTUM = f"{OPTIM_PREFIX}outer/anchor", f"{OPTIM_PREFIX}outer/momentum"


def stage_state(runtime: StageRuntime) -> tuple[dict[str, torch.Tensor], dict]:
    """A snapshot of the stage: CPU, contiguous copies that later steps do not change."""
    tensors: dict[str, torch.Tensor] = {}
    adam_step: dict[str, int] = {}
    mu_product: dict[str, float] = {}
    for name, p in _named_params(runtime):
        tensors[name] = _snapshot(p)
        state = runtime.optimizer.state.get(p)
        if state:
            for moment in _MOMENTS:
                tensors[f"{OPTIM_PREFIX}{name}/{moment}"] = _snapshot(state[moment])
            adam_step[name] = int(state["step"])
            if "mu_product" in state:  # NAdamW: a float32 scalar, exact as a JSON float
                mu_product[name] = float(state["mu_product"])
    if runtime.outer is not None:
        tensors[OUTER_ANCHOR], tensors[OUTER_MOMENTUM] = (
            _snapshot(runtime.outer.anchor),
            _snapshot(runtime.outer.momentum),
        )
    spec = runtime.spec
    metadata = {
        "stage": spec.index,
        "num_stages": spec.num_stages,
        "layers": [spec.layers.start, spec.layers.stop],
        "model_config": runtime.cfg.to_dict(),
        "weights_version": runtime.version,
        "optimizer_steps": runtime.stats.optimizer_steps,
        "samples": runtime.stats.samples,
        "adam_step": adam_step,
        **({"mu_product": mu_product} if mu_product else {}),
        "caught_up": sorted(runtime.caught_up),  # step numbers these weights took without their updates
        "recovered_at": runtime.recovered_at,  # the learning rate warms up from this step (None: no recovery)
        "grad_norm": runtime.stats.last_grad_norm,  # of the last step's gradient: CheckFree weighs neighbours by it
    }
    if runtime.lora is not None:
        metadata["lora"] = runtime.lora.to_dict()
        metadata["base_fingerprint"] = runtime.lora_report.base_fingerprint
        # where this server read the base (a path on its machine: swarm export's default --model)
        metadata["base_model"] = runtime.load_report.model_dir if runtime.load_report else None
    return tensors, metadata


def load_stage_state(runtime: StageRuntime, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    """Replace the stage's weights and optimizer state with ``tensors``/``metadata``.

    Everything is checked first: a state of another stage or model raises
    :class:`WrongStage`, a malformed one :class:`BadPayload`, and either leaves the
    runtime untouched. Loading makes a new weights version (the old one stays for the
    backwards of forwards in flight) and drops the accumulated gradients.
    """
    adam_step = _validate(runtime, tensors, metadata)
    mu_products = metadata.get("mu_product") or {}
    with runtime.new_version():
        with torch.no_grad():
            for name, p in _named_params(runtime):
                p.copy_(tensors[name])
        runtime.optimizer.state.clear()
        for name, p in _named_params(runtime):
            if name in adam_step:
                # the entries AdamW creates on its first step, holding the peer's values
                runtime.optimizer.state[p] = {
                    "step": torch.tensor(float(adam_step[name]), dtype=torch.float32),
                    **{
                        m: tensors[f"{OPTIM_PREFIX}{name}/{m}"].to(device=p.device, dtype=p.dtype, copy=True)
                        for m in _MOMENTS
                    },
                }
                if runtime.optim_cfg.name == "nadamw":  # the state's product; an AdamW run's state: replayed
                    product = mu_products.get(name)
                    runtime.optimizer.state[p]["mu_product"] = (
                        torch.tensor(product, dtype=torch.float32)
                        if product is not None
                        else nadam_mu_product(runtime.optim_cfg, adam_step[name])
                    )
        runtime.stats.optimizer_steps = metadata["optimizer_steps"]
        runtime.caught_up = set(metadata.get("caught_up", []))  # the loaded weights' history, not ours
        runtime.recovered_at = metadata.get("recovered_at")
    if runtime.outer is not None:
        if OUTER_ANCHOR in tensors:
            runtime.outer.reset(tensors[OUTER_ANCHOR], tensors[OUTER_MOMENTUM])
        else:  # a state of a global-mode run (or a checkpoint): the replicas agree on these weights
            runtime.outer.reset(
                torch.cat([tensors[name].reshape(-1).to(torch.float32) for name, _ in _named_params(runtime)])
            )
    runtime.reset_accumulation()


def nadam_mu_product(optim, steps: int) -> torch.Tensor:
    """NAdam's ``mu_product`` after ``steps`` steps, multiplied in the order and precision torch's NAdam does."""
    product = torch.tensor(1.0, dtype=torch.float32)
    beta1 = optim.betas[0]
    for step in range(1, steps + 1):
        product *= beta1 * (1.0 - 0.5 * (0.96 ** (step * optim.momentum_decay)))
    return product


# ---------------------------------------------------------------- validation
def _validate(runtime: StageRuntime, tensors: dict[str, torch.Tensor], metadata: dict) -> dict[str, int]:
    """Raise unless the state fits this runtime exactly; returns the AdamW step per parameter."""
    spec = runtime.spec
    for key, kind in (
        ("stage", int),
        ("num_stages", int),
        ("layers", list),
        ("model_config", dict),
        ("optimizer_steps", int),
        ("adam_step", dict),
    ):
        _check(type(metadata.get(key)) is kind, f"state metadata needs {key!r} of type {kind.__name__}")
    _check(metadata["optimizer_steps"] >= 0, "'optimizer_steps' must be >= 0")
    caught_up = metadata.get("caught_up", [])  # absent from states written before it was kept
    recovered_at = metadata.get("recovered_at")
    _check(
        recovered_at is None or (type(recovered_at) is int and recovered_at >= 0),
        "'recovered_at' must be a step number or null",
    )
    _check(
        type(caught_up) is list and all(type(s) is int and s >= 0 for s in caught_up),
        "'caught_up' must be a list of step numbers",
    )
    try:
        theirs_cfg = config_from_dict(metadata["model_config"])
    except ValueError as exc:
        raise BadPayload(f"state metadata 'model_config': {exc}") from None
    if theirs_cfg != runtime.cfg:
        raise WrongStage(f"state is of model {metadata['model_config']}, this server runs {runtime.cfg.to_dict()}")
    ours_lora = runtime.lora.to_dict() if runtime.lora is not None else None
    if metadata.get("lora") != ours_lora:
        raise WrongStage(f"state is of LoRA settings {metadata.get('lora')}, this server trains with {ours_lora}")
    if ours_lora is not None and metadata.get("base_fingerprint") != runtime.lora_report.base_fingerprint:
        raise WrongStage(
            f"state holds adapters trained on another base model (fingerprint {metadata.get('base_fingerprint')}, "
            f"this server's SWARM_MODEL has {runtime.lora_report.base_fingerprint}): start it with the model "
            "directory the run began with"
        )
    theirs = (metadata["stage"], metadata["num_stages"], metadata["layers"])
    ours = (spec.index, spec.num_stages, [spec.layers.start, spec.layers.stop])
    if theirs != ours:
        raise WrongStage(
            f"state is of stage {theirs[0]}/{theirs[1]} (layers {theirs[2]}), this server holds stage "
            f"{ours[0]}/{ours[1]} (layers {ours[2]})"
        )

    params = dict(_named_params(runtime))
    adam_step = metadata["adam_step"]
    unknown = sorted(set(adam_step) - set(params))
    _check(not unknown, f"'adam_step' names parameters this stage does not have: {unknown[:5]}")
    _check(all(type(s) is int and s >= 1 for s in adam_step.values()), "'adam_step' values must be ints >= 1")
    mu_product = metadata.get("mu_product", {})
    _check(
        type(mu_product) is dict
        and set(mu_product) <= set(adam_step)
        and all(type(v) is float and 0.0 < v <= 1.0 for v in mu_product.values()),
        "'mu_product' must map parameters of 'adam_step' to floats in (0, 1]",
    )
    expected = set(params) | {f"{OPTIM_PREFIX}{n}/{m}" for n in adam_step for m in _MOMENTS}
    outer = {name: tensors[name] for name in (OUTER_ANCHOR, OUTER_MOMENTUM) if name in tensors}
    if outer:
        _check(len(outer) == 2, f"state has {sorted(outer)} of the outer step without its other tensor")
        total = sum(p.numel() for p in params.values())
        for name, t in outer.items():
            _check(
                t.shape == (total,) and t.dtype == torch.float32,
                f"{name!r} must be {total} fp32 values, got {list(t.shape)} {t.dtype}",
            )
            _check(bool(torch.isfinite(t).all()), f"{name!r} contains non-finite values")
    tensors = {name: t for name, t in tensors.items() if name not in outer}
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    _check(not missing, f"state lacks {len(missing)} tensors of this stage, e.g. {missing[:5]}")
    _check(not extra, f"state has {len(extra)} tensors this stage does not have, e.g. {extra[:5]}")
    for name, t in tensors.items():
        p = params[name if name in params else name[len(OPTIM_PREFIX) :].rsplit("/", 1)[0]]
        _check(t.shape == p.shape, f"{name!r} has shape {list(t.shape)}, this stage needs {list(p.shape)}")
        _check(t.dtype == p.dtype, f"{name!r} has dtype {t.dtype}, this stage needs {p.dtype}")
        _check(bool(torch.isfinite(t).all()), f"{name!r} contains non-finite values")
    return adam_step


class StepSnapshots:
    """For benches (``SWARM_STEP_SNAPSHOT_DIR``): the stage's trainable weights after every
    global step this replica takes, in a checkpoint directory's layout
    (``DIR/step-K/stage-S.safetensors``: weights only, no optimizer state, never committed),
    so that a bench evaluates every step's model off the training clock (``bench/arena.py``).
    The first replica to have written a step wins (under ``SWARM_SYNC=global`` a step's replicas are
    identical; under ``local`` this is one replica's weights). Called on the compute worker
    after the step (``StageRuntime.on_step``): it copies the weights there and writes them
    from a thread of its own."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="step-snapshots")

    def __call__(self, runtime: StageRuntime) -> None:
        self.save(runtime.spec.index, runtime.step, runtime.named_params())

    def save(self, stage: int, step: int, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``named`` (name, tensor) now, as the weights of ``stage`` after ``step``, and
        write them in the background (unless that step's file is there already)."""
        if (step_dir(self.root, step) / stage_file_name(stage)).exists():
            return
        tensors = {name: _snapshot(p) for name, p in named}
        self._writer.submit(self._write, stage, step, tensors)

    def close(self) -> None:
        """Wait for the files queued so far."""
        self._writer.shutdown(wait=True)

    def _write(self, stage: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        path = step_dir(self.root, step) / stage_file_name(stage)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
                f.write(state_to_bytes(tensors, {"stage": stage, "step": step}))
            try:
                os.link(f.name, path)  # whole, and only if no other replica's is there yet
            except FileExistsError:
                pass
            finally:
                os.unlink(f.name)
        except OSError as exc:  # a measurement aid: training goes on without it
            get_logger(service="stage_server", stage=stage).warning("step_snapshot.failed", step=step, error=str(exc))


def _named_params(runtime: StageRuntime) -> list[tuple[str, torch.nn.Parameter]]:
    return runtime.named_params()


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", copy=True, memory_format=torch.contiguous_format)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise BadPayload(message)
