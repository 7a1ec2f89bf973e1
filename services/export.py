"""``swarm export``: the whole model from a checkpoint, as one safetensors file or a
Hugging Face model directory.

    swarm export --checkpoint-dir DIR --out model.safetensors [--step N]
    swarm export --checkpoint-dir DIR --format hf --out HF_DIR [--tokenizer PATH] [--max-shard-mb N]

Reads every stage file of the latest (or the given) checkpoint, keeps the parameters
(not the optimizer state) and checks that together they are exactly the whole model's
parameters (a tied LM head that stages trained apart makes the model untied). The
single file holds them with the model config as JSON in the metadata field
``model_config``; :func:`load_exported` turns it back into the single-process model
(``shared.model.GPT`` or ``shared.llama.Llama``). ``--format hf`` writes config.json,
generation_config.json, model.safetensors (sharded past ``--max-shard-mb``) and, with
``--tokenizer`` (a tokenizer.json or a directory holding one, e.g. the model directory
the run started from), the tokenizer: ``transformers.AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load the directory. ``transformers`` itself is not
needed to write it. Exit status: 0 written, 2 no such checkpoint, an incomplete one, or a
model or tokenizer that cannot be exported so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from shared.checkpoint import (
    META,
    is_parameter,
    latest_checkpoint,
    read_meta,
    read_stage_file,
    state_from_bytes,
    step_dir,
)
from shared.errors import BadPayload
from shared.hf import save_hf
from shared.model import ModelConfig, config_from_dict, whole_model, whole_parameters

DEFAULT_MAX_SHARD_MB = 5000


class IncompleteCheckpoint(Exception):
    """The checkpoint is missing, or its stages do not add up to the whole model."""


def find_checkpoint(root: str | Path, step: int | None) -> Path:
    path = latest_checkpoint(root) if step is None else step_dir(root, step)
    if path is None:
        raise IncompleteCheckpoint(f"no committed checkpoint in {root} (no 'latest')")
    if not (path / META).is_file():
        raise IncompleteCheckpoint(f"{path} is not a committed checkpoint (no {META})")
    return path


def collect_parameters(ckpt: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Every stage's parameters of checkpoint ``ckpt``, checked against the whole model."""
    try:
        meta = read_meta(ckpt)
        cfg, num_stages = config_from_dict(meta["model_config"]), int(meta["num_stages"])
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
    params, cfg = whole_parameters(params, cfg)
    with torch.device("meta"):  # names and shapes only, no memory
        reference = dict(whole_model(cfg).named_parameters())
    missing, extra = sorted(reference.keys() - params.keys()), sorted(params.keys() - reference.keys())
    if missing or extra:
        raise IncompleteCheckpoint(
            f"{ckpt}: the stages do not form the whole model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, p in reference.items():
        if params[name].shape != p.shape:
            raise IncompleteCheckpoint(
                f"{ckpt}: {name!r} has shape {list(params[name].shape)}, the model needs {list(p.shape)}"
            )
    return params, cfg


def export(ckpt: Path, out: str | Path) -> Path:
    params, cfg = collect_parameters(ckpt)
    safetensors.torch.save_file(params, str(out), metadata={"model_config": json.dumps(cfg.to_dict())})
    return Path(out)


def export_hf(
    ckpt: Path, out_dir: str | Path, *, tokenizer: str = "", max_shard_mb: float = DEFAULT_MAX_SHARD_MB
) -> list[Path]:
    """A Hugging Face model directory of checkpoint ``ckpt`` (and the tokenizer ``tokenizer``, if given)."""
    from shared.tokenizer import save_tokenizer

    params, cfg = collect_parameters(ckpt)
    tok = save_tokenizer(tokenizer, out_dir, model_max_length=cfg.block_size) if tokenizer else None
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer {tok.name} has {tok.vocab_size} tokens, more than the model's vocabulary of "
            f"{cfg.vocab_size} (--tokenizer)"
        )
    ids = (
        {"bos_token_id": tok.bos_id if tok.bos_id is not None else tok.eos_id, "eos_token_id": tok.eos_id}
        if tok
        else {}
    )
    return save_hf(out_dir, params, cfg, max_shard_bytes=int(max_shard_mb * 2**20), **ids)


def load_exported(path: str | Path) -> torch.nn.Module:
    """The single-process model from an exported file (strict: every parameter, nothing else)."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        cfg = config_from_dict(json.loads(f.metadata()["model_config"]))
    model = whole_model(cfg)
    model.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarm export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-dir", required=True, help="the checkpoint directory (holds 'latest' and step-*/)")
    p.add_argument(
        "--out",
        required=True,
        help="the safetensors file (--format safetensors) or the directory (--format hf) to write",
    )
    p.add_argument("--step", type=int, default=None, help="export this step's checkpoint instead of the latest")
    p.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="one safetensors file for this project's loader (default), or a Hugging Face model directory",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        help="--format hf: the run's tokenizer (a tokenizer.json or a directory holding one) to write beside the model",
    )
    p.add_argument(
        "--max-shard-mb",
        type=float,
        default=DEFAULT_MAX_SHARD_MB,
        help=(
            "--format hf: largest safetensors file in MiB before the weights are sharded (default "
            f"{DEFAULT_MAX_SHARD_MB})"
        ),
    )
    args = p.parse_args(argv)
    try:
        ckpt = find_checkpoint(args.checkpoint_dir, args.step)
        if args.format == "hf":
            written = export_hf(ckpt, args.out, tokenizer=args.tokenizer, max_shard_mb=args.max_shard_mb)
            no_tokenizer = "" if args.tokenizer else "; no tokenizer: give --tokenizer for AutoTokenizer"
            out = f"{args.out} ({len(written)} model files{no_tokenizer})"
        else:
            out = export(ckpt, args.out)
    except (IncompleteCheckpoint, ValueError) as exc:
        print(f"swarm export: {exc}", file=sys.stderr)
        return 2
    print(f"swarm export: wrote {out} from {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
