"""Every global step's held-out loss, from the weights a side wrote after each step (the WAN
arena, ``bench/arena.py``).

A side writes each stage's weights after every global step into one directory, in a
checkpoint's layout (``DIR/step-K/stage-S.safetensors``): the mesh's stage servers with
``SWARM_STEP_SNAPSHOT_DIR``, pipelining's ranks with ``snapshots`` in their config. Step
``k``'s model is each stage's weights after its step ``k``; a stage that wrote none at
``k`` (it caught up past it, or it is a replica that came back from a checkpoint) counts
with its latest before; one that wrote none yet, with its initial weights. Every side is
scored on the same 4 held-out microbatches, here, off its clock.

- :func:`snapshot_curve`: after a run, every step to the first at the target (the arena's
  record of steps and time to target);
- ``python -m bench.arena_eval CONFIG_JSON``: while a side trains, the same for each step as
  soon as every stage wrote it or moved past it, one JSON line ``{"step", "loss"}`` each,
  until one reaches the target. The arena runs it at the lowest CPU priority beside the mesh
  as the mesh's signal to stop, so that its trainer need not evaluate on the stage servers'
  cores while it trains (pipelining evaluates between its steps, off its clock).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.arena_pipelining import EVAL_MICROBATCHES, fresh_stage, loss_fn
from bench.workload import Workload
from shared.checkpoint import read_stage_file, state_from_bytes, step_dir

POLL_S = 0.2


def forward(models: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for m in models:
        x = m(x)
    return x


def held_out_loss(models: list[torch.nn.Module], work: Workload) -> float:
    """The held-out loss of the stages ``models`` in a row, on the 4 microbatches every side
    evaluates, to 4 decimals (as the sides print theirs)."""
    batcher = work.batcher()
    with torch.no_grad():
        losses = [
            float(loss_fn(forward(models, mb.inputs), mb.targets))
            for mb in (batcher.microbatch(i, split="eval") for i in range(EVAL_MICROBATCHES))
        ]
    return round(sum(losses) / len(losses), 4)


@dataclass
class Snapshots:
    """The model of each step, from the snapshots in ``root``."""

    root: Path
    work: Workload
    stages: int
    layers: list[int] | None = None
    models: list[torch.nn.Module] = field(init=False)
    _loaded: list[int] = field(init=False)  # the step whose weights each stage's model holds (0: initial)

    def __post_init__(self):
        self.models = [fresh_stage(self.work, s, self.stages, self.layers).eval() for s in range(self.stages)]
        self._loaded = [0] * self.stages

    def written(self) -> dict[int, set[int]]:
        """Stage -> the steps it wrote."""
        found: dict[int, set[int]] = {s: set() for s in range(self.stages)}
        if self.root.is_dir():
            for path in self.root.glob("step-*/stage-*.safetensors"):
                step, stage = int(path.parent.name.split("-")[1]), int(path.stem.split("-")[1])
                if stage in found:
                    found[stage].add(step)
        return found

    def ready(self, step: int, written: dict[int, set[int]]) -> bool:
        """Every stage wrote ``step`` or a later one: the step's model is known for good."""
        return all(any(k >= step for k in steps) for steps in written.values())

    def loss(self, step: int, written: dict[int, set[int]]) -> float:
        for s, model in enumerate(self.models):
            latest = max((k for k in written[s] if k <= step), default=0)
            if latest != self._loaded[s]:
                tensors, _ = state_from_bytes(read_stage_file(step_dir(self.root, latest), s))
                params = dict(model.named_parameters())
                missing, unexpected = model.load_state_dict(tensors, strict=False)
                assert not unexpected and not [m for m in missing if m in params], (
                    f"stage {s} step {latest}: missing {missing}, unexpected {unexpected}"
                )
                self._loaded[s] = latest
        return held_out_loss(self.models, self.work)


def snapshot_curve(
    root: Path, work: Workload, stages: int, target: float, step_times: dict[int, float], layers=None
) -> list[dict]:
    """After a run: every step's held-out loss from its snapshots, from step 1 to the first
    that reaches ``target`` (or the last written). Each point: step, loss, and
    ``elapsed_s``, the side's training time when it saw the step done (None: unseen)."""
    snaps = Snapshots(root, work, stages, layers)
    written = snaps.written()
    last = max((k for steps in written.values() for k in steps), default=0)
    curve = []
    for k in range(1, last + 1):
        loss = snaps.loss(k, written)
        curve.append({"step": k, "loss": loss, "elapsed_s": step_times.get(k)})
        if loss <= target:
            break
    return curve


def follow(cfg: dict) -> None:
    """While a side trains: print each step's loss once its model is known, until the target
    or ``timeout_s``."""
    snaps = Snapshots(Path(cfg["root"]), Workload(**cfg["work"]), cfg["stages"], cfg.get("layers"))
    deadline, step = time.monotonic() + cfg["timeout_s"], 1
    while time.monotonic() < deadline:
        written = snaps.written()
        if not snaps.ready(step, written):
            time.sleep(POLL_S)
            continue
        loss = snaps.loss(step, written)
        print(json.dumps({"event": "snapshot.eval", "step": step, "loss": loss}), flush=True)
        if loss <= cfg["target"]:
            return
        step += 1


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    follow(json.loads(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
