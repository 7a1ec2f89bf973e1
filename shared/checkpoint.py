"""A stage's state as bytes (safetensors), and the checkpoint directory that holds them.

State format: one safetensors file per stage. Tensors are the stage's parameters by their
model names (``wte.weight``, ``blocks.3.attn.c_attn.weight``...) and its AdamW moments as
``optim/<param name>/exp_avg`` and ``optim/<param name>/exp_avg_sq``; the safetensors
metadata field ``swarm`` holds a JSON object (stage, layers, model config, step counts).

Checkpoint layout::

    DIR/step-00000120/stage-0.safetensors   the bytes of state_to_bytes, one file per stage
    DIR/step-00000120/meta.json             {run_id, step, num_stages, model, model_config, stages, created_at}
    DIR/latest                              "step-00000120"
    DIR/newest/stage-0.safetensors          each stage's newest state saved, committed or not

``latest`` is replaced (atomically, by rename) only after every stage file and
``meta.json`` are on disk, so a crash mid-write never leaves a half checkpoint as latest.
A checkpoint is committed only when every stage gave its state; when one did not, the
others' states are still kept in ``newest/`` (each replaced only by a newer one), so that a
stage that loses every replica recovers from its newest state, not from the last checkpoint
every stage made (the churn arena found a stage sent back 23 steps that way).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

from shared.errors import BadPayload

OPTIM_PREFIX = "optim/"
METADATA_KEY = "swarm"
LATEST = "latest"
META = "meta.json"
NEWEST = "newest"
_STEP_PREFIX = "step-"


# ---------------------------------------------------------------- state bytes
def is_parameter(name: str) -> bool:
    """True for a parameter tensor, False for optimizer state (``optim/...``)."""
    return not name.startswith(OPTIM_PREFIX)


def state_to_bytes(tensors: dict[str, torch.Tensor], metadata: dict) -> bytes:
    """One safetensors file: ``tensors`` (CPU, contiguous) and ``metadata`` as JSON under ``swarm``."""
    return safetensors.torch.save(tensors, metadata={METADATA_KEY: json.dumps(metadata)})


def state_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of :func:`state_to_bytes`; :class:`BadPayload` says what is wrong with ``data``."""
    metadata = state_metadata(data)
    try:
        tensors = safetensors.torch.load(bytes(data))
    except SafetensorError as exc:
        raise BadPayload(f"state is not a valid safetensors file: {exc}") from None
    return tensors, metadata


def state_metadata(data: bytes) -> dict:
    """Only the metadata of a state (read from the safetensors header: 8-byte length, then
    JSON), without decoding a tensor; :class:`BadPayload` if ``data`` is no state."""
    if len(data) < 8:
        raise BadPayload(f"state is not a safetensors file: {len(data)} bytes")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise BadPayload(f"state is not a safetensors file: header of {size} bytes in a body of {len(data)}")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
        metadata = json.loads(header["__metadata__"][METADATA_KEY])
    except (ValueError, KeyError, TypeError):
        raise BadPayload(f"state has no JSON object in the safetensors metadata field {METADATA_KEY!r}") from None
    if not isinstance(metadata, dict):
        raise BadPayload(f"safetensors metadata field {METADATA_KEY!r} must hold a JSON object")
    return metadata


def file_metadata(path: str | os.PathLike) -> dict:
    """:func:`state_metadata` of a state file, reading only its header."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        return state_metadata(head + f.read(size))


# ---------------------------------------------------------------- checkpoint directory
def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{_STEP_PREFIX}{step:08d}"


def stage_file_name(stage: int) -> str:
    return f"stage-{stage}.safetensors"


def write_stage_file(root: str | os.PathLike, step: int, stage: int, data: bytes) -> Path:
    """Write one stage's state bytes into the (uncommitted) checkpoint of ``step``."""
    path = step_dir(root, step) / stage_file_name(stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, data)
    return path


def commit_checkpoint(root: str | os.PathLike, step: int, meta: dict) -> Path:
    """Write ``meta.json`` and then point ``latest`` at the checkpoint of ``step``.

    ``meta`` gives at least ``num_stages`` (and ``run_id``, ``model``, ``model_config``);
    ``step``, ``stages`` and ``created_at`` are filled in. Every stage file must be written
    already: a checkpoint that lacks one is never committed (:class:`FileNotFoundError`).
    """
    path = step_dir(root, step)
    stages = [stage_file_name(s) for s in range(int(meta["num_stages"]))]
    missing = [name for name in stages if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"cannot commit checkpoint {path}: missing {', '.join(missing)}")
    full = {**meta, "step": step, "stages": stages, "created_at": meta.get("created_at", time.time())}
    _write_atomic(path / META, json.dumps(full, indent=1).encode())
    _write_atomic(Path(root) / LATEST, path.name.encode())
    return path


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The last committed checkpoint, or None if there is none."""
    try:
        name = (Path(root) / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    path = Path(root) / name
    return path if _step_of(path) is not None and (path / META).is_file() else None


def read_meta(ckpt: str | os.PathLike) -> dict:
    return json.loads((Path(ckpt) / META).read_text())


def read_stage_file(ckpt: str | os.PathLike, stage: int) -> bytes:
    return (Path(ckpt) / stage_file_name(stage)).read_bytes()


def keep_newest_stage(root: str | os.PathLike, stage: int, data: bytes) -> bool:
    """Keep ``data`` as ``stage``'s newest state (``DIR/newest/``) unless the one kept there is
    as new (its ``optimizer_steps``); True if kept."""
    path = Path(root) / NEWEST / stage_file_name(stage)
    step = int(state_metadata(data).get("optimizer_steps", 0))
    if path.is_file() and int(file_metadata(path).get("optimizer_steps", 0)) >= step:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, data)
    return True


def newest_stage_file(root: str | os.PathLike, stage: int, not_past: int | None = None) -> tuple[Path, int] | None:
    """The newest state kept of ``stage`` and its step: the latest checkpoint's, or the one
    ``newest/`` holds if that is newer and not past step ``not_past`` (the stage's step in the
    swarm: a run resumed from an older checkpoint must not take a stage from beyond it; None:
    the checkpoint's only); None if there is neither."""
    found: list[tuple[int, Path]] = []
    latest = latest_checkpoint(root)
    candidates = [latest / stage_file_name(stage)] if latest is not None else []
    if not_past is not None:
        candidates.append(Path(root) / NEWEST / stage_file_name(stage))
    for path in candidates:
        try:
            step = int(file_metadata(path).get("optimizer_steps", 0))
        except FileNotFoundError:  # a damaged file is an error (BadPayload), never skipped silently
            continue
        if path.parent.name != NEWEST or step <= not_past:
            found.append((step, path))
    if not found:
        return None
    step, path = max(found, key=lambda f: f[0])  # the checkpoint's first on a tie
    return path, step


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete checkpoints older than the ``keep`` newest committed ones; returns what was deleted.

    The latest checkpoint is always kept, and so is anything newer than it (a checkpoint
    being written now). Older uncommitted leftovers of a crash are deleted.
    """
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1 (the latest checkpoint is always kept)")
    latest = latest_checkpoint(root)
    if latest is None:
        return []
    latest_step = _step_of(latest)
    steps = sorted(
        (
            p
            for p in Path(root).glob(f"{_STEP_PREFIX}*")
            if p.is_dir() and _step_of(p) is not None and _step_of(p) <= latest_step
        ),
        key=_step_of,
        reverse=True,
    )
    committed = [p for p in steps if (p / META).is_file()]
    doomed = [p for p in steps if p not in committed[:keep]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _step_of(path: Path) -> int | None:
    digits = path.name[len(_STEP_PREFIX) :]
    return int(digits) if path.name.startswith(_STEP_PREFIX) and digits.isdigit() else None


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file, flush it to disk, then rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
