"""``SWARM_STEP_SNAPSHOT_DIR``: a stage's weights after every global step, written beside the
training for a bench to evaluate every step off its clock (``services/stage_server/state.py:
StepSnapshots``, read by ``bench/arena.py``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from services.stage_server.app import build_runtime
from services.stage_server.runtime import Accumulated, OptimizerConfig, StageRuntime
from services.stage_server.state import StepSnapshots
from shared.checkpoint import read_stage_file, state_from_bytes, step_dir
from shared.model import PRESETS
from tests.conftest import stage_settings

CFG = replace(PRESETS["tiny"], n_layer=4, d_model=8, n_head=2, block_size=4)


def runtime() -> StageRuntime:
    return StageRuntime(CFG, 1, 4, seed=0, optim=OptimizerConfig(global_batch=4), solo=False)


def gradient(rt: StageRuntime, seed: int) -> Accumulated:
    numel = sum(p.numel() for p in rt.params)
    return Accumulated(torch.randn(numel, generator=torch.Generator().manual_seed(seed)), 4, frozenset({f"mb{seed}"}))


def weights(rt: StageRuntime) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in rt.named_params()}


def snapshot(root, step: int, stage: int = 1) -> tuple[dict[str, torch.Tensor], dict]:
    return state_from_bytes(read_stage_file(step_dir(root, step), stage))


def test_every_step_is_written_as_it_was_and_the_first_replica_of_a_step_wins(tmp_path):
    a, b = runtime(), runtime()
    writers = [StepSnapshots(tmp_path), StepSnapshots(tmp_path)]
    a.on_step, b.on_step = writers
    after = {}
    for step in (1, 2):
        a.apply_step(gradient(a, step))
        after[step] = weights(a)
    a.pass_step()  # a step without a gradient (local mode) is a step too
    writers[0].close()
    b.apply_step(gradient(b, 99))  # another replica's step 1, on other values: not written over a's
    writers[1].close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002", "step-00000003"]
    for step, expected in after.items():
        tensors, metadata = snapshot(tmp_path, step)
        assert metadata == {"stage": 1, "step": step}
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name]) for name in expected)
    others = weights(b)
    assert not all(torch.equal(snapshot(tmp_path, 1)[0][name], others[name]) for name in others)
    third, _ = snapshot(tmp_path, 3)
    assert all(torch.equal(third[name], after[2][name]) for name in third)  # a pass leaves the weights
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_setting_hooks_the_writer_and_none_is_the_default(tmp_path):
    assert build_runtime(stage_settings(0, model="tiny")).on_step is None
    hooked = build_runtime(stage_settings(0, model="tiny", step_snapshot_dir=str(tmp_path)))
    assert isinstance(hooked.on_step, StepSnapshots)
    hooked.apply_step(gradient(hooked, 0))
    hooked.on_step.close()
    assert snapshot(tmp_path, 1, stage=0)[1]["step"] == 1
