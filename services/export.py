"""``swarm export``: the whole model from a checkpoint, as one safetensors file or a
Hugging Face model directory.

    swarm export --checkpoint-dir DIR --out model.safetensors [--step N]
    swarm export --checkpoint-dir DIR --format hf --out HF_DIR [--tokenizer PATH] [--max-shard-mb N]
    swarm export --checkpoint-dir DIR --format peft --out ADAPTER_DIR [--model HF_DIR] [--merge]

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
needed to write it.

A LoRA run's checkpoint (``SWARM_LORA_RANK``) holds the adapters alone: ``--format peft``
writes ``adapter_config.json`` and ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained(base, ADAPTER_DIR)`` loads onto the base model, and with
``--merge`` a Hugging Face model directory of base plus adapters (``W + B A alpha / r``)
instead. The base is ``--model`` (default: the directory the stage servers loaded, if it is
here); every stage's base tensors are read from it and must have the fingerprint the
adapters were trained on, else the export is refused. Exit status: 0 written, 2 no such
checkpoint, an incomplete one, or a model, base or tokenizer that cannot be exported so.
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
from shared.hf import HFModelError, is_hf_dir, load_stage_from_hf, read_hf_config, save_hf
from shared.lora import LoraConfig, base_fingerprint, is_adapter, merge_into, save_peft
from shared.model import ModelConfig, config_from_dict, partition, whole_model, whole_parameters

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


def _read_stages(ckpt: Path) -> tuple[dict[str, torch.Tensor], ModelConfig, list[dict]]:
    """Every stage's parameters of checkpoint ``ckpt`` (our names) and each stage's metadata."""
    try:
        meta = read_meta(ckpt)
        cfg, num_stages = config_from_dict(meta["model_config"]), int(meta["num_stages"])
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise IncompleteCheckpoint(f"{ckpt}/{META} is unreadable: {exc!r}") from None
    params: dict[str, torch.Tensor] = {}
    metas = []
    for stage in range(num_stages):
        try:
            tensors, stage_meta = state_from_bytes(read_stage_file(ckpt, stage))
        except FileNotFoundError:
            raise IncompleteCheckpoint(f"{ckpt} lacks the state of stage {stage}") from None
        except BadPayload as exc:
            raise IncompleteCheckpoint(f"{ckpt}: stage {stage}: {exc.message}") from None
        metas.append(stage_meta)
        for name, t in tensors.items():
            if is_parameter(name):
                if name in params:
                    raise IncompleteCheckpoint(f"{ckpt}: parameter {name!r} appears in two stages")
                params[name] = t
    return params, cfg, metas


def _lora_of(metas: list[dict]) -> LoraConfig | None:
    loras = [m.get("lora") for m in metas]
    if any(lora != loras[0] for lora in loras):
        raise IncompleteCheckpoint(f"the stages were trained with different LoRA settings: {loras}")
    return LoraConfig.from_dict(loras[0]) if loras[0] else None


def collect_parameters(ckpt: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Every stage's parameters of checkpoint ``ckpt``, checked against the whole model."""
    params, cfg, metas = _read_stages(ckpt)
    if _lora_of(metas) is not None:
        raise ValueError(
            f"{ckpt} is of a LoRA run: it holds adapters, not the model; export it with --format peft (the adapters) "
            "or --format peft --merge (base plus adapters as a Hugging Face model)"
        )
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
    params, cfg = collect_parameters(ckpt)
    return _save_hf_with_tokenizer(params, cfg, out_dir, tokenizer=tokenizer, max_shard_mb=max_shard_mb)


def _save_hf_with_tokenizer(
    params: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *, tokenizer: str, max_shard_mb: float
) -> list[Path]:
    from shared.tokenizer import save_tokenizer

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


def export_peft(
    ckpt: Path,
    out_dir: str | Path,
    *,
    model_dir: str = "",
    merge: bool = False,
    tokenizer: str = "",
    max_shard_mb: float = DEFAULT_MAX_SHARD_MB,
) -> list[Path]:
    """The adapters of LoRA checkpoint ``ckpt`` for peft, or (``merge``) base plus adapters as
    a Hugging Face model directory; refused unless every stage of ``model_dir`` (default: the
    servers' model directory) is the base the adapters were trained on."""
    adapters, cfg, metas = _read_stages(ckpt)
    lora = _lora_of(metas)
    if lora is None:
        raise ValueError(f"{ckpt} is not of a LoRA run (no adapters): export it with --format hf or safetensors")
    not_adapters = sorted(n for n in adapters if not is_adapter(n))
    if not_adapters:
        raise IncompleteCheckpoint(f"{ckpt}: a LoRA checkpoint holds parameters besides adapters: {not_adapters[:5]}")
    base = model_dir or next((m["base_model"] for m in metas if m.get("base_model")), "")
    if not base or not is_hf_dir(base):
        raise ValueError(
            f"the base model directory {base!r} is not here: give --model, the Hugging Face model directory the run "
            "was fine-tuned from"
        )
    try:
        if read_hf_config(base) != cfg:
            raise ValueError(f"{base} is another model than the one the adapters were trained on (its config differs)")
        specs = partition(cfg, len(metas))
        base_params: dict[str, torch.Tensor] = {}
        for stage, meta in enumerate(metas):
            model, _ = load_stage_from_hf(base, cfg, specs[stage])
            if base_fingerprint(model) != meta.get("base_fingerprint"):
                raise ValueError(
                    f"{base}: stage {stage}'s weights are not those the adapters were trained on (fingerprint "
                    f"{base_fingerprint(model)}, the checkpoint's {meta.get('base_fingerprint')}): give --model the "
                    "directory the run was fine-tuned from"
                )
            if merge:
                base_params.update({n: p.detach() for n, p in model.named_parameters()})
    except HFModelError as exc:
        raise ValueError(str(exc)) from None
    if not merge:
        return save_peft(out_dir, adapters, cfg, lora, base_model=str(Path(base).resolve()))
    merge_into(base_params, adapters, lora)
    params, cfg = whole_parameters(base_params, cfg)
    return _save_hf_with_tokenizer(params, cfg, out_dir, tokenizer=tokenizer, max_shard_mb=max_shard_mb)


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
        choices=("safetensors", "hf", "peft"),
        default="safetensors",
        help=(
            "one safetensors file for this project's loader (default), a Hugging Face model directory, or a LoRA "
            "run's adapters for peft (adapter_config.json, adapter_model.safetensors)"
        ),
    )
    p.add_argument(
        "--model",
        default="",
        help=(
            "--format peft: the base model directory the run was fine-tuned from (default: the stage servers' "
            "SWARM_MODEL, if it is here); its fingerprint is checked"
        ),
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="--format peft: write base plus adapters as one Hugging Face model directory instead of the adapters",
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
        if args.merge and args.format != "peft":
            raise ValueError("--merge merges a LoRA run's adapters into its base: use it with --format peft")
        if args.format == "peft":
            written = export_peft(
                ckpt,
                args.out,
                model_dir=args.model,
                merge=args.merge,
                tokenizer=args.tokenizer,
                max_shard_mb=args.max_shard_mb,
            )
            out = f"{args.out} ({', '.join(p.name for p in written)})"
        elif args.format == "hf":
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
