"""lm-evaluation-harness against the live swarm and against its export, in real processes.

A GPT-2-shaped model of 256 byte tokens (a random Hugging Face directory with the byte
tokenizer of `swarm tokenizer bytes`) trains 30 steps in `swarm up --serve`, which then
keeps its coordinator and two stage servers up; `swarm export --format hf` writes the same
run's last checkpoint. A multiple-choice task made here (a task YAML and a JSONL file;
nothing from a hub) is scored two ways at once, each `lm_eval` in its own process:

- `--model local-completions` against the coordinator's /v1/completions with lm-eval's
  defaults (token-id prompts, echo, logprobs 1, max_tokens 1; the swarm's own tokenizer
  through /tokenize, which lm-eval finds by itself), four requests to a batch;
- `--model hf` on the export in one process.

Every request's log-likelihood agrees within 1e-3 and its is_greedy flag is the same;
each question's answer (the likeliest choice) is the same unless its two likeliest choices
are closer than that. (Text prompts, lists of them and the tokenizer endpoints are checked
in tests/service/test_completion_scoring.py; the exported byte tokenizer against the
swarm's in tests/unit/test_tokenizer.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import SWARM, processes_of_run, stop_swarm_up, wait_until

pytestmark = pytest.mark.e2e

LM_EVAL = Path(sys.executable).with_name("lm_eval")
STEPS = 30
TOLERANCE = 1e-3
START_S = 180  # the swarm: three children import torch on 2 cores, then train
EVAL_S = 240
TASK = "swarm_mc"
QUESTIONS = [  # (context, choices, answer); the task puts a space between context and choice
    ("ROMEO: But soft, what light through yonder window", ["breaks?", "falls?", "runs?", "grows?"], 0),
    ("To be, or not to be, that is the", ["question:", "answer:", "problem:", "moment:"], 0),
    ("Now is the winter of our", ["discontent", "happiness", "kingdom", "summer"], 0),
    ("Friends, Romans, countrymen, lend me your", ["ears;", "hands;", "swords;", "horses;"], 0),
    ("All the world's a", ["stage,", "table,", "garden,", "river,"], 0),
    ("A horse! a horse! my kingdom for a", ["horse!", "crown!", "sword!", "cup!"], 0),
    ("What's in a name? That which we call a", ["rose", "tree", "king", "fool"], 0),
    ("The quality of mercy is not", ["strain'd", "known", "given", "sold"], 0),
    ("If music be the food of love, play", ["on", "off", "out", "up"], 0),
    ("Double, double toil and", ["trouble", "bubble", "rubble", "stubble"], 0),
    ("KING HENRY V:\nOnce more unto the", ["breach", "beach", "bench", "branch"], 0),
    ("Good night, good night! parting is such sweet", ["sorrow", "sugar", "silver", "summer"], 0),
]


def write_task(root: Path) -> Path:
    """A multiple-choice task of QUESTIONS: ``root/tasks/swarm_mc.yaml`` reading ``root/swarm_mc.jsonl``."""
    data = root / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tasks


def start_lm_eval(name: str, model: str, model_args: str, tasks: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SWARM_")},
        "HF_HUB_OFFLINE": "1",  # nothing from a hub: the task's data is the JSONL file written here
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(out / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    args = [str(LM_EVAL), "--model", model, "--model_args", model_args, "--tasks", TASK, "--include_path", str(tasks)]
    args += ["--log_samples", "--output_path", str(out / name), *extra]
    log = open(out / f"{name}.log", "wb")
    try:
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out)
    finally:
        log.close()


def samples(out: Path, name: str) -> dict[int, dict]:
    """doc_id -> {"loglikelihoods": [per choice], "greedy": [per choice], "acc"} of one lm_eval run."""
    (path,) = (out / name).glob(f"*/samples_{TASK}_*.jsonl")
    docs = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        docs[record["doc_id"]] = {
            "loglikelihoods": [float(ll) for ll, _ in record["filtered_resps"]],
            "greedy": [flag == "True" for _, flag in record["filtered_resps"]],
            "acc": record["acc"],
        }
    return docs


def assert_agree(got: dict[int, dict], reference: dict[int, dict], what: str) -> None:
    assert sorted(got) == sorted(reference) == list(range(len(QUESTIONS))), what
    for doc, ref in reference.items():
        lls, ref_lls = got[doc]["loglikelihoods"], ref["loglikelihoods"]
        assert lls == pytest.approx(ref_lls, abs=TOLERANCE), (what, doc)
        assert got[doc]["greedy"] == ref["greedy"], (what, doc)
        first, second = sorted(ref_lls, reverse=True)[:2]
        assert got[doc]["acc"] == ref["acc"] or first - second < TOLERANCE, (what, doc, lls, ref_lls)


def test_lm_eval_scores_the_live_swarm_as_it_scores_the_same_runs_export(tmp_path):
    assert LM_EVAL.exists(), f"lm-eval is not installed ({LM_EVAL}): pip install -e '.[eval]' (make test does)"
    from tests.hf_models import gpt2_config, save_model_dir

    model_dir = save_model_dir(tmp_path / "model", gpt2_config(vocab_size=256), tokenizer=False)
    made = subprocess.run(
        [*SWARM, "tokenizer", "bytes", "--out", str(model_dir)], capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    tasks = write_task(tmp_path)

    run_dir = tmp_path / f"e2e-lm-eval-{os.getpid()}"
    up_log = tmp_path / "up.out"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}}
    env["SWARM_TOKEN_CACHE_DIR"] = str(tmp_path / "tokens")
    args = [*SWARM, "up", "--model", str(model_dir), "--stages", "2", "--steps", str(STEPS), "--seq-len", "64"]
    args += ["--wire-codec", "fp32", "--run-dir", str(run_dir), "--serve"]
    with open(up_log, "wb") as log:
        up = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    evals: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        wait_until(
            lambda: up.poll() is not None or "serving the trained model" in up_log.read_text(),
            START_S,
            "swarm up to train and serve",
            poll_s=0.2,
        )
        assert up.poll() is None, up_log.read_text()[-3000:]
        coordinator = re.search(r"coordinator (http://127\.0\.0\.1:\d+)", up_log.read_text()).group(1)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["eval_loss_after"] < summary["eval_loss_before"] - 0.5

        export = tmp_path / "export"
        exported = subprocess.run(
            [*SWARM, "export", "--checkpoint-dir", str(run_dir / "checkpoints"), "--format", "hf"]
            + ["--out", str(export), "--tokenizer", str(model_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert exported.returncode == 0, exported.stderr
        base = f"model={run_dir.name},base_url={coordinator}/v1/completions"
        evals = [
            start_lm_eval("swarm", "local-completions", base, tasks, tmp_path, "--batch_size", "4"),
            start_lm_eval("hf", "hf", f"pretrained={export},dtype=float32", tasks, tmp_path, "--device", "cpu"),
        ]
        for proc in evals:
            proc.wait(timeout=EVAL_S)
        for name, proc in zip(("swarm", "hf"), evals):
            assert proc.returncode == 0, (name, (tmp_path / f"{name}.log").read_text()[-4000:])
    finally:
        for proc in evals:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stop_swarm_up(up)
    print(f"lm-eval e2e: swarm up, served, and both lm_eval runs in {time.monotonic() - started:.1f} s")
    assert processes_of_run(run_dir.name) == []

    assert_agree(samples(tmp_path, "swarm"), samples(tmp_path, "hf"), "local-completions against hf")
    scored = [line for line in (run_dir / "coordinator.log").read_text().splitlines() if "completion.scored" in line]
    requests = sum(len(choices) for _, choices, _ in QUESTIONS)  # one per choice
    assert len(scored) == requests // 4 and all("prompts=4 " in line for line in scored)  # in batches of 4
    assert all(f"weights_steps=[{STEPS}]" in line for line in scored)  # the trained weights, one version
