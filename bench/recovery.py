"""A stage whose every replica died, recovered three ways from one fork: ``python -m bench.recovery``.

One run on loopback, real processes (coordinator, one stage server a stage, one trainer;
the tiny preset, one block a stage on 4 stages, so that CheckFree's neighbours fit):

1. **the fork**: a swarm trains ``--fork-step`` global steps and checkpoints (``POST
   /checkpoint``);
2. **each recovery, from the fork**: a fresh swarm resumes from a copy of that checkpoint
   and trains; once stage ``--stage`` reaches ``--kill-step`` its only server is killed
   (SIGKILL) and a new one started with ``SWARM_RECOVERY`` set to the recovery, the copy of
   the checkpoint in its ``SWARM_CHECKPOINT_DIR``; the trainer goes on to ``--kill-step +
   --after`` steps. The recoveries: ``fresh`` (the initial weights, then the stage's step
   number: the catch-up as it was before ``SWARM_RECOVERY``), ``checkpoint`` (that stage
   from the fork's checkpoint, then catch-up: the steps since are lost for it),
   ``checkfree`` (the neighbours' weights averaged by their gradient norms, fresh moments,
   the learning rate warmed up again); and ``none``, the same fork with no kill, for
   reference.

Per recovery: the held-out loss at the end (``--after`` steps after the kill, the trainer's
own held-out evaluation), the training loss just before the kill (mean of 3 steps) and the
steps and seconds from the kill until the training loss (mean of 3 steps) is back under it:
the time to target. JSON to ``--out``/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path

from bench.processes import BenchProcesses, run_id
from services.stage_server.recovery import neighbour_stages

RECOVERIES = ("none", "fresh", "checkpoint", "checkfree")
BACK_WINDOW = 3  # steps of training loss averaged for "before the kill" and "back"


def get_json(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def post_json(url: str, timeout_s: float = 120.0) -> dict:
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def stage_step(coordinator: str, stage: int) -> int:
    try:
        return int(get_json(coordinator + "/swarm")["stages"][stage]["step"]["step"])
    except (OSError, KeyError, ValueError):
        return -1


class Swarm:
    """A coordinator, one server a stage and a trainer, on checkpoint dir ``ckpt``."""

    def __init__(self, procs: BenchProcesses, args, ckpt: Path):
        self.procs, self.args, self.ckpt = procs, args, ckpt
        self.common = {
            "SWARM_MODEL": "tiny",
            "SWARM_SEED": "0",
            "SWARM_WIRE_CODEC": "fp32",
            "SWARM_HEARTBEAT_S": "0.5",
            "SWARM_CHECKPOINT_DIR": str(ckpt),
        }
        _, self.coordinator = procs.coordinator(
            args.stages, {**self.common, "SWARM_CHECKPOINT_EVERY_S": "100000", "SWARM_STEP_TIMEOUT_S": "10"}
        )
        self.servers = {}
        for stage in range(args.stages):
            self.start_server(stage)
        procs.wait_healthy(self.servers)

    def server_env(self, recovery: str = "checkpoint") -> dict[str, str]:
        return {
            **self.common,
            "SWARM_COORDINATOR": self.coordinator,
            "SWARM_GLOBAL_BATCH": str(self.args.global_batch),
            "SWARM_LR": str(self.args.lr),
            "SWARM_WARMUP_STEPS": "0",
            "SWARM_RECOVERY": recovery,
            "SWARM_JOIN_TIMEOUT_S": "20",
            "SWARM_LOG_LEVEL": "info",  # where each server's state came from (stage.joined)
        }

    def start_server(self, stage: int, recovery: str = "checkpoint") -> str:
        name, url = self.procs.stage_server(stage, self.args.stages, self.server_env(recovery))
        self.servers[name] = url
        return name

    def trainer(self, start_step: int, steps: int, summary: Path):
        env = {
            **self.common,
            "SWARM_COORDINATOR": self.coordinator,
            "SWARM_NUM_STAGES": str(self.args.stages),
            "SWARM_STEPS": str(steps),
            "SWARM_START_STEP": str(start_step),
            "SWARM_MICROBATCH_SIZE": str(self.args.microbatch_size),
            "SWARM_SEQ_LEN": str(self.args.seq_len),
            "SWARM_IN_FLIGHT": "4",
            "SWARM_MAX_RETRIES": "20",
            "SWARM_STAGE_WAIT_S": "60",
            "SWARM_SUMMARY_FILE": str(summary),
        }
        return self.procs.start(f"trainer-{summary.stem}", ["services.trainer"], env)


def wait(proc, timeout_s: float, what: str) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except Exception as exc:
        raise RuntimeError(f"{what}: still running after {timeout_s:.0f} s") from exc


def fork(args, root: Path) -> tuple[Path, int]:
    """Train ``fork_step`` steps and checkpoint: (the checkpoint directory, its step)."""
    ckpt = root / "fork"
    with BenchProcesses(run_id("recovery-fork"), root / "logs-fork") as procs:
        swarm = Swarm(procs, args, ckpt)
        trainer = swarm.trainer(0, args.fork_step, root / "fork-summary.json")
        if wait(trainer, args.timeout_s, "the fork's trainer") != 0:
            raise RuntimeError(f"the fork's trainer failed; see {root / 'logs-fork'}")
        saved = post_json(swarm.coordinator + "/checkpoint")
    return ckpt, int(saved["step"])


def recover(args, root: Path, fork_dir: Path, fork_step: int, recovery: str) -> dict:
    """One branch from the fork: kill stage ``args.stage`` at ``kill_step`` and recover it."""
    ckpt = root / recovery / "checkpoints"
    shutil.rmtree(ckpt.parent, ignore_errors=True)
    shutil.copytree(fork_dir, ckpt)
    total = args.kill_step + args.after
    summary_path = root / recovery / "summary.json"
    row: dict = {"recovery": recovery}
    with BenchProcesses(run_id(f"recovery-{recovery}"), root / recovery / "logs") as procs:
        swarm = Swarm(procs, args, ckpt)
        started = time.monotonic()
        trainer = swarm.trainer(fork_step, total, summary_path)
        if recovery != "none":
            deadline = time.monotonic() + args.timeout_s
            while stage_step(swarm.coordinator, args.stage) < args.kill_step:
                if trainer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{recovery}: stage {args.stage} never reached step {args.kill_step}")
                time.sleep(0.1)
            victim = next(n for n in swarm.servers if n.startswith(f"stage{args.stage}-"))
            row["killed_at_step"] = stage_step(swarm.coordinator, args.stage)
            # the kill lands when the poll sees the step, a step late or so on a busy machine
            row["steps_after_kill"] = total - row["killed_at_step"]
            procs.kill(victim)
            del swarm.servers[victim]
            row["killed_after_s"] = round(time.monotonic() - started, 1)
            swarm.start_server(args.stage, recovery)
        if wait(trainer, args.timeout_s, f"{recovery}: the trainer") != 0:
            raise RuntimeError(f"{recovery}: the trainer failed; see {root / recovery / 'logs'}")
        view = get_json(swarm.coordinator + "/swarm")
        row["steps_lost"] = view["stages"][args.stage]["step"].get("steps_lost", [])
    summary = json.loads(summary_path.read_text())
    losses, elapsed = summary["step_losses"], summary["step_elapsed_s"]
    row["held_out_loss"] = round(summary["eval_loss_after"], 4)
    row["held_out_before"] = round(summary["eval_loss_before"], 4)
    kill = row.get("killed_at_step", args.kill_step) - fork_step  # index of the first step after the kill
    if BACK_WINDOW <= kill < len(losses):
        before = sum(losses[kill - BACK_WINDOW : kill]) / BACK_WINDOW
        row["loss_before_kill"] = round(before, 4)
        means = [sum(losses[i : i + BACK_WINDOW]) / BACK_WINDOW for i in range(len(losses) - BACK_WINDOW + 1)]
        back = next((i for i in range(kill, len(means)) if means[i] <= before), None)
        row["steps_to_target"] = None if back is None else back + BACK_WINDOW - kill
        row["seconds_to_target"] = (
            None if back is None else round(elapsed[back + BACK_WINDOW - 1] - elapsed[kill - 1], 1)
        )
        row["worst_loss_after_kill"] = round(max(losses[kill:]), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--stage", type=int, default=1, help="the stage whose every replica dies (default 1)")
    p.add_argument("--fork-step", type=int, default=30, help="steps trained before the fork's checkpoint")
    p.add_argument("--kill-step", type=int, default=45, help="the stage's step at which its server is killed")
    p.add_argument("--after", type=int, default=20, help="steps trained after the kill")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--recoveries", default=",".join(RECOVERIES))
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on each trainer's run")
    p.add_argument("--out", default="bench/results", help="directory of the JSON result (recovery.json)")
    args = p.parse_args(argv)
    if not 0 <= args.stage < args.stages or not args.fork_step < args.kill_step:
        p.error("need 0 <= --stage < --stages and --fork-step < --kill-step")
    out = Path(args.out)
    root = out / "logs" / "recovery"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    started = time.monotonic()
    fork_dir, fork_step = fork(args, root)
    neighbours = neighbour_stages(args.stage, args.stages)
    print(f"fork: checkpoint at step {fork_step}; stage {args.stage}'s neighbours: {neighbours}")
    rows = []
    for recovery in args.recoveries.split(","):
        rows.append(recover(args, root, fork_dir, fork_step, recovery))
        r = rows[-1]
        print(
            f"{recovery:<11} held-out loss {r['held_out_loss']:.4f}  before kill {r.get('loss_before_kill', '-')}  "
            f"worst after {r.get('worst_loss_after_kill', '-')}  steps to target {r.get('steps_to_target', '-')}  "
            f"seconds {r.get('seconds_to_target', '-')}  steps lost {r.get('steps_lost', [])}",
            flush=True,
        )
    record = {"bench": "recovery", "params": vars(args), "fork_step": fork_step, "rows": rows}
    record["elapsed_s"] = round(time.monotonic() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
