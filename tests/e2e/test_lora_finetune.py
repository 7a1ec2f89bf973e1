"""LoRA fine-tuning of a Hugging Face Llama through a 2-stage x 2-replica swarm, as a user
runs it: `swarm up --model DIR --lora-rank 8` (default targets: every linear layer of the
blocks), `swarm export --format peft`, then `peft` in a fresh process that knows nothing of
this project loads the adapters onto the original model, every adapter key matched, and
computes the swarm's held-out loss; `--merge` loaded by `transformers` alone gives the same
loss; an export onto another base model (same config, other weights), and a resume on it,
are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from services.trainer.data import make_batcher
from shared.config import TrainerSettings
from tests.e2e.conftest import SWARM, processes_of_run

pytestmark = pytest.mark.e2e

STEPS, SEQ_LEN = 30, 32
EVAL_MICROBATCHES = 4  # the trainer's held-out microbatches (Trainer.eval_microbatches)


def run(args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env})


def test_lora_through_the_swarm_exports_adapters_that_peft_loads_with_the_swarms_loss(tmp_path):
    from tests.hf_models import llama_config, save_model_dir

    model = save_model_dir(tmp_path / "base", llama_config())
    env = {"SWARM_TOKEN_CACHE_DIR": str(tmp_path / "tokens")}
    run_dir = tmp_path / f"e2e-lora-{os.getpid()}"
    up = run(
        [
            *SWARM,
            "up",
            "--model",
            str(model),
            "--lora-rank",
            "8",
            "--stages",
            "2",
            "--replicas",
            "2",
            "--steps",
            str(STEPS),
            "--lr",
            "1e-2",
            "--wire-codec",
            "fp32",
            "--seq-len",
            str(SEQ_LEN),
            "--run-dir",
            str(run_dir),
        ],
        env,
        400,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    assert processes_of_run(run_dir.name) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["microbatches_failed"] == 0
    # held-out loss falls (measured 6.02 -> 4.89 in 30 steps)
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.3, summary

    ckpt = ["--checkpoint-dir", str(run_dir / "checkpoints")]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    export = run([*SWARM, "export", *ckpt, "--format", "peft", "--out", str(adapter)], env, 120)
    assert export.returncode == 0, export.stderr
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    merge = run([*SWARM, "export", *ckpt, "--format", "peft", "--merge", "--out", str(merged)], env, 120)
    assert merge.returncode == 0, merge.stderr

    # onto another base (same config, other weights) or as a whole model: refused, saying why
    other = save_model_dir(tmp_path / "other", llama_config(), seed=1)
    refused = run(
        [*SWARM, "export", *ckpt, "--format", "peft", "--model", str(other), "--out", str(tmp_path / "x")], env, 120
    )
    assert refused.returncode == 2 and "not those the adapters were trained on" in refused.stderr, refused.stderr
    whole = run([*SWARM, "export", *ckpt, "--format", "hf", "--out", str(tmp_path / "y")], env, 120)
    assert whole.returncode == 2 and "--format peft" in whole.stderr, whole.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()

    # the swarm's held-out microbatches, as its trainer drew them
    settings = TrainerSettings(model=str(model), token_cache_dir=env["SWARM_TOKEN_CACHE_DIR"], seq_len=SEQ_LEN)
    batcher = make_batcher(settings, settings.gpt_config())
    batches = [batcher.microbatch(i, split="eval") for i in range(EVAL_MICROBATCHES)]
    torch.save(
        {"inputs": [mb.inputs for mb in batches], "targets": [mb.targets for mb in batches]}, tmp_path / "eval.pt"
    )

    # a fresh process that knows nothing of this project: transformers and peft alone
    script = textwrap.dedent(f"""
        import json, torch, transformers, peft, safetensors.torch
        data = torch.load({str(tmp_path / "eval.pt")!r})

        def loss(model):
            with torch.no_grad():
                losses = [
                    torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
                    for x, y in zip(data["inputs"], data["targets"])
                ]
            return sum(losses) / len(losses)

        base = transformers.AutoModelForCausalLM.from_pretrained({str(model)!r}, dtype=torch.float32)
        tuned = peft.PeftModel.from_pretrained(base, {str(adapter)!r}).eval()
        written = safetensors.torch.load_file({str(adapter / "adapter_model.safetensors")!r})
        loaded = peft.get_peft_model_state_dict(tuned)
        merged = transformers.AutoModelForCausalLM.from_pretrained({str(merged)!r}, dtype=torch.float32).eval()
        print(json.dumps({{
            "written": sorted(written),
            "loaded": sorted(loaded),
            "equal": all(torch.equal(written[k], loaded[k]) for k in written if k in loaded),
            "adapters_in_model": sum(1 for n, _ in tuned.named_parameters() if ".lora_" in n),
            "peft_loss": loss(tuned),
            "merged_loss": loss(merged),
        }}))
    """)
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    result = json.loads(fresh.stdout.strip().splitlines()[-1])
    # every adapter of every stage, all-linear on 4 layers: 7 modules x 2 matrices each, each matched
    assert len(result["written"]) == 4 * 7 * 2 == result["adapters_in_model"]
    assert result["loaded"] == result["written"] and result["equal"]
    assert result["peft_loss"] == pytest.approx(summary["eval_loss_after"], abs=1e-4)
    assert result["merged_loss"] == pytest.approx(result["peft_loss"], abs=1e-5)

    # resuming the run on the other base: its servers refuse the checkpoint's adapters, and say why
    resumed = run(
        [
            *SWARM,
            "up",
            "--resume",
            "--model",
            str(other),
            "--lora-rank",
            "8",
            "--stages",
            "2",
            "--steps",
            str(STEPS + 10),
            "--seq-len",
            str(SEQ_LEN),
            "--run-dir",
            str(run_dir),
        ],
        env,
        300,
    )
    assert resumed.returncode != 0 and "adapters trained on another base model" in resumed.stderr, resumed.stderr
    assert processes_of_run(run_dir.name) == []
