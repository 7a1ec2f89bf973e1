"""``swarm export``: the whole model from a checkpoint, as one safetensors file.

    swarm export --checkpoint-dir DIR --out model.safetensors [--step N]

Reads every stage file of the latest (or the given) checkpoint, keeps the parameters
(not the optimizer state), checks that together they are exactly the whole GPT's
parameters, and writes them with the model config as JSON in the metadata field
``model_config``. :func:`load_exported` turns the file back into a ``shared.model.GPT``.
Exit status: 0 written, 2 no such checkpoint or an incomplete one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from shared.checkpoint import META, is_parameter, latest_checkpoint, read_meta, read_stage_file, state_from_bytes, step_dir
from shared.errors import BadPayload
from shared.model import GPT, GPTConfig


class IncompleteCheckpoint(Exception):
    """The checkpoint is missing, or its stages do not add up to the whole model."""


def find_checkpoint(root: str | Path, step: int | None) -> Path:
    path = latest_checkpoint(root) if step is None else step_dir(root, step)
    if path is None:
        raise IncompleteCheckpoint(f"no committed checkpoint in {root} (no 'latest')")
    if not (path / META).is_file():
        raise IncompleteCheckpoint(f"{path} is not a committed checkpoint (no {META})")
    return path


def collect_parameters(ckpt: Path) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    """Every stage's parameters of checkpoint ``ckpt``, checked against the whole GPT."""
    try:
        meta = read_meta(ckpt)
        cfg, num_stages = GPTConfig(**meta["model_config"]), int(meta["num_stages"])
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise IncompleteCheckpoint(f"{ckpt}/{META} is unreadable: {exc!r}") from None
    params: dict[str, torch.Tensor] = {}
    for stage in range(num_stages):
        try:
            tensors, _ = state_from_bytes(read_stage_file(ckpt, stage))
        except FileNotFoundError:
            raise IncompleteCheckpoint(f"{ckpt} lacks the state of stage {stage}") from None
        except BadPayload as exc:
            raise IncompleteCheckpoint(f"{ckpt}: stage {stage}: {exc.message}") from None
        for name, t in tensors.items():
            if is_parameter(name):
                if name in params:
                    raise IncompleteCheckpoint(f"{ckpt}: parameter {name!r} appears in two stages")
                params[name] = t
    with torch.device("meta"):  # names and shapes only, no memory
        reference = dict(GPT(cfg).named_parameters())
    missing, extra = sorted(reference.keys() - params.keys()), sorted(params.keys() - reference.keys())
    if missing or extra:
        raise IncompleteCheckpoint(f"{ckpt}: the stages do not form the whole model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, p in reference.items():
        if params[name].shape != p.shape:
            raise IncompleteCheckpoint(f"{ckpt}: {name!r} has shape {list(params[name].shape)}, the model needs {list(p.shape)}")
    return params, cfg


def export(ckpt: Path, out: str | Path) -> Path:
    params, cfg = collect_parameters(ckpt)
    safetensors.torch.save_file(params, str(out), metadata={"model_config": json.dumps(cfg.to_dict())})
    return Path(out)


def load_exported(path: str | Path) -> GPT:
    """The single-process model from an exported file (strict: every parameter, nothing else)."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        cfg = GPTConfig(**json.loads(f.metadata()["model_config"]))
    model = GPT(cfg)
    model.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarm export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-dir", required=True, help="the checkpoint directory (holds 'latest' and step-*/)")
    p.add_argument("--out", required=True, help="the safetensors file to write")
    p.add_argument("--step", type=int, default=None, help="export this step's checkpoint instead of the latest")
    args = p.parse_args(argv)
    try:
        ckpt = find_checkpoint(args.checkpoint_dir, args.step)
        out = export(ckpt, args.out)
    except IncompleteCheckpoint as exc:
        print(f"swarm export: {exc}", file=sys.stderr)
        return 2
    print(f"swarm export: wrote {out} from {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
