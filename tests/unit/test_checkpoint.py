"""Stage state out of and into a StageRuntime, the checkpoint directory, and ``swarm export``.

No sockets: StageRuntime objects of the ``tiny`` model (4 blocks) cut into 4 stages.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import safetensors.torch
import torch

from services import cli
from services.export import load_exported
from services.export import main as export_main
from services.stage_server.runtime import OptimizerConfig, StageRuntime
from services.stage_server.state import load_stage_state, stage_state, state_from_bytes, state_to_bytes
from shared import checkpoint
from shared.checkpoint import OPTIM_PREFIX
from shared.errors import BadPayload, WrongStage
from shared.model import PRESETS, build_gpt

CFG = PRESETS["tiny"]
NUM_STAGES = 4
BATCH, SEQ = 2, 8


def runtime(
    stage: int, *, seed: int = 0, global_batch: int = 4, cfg=CFG, num_stages: int = NUM_STAGES, optimizer="adamw"
) -> StageRuntime:
    optim = OptimizerConfig(global_batch=global_batch, name=optimizer, betas=(0.99, 0.95))
    return StageRuntime(cfg, stage, num_stages, seed=seed, optim=optim)


def microbatch(seed: int, cfg=CFG):
    """(token ids, targets, hidden states, output gradient) of BATCH x SEQ, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    hidden = torch.randn(BATCH, SEQ, cfg.d_model, generator=gen)
    return ids, targets, hidden, torch.randn(BATCH, SEQ, cfg.d_model, generator=gen)


def train(rt: StageRuntime, seeds) -> None:
    """One backward per seed, with inputs that fit the runtime's stage."""
    for seed in seeds:
        ids, targets, hidden, grad = microbatch(seed, rt.cfg)
        spec = rt.spec
        rt.backward(
            f"mb-{seed}",
            seed,
            ids if spec.is_first else hidden,
            targets if spec.is_last else None,
            None if spec.is_last else grad,
        )


def params(rt: StageRuntime) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in rt.model.named_parameters()}


def optimizer_state(rt: StageRuntime) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {k: v.clone() for k, v in rt.optimizer.state[p].items()}
        for name, p in rt.model.named_parameters()
        if rt.optimizer.state.get(p)
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, dict):
            assert_same(value, b[name])
        else:
            assert value.dtype == b[name].dtype and torch.equal(value, b[name]), name


def via_bytes(rt: StageRuntime):
    return state_from_bytes(state_to_bytes(*stage_state(rt)))


# ---------------------------------------------------------------- state round trip
@pytest.mark.parametrize("optimizer", ["adamw", "nadamw"])
@pytest.mark.parametrize("stage", [0, 1, NUM_STAGES - 1])
def test_loaded_state_has_the_same_weights_and_optimizer_state_and_steps_the_same(stage, optimizer):
    source = runtime(stage, seed=1, optimizer=optimizer)
    train(source, range(4))  # 2 optimizer steps, nothing pending
    assert source.stats.optimizer_steps == 2 and source.pending_samples == 0
    joiner = runtime(stage, seed=2, optimizer=optimizer)
    train(joiner, [100])  # pending gradients of the old weights, to be dropped
    version = joiner.version

    load_stage_state(joiner, *via_bytes(source))

    assert_same(params(joiner), params(source))
    assert_same(optimizer_state(joiner), optimizer_state(source))
    assert len(optimizer_state(joiner)) == len(source.params)
    assert joiner.pending_samples == 0 and not any(acc.any() for acc in joiner.accumulators())
    assert joiner.version > version and joiner.stats.optimizer_steps == 2
    train(source, [10, 11])  # one more optimizer step on each
    train(joiner, [10, 11])
    assert source.stats.optimizer_steps == joiner.stats.optimizer_steps == 3
    assert_same(params(joiner), params(source))
    assert_same(optimizer_state(joiner), optimizer_state(source))


def test_an_adamw_state_loaded_by_a_nadamw_stage_gets_the_look_ahead_product_of_its_steps():
    """NAdamW keeps the product of its look-ahead momenta; a state without it (an AdamW run's
    checkpoint) gets the product its step count makes, as torch's NAdam multiplies it."""
    nadamw, adamw = runtime(1, seed=1, optimizer="nadamw"), runtime(1, seed=1)
    for rt in (nadamw, adamw):
        train(rt, range(6))  # 3 steps
    tensors, metadata = via_bytes(adamw)
    assert "mu_product" not in metadata
    joiner = runtime(1, seed=2, optimizer="nadamw")
    load_stage_state(joiner, tensors, metadata)
    for p, q in zip(joiner.params, nadamw.params):
        ours, theirs = joiner.optimizer.state[p]["mu_product"], nadamw.optimizer.state[q]["mu_product"]
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    _, metadata = via_bytes(nadamw)
    assert set(metadata["mu_product"]) == set(metadata["adam_step"]) and 0 < min(metadata["mu_product"].values()) < 1
    bad = dict(metadata, mu_product={"no.such.param": 0.5})
    with pytest.raises(BadPayload, match="mu_product"):
        load_stage_state(joiner, *via_bytes(nadamw)[:1], bad)


def test_state_is_a_cpu_snapshot_with_metadata():
    rt = runtime(2)
    train(rt, range(2))
    tensors, meta = stage_state(rt)
    assert meta == {
        "stage": 2,
        "num_stages": 4,
        "layers": [2, 3],
        "model_config": CFG.to_dict(),
        "weights_version": 1,
        "optimizer_steps": 1,
        "samples": 4,
        "adam_step": {name: 1 for name, _ in rt.model.named_parameters()},
        "caught_up": [],
        "recovered_at": None,
        "grad_norm": rt.stats.last_grad_norm,
    }
    assert meta["grad_norm"] > 0
    names = [name for name, _ in rt.model.named_parameters()]
    assert set(tensors) == set(names) | {f"{OPTIM_PREFIX}{n}/{m}" for n in names for m in ("exp_avg", "exp_avg_sq")}
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())
    assert checkpoint.state_metadata(state_to_bytes(tensors, meta)) == meta  # header only, no tensor decoded
    before = {k: v.clone() for k, v in tensors.items()}
    train(rt, range(2, 4))  # the snapshot does not follow later steps
    assert_same(tensors, before)


def test_state_of_a_runtime_that_never_stepped_has_no_optimizer_state():
    source, joiner = runtime(1, seed=1), runtime(1, seed=2)
    train(joiner, range(2))  # joiner has AdamW state; the loaded state has none
    tensors, meta = stage_state(source)
    assert meta["adam_step"] == {} and not any(name.startswith(OPTIM_PREFIX) for name in tensors)
    load_stage_state(joiner, tensors, meta)
    assert_same(params(joiner), params(source))
    assert optimizer_state(joiner) == {} and joiner.stats.optimizer_steps == 0


def _drop_one(tensors, meta):
    tensors.pop("blocks.1.attn.c_attn.weight")


def _reshape_one(tensors, meta):
    tensors["blocks.1.mlp.c_fc.bias"] = torch.zeros(3)


def _nan(tensors, meta):
    tensors["blocks.1.ln_1.weight"][0] = float("nan")


def _retype(tensors, meta):
    tensors["blocks.1.ln_1.weight"] = tensors["blocks.1.ln_1.weight"].double()


def _extra(tensors, meta):
    tensors["wte.weight"] = torch.zeros(CFG.vocab_size, CFG.d_model)


def _drop_moment(tensors, meta):
    tensors.pop(f"{OPTIM_PREFIX}blocks.1.attn.c_proj.weight/exp_avg_sq")


def _bad_meta(tensors, meta):
    meta["optimizer_steps"] = "three"


def _other_stage_index(tensors, meta):
    meta["stage"] = 2


@pytest.mark.parametrize(
    "source, corrupt, error",
    [
        (lambda: runtime(2), None, WrongStage),  # another stage
        (lambda: runtime(1, num_stages=2), None, WrongStage),  # stage 1 of another cut (layers 2..4)
        (lambda: runtime(1, cfg=replace(CFG, d_model=64)), None, WrongStage),  # another model
        (lambda: runtime(1), _other_stage_index, WrongStage),
        (lambda: runtime(1), _drop_one, BadPayload),
        (lambda: runtime(1), _reshape_one, BadPayload),
        (lambda: runtime(1), _nan, BadPayload),
        (lambda: runtime(1), _retype, BadPayload),
        (lambda: runtime(1), _extra, BadPayload),
        (lambda: runtime(1), _drop_moment, BadPayload),
        (lambda: runtime(1), _bad_meta, BadPayload),
    ],
    ids=["stage", "cut", "model", "meta-stage", "missing", "shape", "nan", "dtype", "extra", "moment", "meta"],
)
def test_a_mismatched_state_is_refused_and_changes_nothing(source, corrupt, error):
    src = source()
    train(src, range(2))
    tensors, meta = stage_state(src)
    if corrupt:
        corrupt(tensors, meta)
    rt = runtime(1, seed=5)
    train(rt, range(3))  # one step done, one microbatch pending
    before = (
        params(rt),
        optimizer_state(rt),
        rt.version,
        rt.pending_samples,
        [a.clone() for a in rt.accumulators()],
        rt.stats.optimizer_steps,
    )

    with pytest.raises(error) as info:
        load_stage_state(rt, tensors, meta)

    assert info.value.message  # says what is wrong
    assert_same(params(rt), before[0])
    assert_same(optimizer_state(rt), before[1])
    assert (rt.version, rt.pending_samples, rt.stats.optimizer_steps) == (before[2], before[3], before[5])
    assert all(torch.equal(a, b) for a, b in zip(rt.accumulators(), before[4]))


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", (10**9).to_bytes(8, "little") + b"{}", safetensors.torch.save({"x": torch.zeros(2)})],
    ids=["empty", "garbage", "header-overflow", "no-swarm-metadata"],
)
def test_state_from_bytes_refuses_what_is_not_a_state(data):
    with pytest.raises(BadPayload):
        state_from_bytes(data)
    with pytest.raises(BadPayload):
        checkpoint.state_metadata(data)


def test_state_from_bytes_refuses_a_truncated_state():
    data = state_to_bytes(*stage_state(runtime(1)))
    with pytest.raises(BadPayload):
        state_from_bytes(data[: len(data) // 2])


# ---------------------------------------------------------------- checkpoint directory
def write_checkpoint(root, step: int, num_stages: int = 2, *, commit: bool = True, skip=()):
    for stage in range(num_stages):
        if stage not in skip:
            checkpoint.write_stage_file(root, step, stage, f"stage {stage} of step {step}".encode())
    meta = {"run_id": "r", "num_stages": num_stages, "model": "tiny", "model_config": CFG.to_dict()}
    return checkpoint.commit_checkpoint(root, step, meta) if commit else None


def test_commit_makes_a_checkpoint_latest(tmp_path):
    assert checkpoint.latest_checkpoint(tmp_path) is None
    path = write_checkpoint(tmp_path, 5)
    assert path == tmp_path / "step-00000005" and checkpoint.latest_checkpoint(tmp_path) == path
    assert (tmp_path / "latest").read_text() == "step-00000005"
    meta = checkpoint.read_meta(path)
    assert meta["step"] == 5 and meta["stages"] == ["stage-0.safetensors", "stage-1.safetensors"]
    assert meta["run_id"] == "r" and meta["model_config"] == CFG.to_dict() and meta["created_at"] > 0
    assert checkpoint.read_stage_file(path, 1) == b"stage 1 of step 5"
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_half_written_checkpoint_is_never_latest(tmp_path):
    done = write_checkpoint(tmp_path, 5)
    write_checkpoint(tmp_path, 6, commit=False)  # every file written, the commit never came
    assert checkpoint.latest_checkpoint(tmp_path) == done
    write_checkpoint(tmp_path, 7, commit=False, skip={1})
    with pytest.raises(FileNotFoundError, match="stage-1"):
        checkpoint.commit_checkpoint(tmp_path, 7, {"num_stages": 2})
    assert checkpoint.latest_checkpoint(tmp_path) == done
    assert not (checkpoint.step_dir(tmp_path, 7) / "meta.json").exists()


def test_prune_keeps_the_newest_committed_and_what_is_being_written(tmp_path):
    write_checkpoint(tmp_path, 0, commit=False)  # a crash's leftover
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, step)
    write_checkpoint(tmp_path, 100_000_000, commit=False)  # being written now (and past 8 digits)

    removed = checkpoint.prune(tmp_path, keep=2)

    assert sorted(p.name for p in removed) == ["step-00000000", "step-00000001", "step-00000002"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004", "step-100000000"]
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    with pytest.raises(ValueError, match="keep"):
        checkpoint.prune(tmp_path, keep=0)


def state_at(stage: int, step: int) -> bytes:
    """A state's bytes whose metadata says ``step`` optimizer steps (the only field read here)."""
    return checkpoint.state_to_bytes({"w": torch.full((2,), float(step))}, {"stage": stage, "optimizer_steps": step})


def test_a_stage_s_newest_state_is_kept_only_when_newer_and_found_beside_the_latest_checkpoint(tmp_path):
    assert checkpoint.newest_stage_file(tmp_path, 0, not_past=5) is None
    for stage in (0, 1):
        checkpoint.write_stage_file(tmp_path, 5, stage, state_at(stage, 5))
    committed = checkpoint.commit_checkpoint(tmp_path, 5, {"num_stages": 2})
    assert checkpoint.newest_stage_file(tmp_path, 0, not_past=5) == (committed / "stage-0.safetensors", 5)

    # a later checkpoint that stage 1 could not give: stage 0's state of step 9 is kept
    assert checkpoint.keep_newest_stage(tmp_path, 0, state_at(0, 9))
    assert not checkpoint.keep_newest_stage(tmp_path, 0, state_at(0, 7))  # older: the newer stays
    assert not checkpoint.keep_newest_stage(tmp_path, 0, state_at(0, 9))
    kept = tmp_path / "newest" / "stage-0.safetensors"
    assert checkpoint.newest_stage_file(tmp_path, 0, not_past=9) == (kept, 9)
    assert checkpoint.file_metadata(kept)["optimizer_steps"] == 9
    # not past the stage's step in the swarm (a run resumed from step 5 takes no stage of step 9)
    assert checkpoint.newest_stage_file(tmp_path, 0, not_past=8) == (committed / "stage-0.safetensors", 5)
    assert checkpoint.newest_stage_file(tmp_path, 0) == (committed / "stage-0.safetensors", 5)
    assert checkpoint.newest_stage_file(tmp_path, 1, not_past=9) == (committed / "stage-1.safetensors", 5)
    assert checkpoint.latest_checkpoint(tmp_path) == committed  # nothing committed meanwhile

    # a checkpoint committed later is newer than what was kept: it wins; pruning keeps newest/
    for step in (10, 11):
        for stage in (0, 1):
            checkpoint.write_stage_file(tmp_path, step, stage, state_at(stage, step))
        checkpoint.commit_checkpoint(tmp_path, step, {"num_stages": 2})
    checkpoint.prune(tmp_path, keep=1)
    assert checkpoint.newest_stage_file(tmp_path, 0, not_past=11) == (
        tmp_path / "step-00000011" / "stage-0.safetensors",
        11,
    )
    assert kept.is_file() and not list(tmp_path.rglob("*.tmp"))


# ---------------------------------------------------------------- export
def trained_stages() -> list[StageRuntime]:
    stages = [runtime(s, global_batch=2) for s in range(NUM_STAGES)]
    for rt in stages:
        train(rt, [rt.spec.index])  # one optimizer step each: not the initial weights
    return stages


def save_checkpoint(root, stages: list[StageRuntime], step: int = 1):
    for index, rt in enumerate(stages):
        checkpoint.write_stage_file(root, step, index, state_to_bytes(*stage_state(rt)))
    return checkpoint.commit_checkpoint(
        root, step, {"run_id": "r", "num_stages": len(stages), "model": "tiny", "model_config": CFG.to_dict()}
    )


def test_export_gives_the_whole_model_that_computes_the_chained_stages_loss(tmp_path):
    stages = trained_stages()
    save_checkpoint(tmp_path / "ckpt", stages)
    out = tmp_path / "model.safetensors"

    assert cli.main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)]) == 0

    assert set(safetensors.torch.load_file(out)) == set(
        dict(build_gpt(CFG, 0).named_parameters())
    )  # no optimizer state
    model = load_exported(out)
    ids, targets, _, _ = microbatch(42)
    x = ids
    for rt in stages:
        x = rt.forward("eval", 0, x, targets if rt.spec.is_last else None, keep_graph=False)
    with torch.no_grad():
        loss = model(ids, targets)
        initial = build_gpt(CFG, 0)(ids, targets)
    assert torch.allclose(loss, x, rtol=1e-6, atol=1e-6), (float(loss), float(x))
    assert not torch.allclose(loss, initial, rtol=1e-6, atol=1e-6)  # the trained weights, not a fresh model


def test_export_of_a_given_step(tmp_path):
    stages = trained_stages()
    save_checkpoint(tmp_path, stages, step=1)
    train(stages[0], [7])
    save_checkpoint(tmp_path, stages, step=2)
    out = tmp_path / "m.safetensors"
    assert export_main(["--checkpoint-dir", str(tmp_path), "--out", str(out), "--step", "1"]) == 0
    exported = safetensors.torch.load_file(out)
    first = dict(stage_state(trained_stages()[0])[0])
    assert torch.equal(exported["wte.weight"], first["wte.weight"])


def test_export_refuses_an_incomplete_checkpoint(tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path, trained_stages())
    (ckpt / "stage-2.safetensors").unlink()
    out = tmp_path / "model.safetensors"

    assert export_main(["--checkpoint-dir", str(tmp_path), "--out", str(out)]) == 2

    assert "stage 2" in capsys.readouterr().err
    assert not out.exists()


def test_export_refuses_stages_that_do_not_form_the_whole_model(tmp_path, capsys):
    stages = trained_stages()
    stages[2] = stages[1]  # the file of stage 2 holds stage 1: blocks.1 twice, blocks.2 never
    save_checkpoint(tmp_path, stages)
    assert export_main(["--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "two stages" in capsys.readouterr().err


@pytest.mark.parametrize("step", [None, 9])
def test_export_without_a_checkpoint_exits_2(tmp_path, capsys, step):
    argv = ["--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "m.safetensors")] + (
        ["--step", str(step)] if step else []
    )
    assert export_main(argv) == 2
    assert "checkpoint" in capsys.readouterr().err
