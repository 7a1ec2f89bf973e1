"""A Llama trained from scratch by `swarm up` with a BPE tokenizer trained on the bundled
corpus, exported with `swarm export --format hf`, and loaded by `transformers` in a fresh
process: the same held-out loss as the swarm computed at the end of its run, and the
tokenizer round-trips text. Bad model directories and tokenizers stop `swarm up` before any
process starts, naming the file or the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.trainer.data import make_batcher
from shared.config import TrainerSettings
from tests.e2e.conftest import SWARM, processes_of_run

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")

STEPS = 30
EVAL_MICROBATCHES = 4  # the trainer's held-out microbatches (Trainer.eval_microbatches)
TEXT = "Now is the winter of our discontent\nMade glorious summer by this sun of York."


def run(args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env})


def test_a_llama_from_scratch_trains_exports_to_hugging_face_and_loads_with_the_swarms_loss(tmp_path):
    env = {"SWARM_TOKEN_CACHE_DIR": str(tmp_path / "tokens")}
    tok = tmp_path / "tok"
    trained = run([*SWARM, "tokenizer", "train", "--model", "llama-tiny", "--out", str(tok)], env, 300)
    assert trained.returncode == 0, trained.stderr
    assert "2048 tokens" in trained.stdout

    run_dir = tmp_path / f"e2e-llama-{os.getpid()}"
    up = run(
        [
            *SWARM,
            "up",
            "--model",
            "llama-tiny",
            "--tokenizer",
            str(tok),
            "--stages",
            "4",
            "--steps",
            str(STEPS),
            "--wire-codec",
            "fp32",
            "--seq-len",
            "64",
            "--run-dir",
            str(run_dir),
        ],
        env,
        500,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    assert processes_of_run(run_dir.name) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["microbatches_failed"] == 0
    assert summary["eval_loss_before"] > 7.0  # about ln(2048): untrained
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 1.0, (
        summary
    )  # it learns (measured: 7.62 -> 6.15 in 30 steps)

    out = tmp_path / "hf"
    export = run(
        [
            *SWARM,
            "export",
            "--checkpoint-dir",
            str(run_dir / "checkpoints"),
            "--format",
            "hf",
            "--out",
            str(out),
            "--tokenizer",
            str(tok),
        ],
        env,
        120,
    )
    assert export.returncode == 0, export.stderr
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= {p.name for p in out.iterdir()}

    # the swarm's held-out microbatches, as its trainer drew them
    settings = TrainerSettings(
        model="llama-tiny", tokenizer=str(tok), token_cache_dir=env["SWARM_TOKEN_CACHE_DIR"], seq_len=64
    )
    batcher = make_batcher(settings, settings.gpt_config())
    batches = [batcher.microbatch(i, split="eval") for i in range(EVAL_MICROBATCHES)]
    torch.save(
        {"inputs": [mb.inputs for mb in batches], "targets": [mb.targets for mb in batches]}, tmp_path / "eval.pt"
    )

    # a fresh process that knows nothing of this project: transformers alone
    script = textwrap.dedent(f"""
        import json, torch, transformers
        model = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained({str(out)!r})
        data = torch.load({str(tmp_path / "eval.pt")!r})
        with torch.no_grad():
            losses = [
                torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
                for x, y in zip(data["inputs"], data["targets"])
            ]
        ids = tok({TEXT!r}, add_special_tokens=False)["input_ids"]
        print(json.dumps({{
            "loss": sum(losses) / len(losses),
            "arch": type(model).__name__,
            "text": tok.decode(ids),
            "eos": tok.eos_token_id,
        }}))
    """)
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    result = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert result["arch"] == "LlamaForCausalLM"
    assert result["loss"] == pytest.approx(summary["eval_loss_after"], rel=1e-4)  # the summary rounds to 4 decimals
    assert result["text"] == TEXT and result["eos"] == 0


def _model_dir(path: Path, *, arch: str = "LlamaForCausalLM", shards: bool = False) -> Path:
    """A tiny random Llama saved by transformers (sharded: two files and an index)."""
    from tests.hf_models import llama_config, save_model_dir

    save_model_dir(path, llama_config(), max_shard_size="100KB" if shards else None)
    if arch != "LlamaForCausalLM":
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "architectures": [arch], "model_type": "falcon"}))
    return path


@pytest.mark.parametrize("case", ["missing shard", "unsupported architecture", "tokenizer too large"])
def test_bad_model_or_tokenizer_stops_swarm_up_before_any_process_starts(case, tmp_path):
    model = _model_dir(
        tmp_path / "model",
        arch="FalconForCausalLM" if case == "unsupported architecture" else "LlamaForCausalLM",
        shards=case == "missing shard",
    )
    args, named = ["--model", str(model)], ""
    if case == "missing shard":
        index = json.loads((model / "model.safetensors.index.json").read_text())
        victim = sorted(set(index["weight_map"].values()))[-1]
        (model / victim).unlink()
        named = victim
    elif case == "unsupported architecture":
        named = "FalconForCausalLM"
    else:  # a tokenizer of more tokens than the model's 320
        from shared.tokenizer import train_bpe
        from tests.hf_models import TEXT as CORPUS

        train_bpe([CORPUS, CORPUS.upper(), CORPUS.lower()], 400, tmp_path / "big-tok")
        args += ["--tokenizer", str(tmp_path / "big-tok")]
        named = "SWARM_TOKENIZER"
    run_dir = tmp_path / f"e2e-bad-{os.getpid()}"
    up = run(
        [*SWARM, "up", *args, "--stages", "2", "--steps", "2", "--seq-len", "32", "--run-dir", str(run_dir)],
        {"SWARM_TOKEN_CACHE_DIR": str(tmp_path / "tokens")},
        120,
    )
    assert up.returncode == 2, (up.stdout[-2000:], up.stderr[-2000:])
    assert named in up.stderr, up.stderr
    assert "Traceback" not in up.stderr
    assert not (run_dir / "coordinator.log").exists()  # nothing was started
    assert processes_of_run(run_dir.name) == []
