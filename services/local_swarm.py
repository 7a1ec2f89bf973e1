"""``swarm up``: a whole swarm on this machine, as separate processes on loopback.

Starts a coordinator, ``stages x replicas`` stage servers that register with it (logs
under ``--run-dir``), waits until each answers ``/health``, runs ``trainers`` trainers that
find the servers through the coordinator, and stops every process when the trainers are
done, on Ctrl-C or on SIGTERM. Children run in their own sessions so a Ctrl-C reaches only
this supervisor, which then stops them (SIGTERM, then SIGKILL after a grace period). mDNS
is off: everything is on loopback.

Progress (``--progress``, SWARM_PROGRESS): on a terminal, one live bar for all trainers
together, read from their metrics files, while their logs go to ``trainer.log``; otherwise
the trainers' logs on this terminal and a plain progress line every 10 steps. At the end,
``RUN_DIR/training.png`` plots loss and tokens/s against step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.plot import MetricsError, plot_metrics
from services.trainer.progress import PROGRESS_SETTINGS, MetricsFollower, ProgressDisplay, choose_display
from shared import checkpoint
from shared.codec import FLOAT_CODECS
from shared.config import CommonSettings
from shared.http import urlopen_swarm
from shared.model import PRESETS
from shared.processes import LocalProcesses, fixed_port, wait_healthy

PROGRESS_POLL_S = 0.5  # how often the trainers' metrics files are read for the progress display
PROGRESS_EVERY_STEPS = 10  # a plain progress line every this many steps (no terminal)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="swarm up", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--replicas", type=int, default=1, help="stage servers per stage (default 1)")
    p.add_argument("--trainers", type=int, default=1, help="trainers (default 1)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period of the servers (default 1 s)")
    p.add_argument(
        "--steps",
        type=int,
        default=200,
        help=(
            "global steps to train, all trainers together: each step is --global-batch samples and one AdamW step of "
            "every stage, whatever the replicas and trainers (default 200)"
        ),
    )
    p.add_argument(
        "--model",
        default="tiny",
        help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face model directory (default tiny)",
    )
    p.add_argument(
        "--tokenizer",
        default=os.environ.get("SWARM_TOKENIZER", ""),
        help=(
            "a tokenizer.json or a directory holding one (swarm tokenizer train); default: SWARM_TOKENIZER, else the "
            "model directory's, or bytes for the byte-level presets"
        ),
    )
    p.add_argument("--wire-codec", default="int8", choices=FLOAT_CODECS)
    p.add_argument(
        "--global-batch",
        type=int,
        default=32,
        help="samples of one global step, all trainers and replicas together (default 32)",
    )
    p.add_argument(
        "--sync",
        default=os.environ.get("SWARM_SYNC", "global"),
        choices=("global", "local"),
        help=(
            "'global': a stage's replicas all-reduce every step's gradient; 'local' (DiLoCo): each steps on its own "
            "samples and every --local-steps steps they average what they learned in an outer step (SWARM_OUTER_LR, "
            "SWARM_OUTER_MOMENTUM) (default: SWARM_SYNC, else global)"
        ),
    )
    p.add_argument(
        "--schedule",
        default=os.environ.get("SWARM_SCHEDULE", "sync"),
        choices=("async", "sync"),
        help=(
            "'async': the microbatches of a global step start while every stage is at most SWARM_MAX_STALENESS steps "
            "behind it; 'sync': only once every stage took the step before (the same model as one process) "
            "(default: SWARM_SCHEDULE, else sync)"
        ),
    )
    p.add_argument(
        "--local-steps",
        type=int,
        default=os.environ.get("SWARM_LOCAL_STEPS", "10"),
        help="--sync local: global steps between outer steps (default: SWARM_LOCAL_STEPS, else 10)",
    )
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--in-flight", type=int, default=4, help="microbatches in flight (default 4)")
    p.add_argument(
        "--routing",
        default=os.environ.get("SWARM_ROUTING", "chain"),
        choices=("chain", "relay"),
        help=(
            "'chain': the stage servers pass activations and gradients to each other, the trainers send token ids; "
            "'relay': the trainers carry every tensor between stages (default: SWARM_ROUTING, else chain)"
        ),
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--lora-rank",
        type=int,
        default=int(os.environ.get("SWARM_LORA_RANK", "0")),
        help=(
            "fine-tune with LoRA adapters of this rank on the frozen --model (0: train every weight); more in "
            "SWARM_LORA_ALPHA, SWARM_LORA_DROPOUT, SWARM_LORA_BASE_DTYPE (default: SWARM_LORA_RANK, else 0)"
        ),
    )
    p.add_argument(
        "--lora-target-modules",
        default=os.environ.get("SWARM_LORA_TARGET_MODULES", "all-linear"),
        help=(
            "--lora-rank: Hugging Face module names the adapters go on, comma-separated (e.g. q_proj,v_proj), or "
            "all-linear (default: SWARM_LORA_TARGET_MODULES, else all-linear)"
        ),
    )
    p.add_argument(
        "--corpus",
        default="",
        help="text file, JSONL, Parquet or a directory of them to train on (default: bundled Shakespeare)",
    )
    p.add_argument("--run-dir", default="", help="logs and metrics go here (default runs/<time>)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ready-timeout-s", type=float, default=120.0)
    p.add_argument("--checkpoint-every-s", type=float, default=30.0, help="seconds between checkpoints (default 30)")
    p.add_argument(
        "--average-every-s",
        type=float,
        default=5.0,
        help="seconds between averaging rounds of a stage's replicas (default 5)",
    )
    p.add_argument(
        "--rebalance-every-s",
        type=float,
        default=10.0,
        help="seconds between rebalancing checks; 0: never (default 10)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument(
        "--generate",
        default="",
        metavar="PROMPT",
        help=(
            "after training, continue PROMPT through the live swarm "
            "(greedy, --generate-tokens tokens) and print the text"
        ),
    )
    p.add_argument("--generate-tokens", type=int, default=64, help="tokens --generate generates (default 64)")
    p.add_argument(
        "--serve",
        action="store_true",
        help=(
            "after training, keep the coordinator and the stage servers up until Ctrl-C: swarm generate, the "
            "dashboard's prompt box and /v1/completions use the trained model"
        ),
    )
    p.add_argument(
        "--progress",
        default=os.environ.get("SWARM_PROGRESS", "auto"),
        help=(
            "'bar' (live, even into a pipe), 'off', or 'auto': a bar on a terminal, else a plain line every 10 steps "
            "(default: SWARM_PROGRESS, else auto)"
        ),
    )
    args = p.parse_args(argv)
    if args.local_steps < 1:
        p.error(f"--local-steps must be >= 1, got {args.local_steps}")
    if args.progress not in PROGRESS_SETTINGS:
        p.error(f"--progress (SWARM_PROGRESS) must be one of {', '.join(PROGRESS_SETTINGS)}, got {args.progress!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.resume and not args.run_dir:
        print("swarm up: --resume needs --run-dir of the run to continue", file=sys.stderr)
        return 2
    try:
        check_model_and_data(args)
    except ValueError as exc:  # before any process starts, so no server registers
        print(f"swarm up: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    start_step = 0
    if args.resume:
        ckpt = checkpoint.latest_checkpoint(run_dir / "checkpoints")
        if ckpt is None:
            print(f"swarm up: --resume: no checkpoint in {run_dir / 'checkpoints'}", file=sys.stderr)
            return 2
        start_step = checkpoint.read_meta(ckpt)["step"]
        print(f"swarm up: resuming {run_dir.name} from {ckpt} (step {start_step})", flush=True)
    # the registry of an earlier session lists servers that are gone: start it afresh
    (run_dir / "coordinator.sqlite").unlink(missing_ok=True)
    common = {
        "SWARM_RUN_ID": run_dir.name,
        "SWARM_NUM_STAGES": str(args.stages),
        "SWARM_MODEL": args.model if args.model in PRESETS else str(Path(args.model).resolve()),
        "SWARM_WIRE_CODEC": args.wire_codec,
        "SWARM_MDNS": "false",
        "SWARM_HEARTBEAT_S": str(args.heartbeat_s),
        "SWARM_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
        "SWARM_SCHEDULE": args.schedule,
    }
    procs = LocalProcesses(run_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Ctrl-C stops the swarm even when started from a context that ignores SIGINT (a
    # background job of a non-interactive shell), where Python would leave it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        coordinator = start_coordinator(procs, args, run_dir, common)
        common["SWARM_COORDINATOR"] = coordinator
        servers = start_servers(procs, args, common)
        for name, url in servers.items():
            try:
                wait_healthy(url, procs.procs[name], args.ready_timeout_s)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}{_last_error(run_dir / f'{name}.log')}") from None
        print(
            (
                f"swarm up: coordinator {coordinator}, {args.stages} stages x {args.replicas} replicas healthy; logs "
                f"in {run_dir}/"
            ),
            flush=True,
        )
        print(f"swarm up: live dashboard at {coordinator}/ ; metrics at {coordinator}/metrics", flush=True)
        display = choose_display(args.progress, sys.stderr, log_format=os.environ.get("SWARM_LOG_FORMAT", "console"))
        follower = MetricsFollower(
            [run_dir / f"metrics{s}.jsonl" for s in trainer_suffixes(args.trainers)], start_step=start_step
        )
        trainers = start_trainers(
            procs, args, run_dir, {**common, "SWARM_START_STEP": str(start_step)}, logs_to_file=display == "bar"
        )
        status = watch_trainers(
            trainers,
            follower,
            ProgressDisplay(
                display, args.steps, stream=sys.stderr, initial_steps=start_step, every_steps=PROGRESS_EVERY_STEPS
            ),
        )
        if display == "bar":
            report_trainers(trainers, run_dir)
        save_checkpoint(coordinator)
        write_plot(run_dir)
        if args.generate and status == 0:
            status = generate_text(coordinator, args)
        if args.serve:
            serve(coordinator, procs)
        return status
    except KeyboardInterrupt:
        print("\nswarm up: interrupted, stopping every process", file=sys.stderr, flush=True)
        return 130
    except RuntimeError as exc:
        print(f"swarm up: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()


def check_model_and_data(args: argparse.Namespace) -> None:
    """What would otherwise fail in every child, checked once before any starts: the model (a
    preset, or a directory with every weight file), its cut, the tokenizer against its
    vocabulary, and the corpus, tokenized here into the cache the trainers then reuse.
    ValueError naming the file or the setting."""
    from services.trainer.data import make_batcher
    from shared.config import TrainerSettings
    from shared.hf import check_hf_dir
    from shared.model import partition

    settings = TrainerSettings(
        model=args.model,
        num_stages=args.stages,
        tokenizer=args.tokenizer,
        corpus=args.corpus,
        seq_len=args.seq_len,
        microbatch_size=args.microbatch_size,
        num_shards=args.trainers,
    )
    cfg = check_hf_dir(args.model) if args.model not in PRESETS else settings.gpt_config()
    partition(cfg, args.stages)
    if args.lora_rank:
        from shared.lora import LoraConfig, target_modules

        targets = LoraConfig.parse_targets(args.lora_target_modules)
        target_modules(cfg, LoraConfig(args.lora_rank, target_modules=targets))  # LoraError (a ValueError) says why
    if args.seq_len > cfg.block_size:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's block_size {cfg.block_size}")
    make_batcher(settings, cfg)


def generate_text(coordinator: str, args: argparse.Namespace) -> int:
    """``swarm generate`` through the swarm just trained: the prompt, then its continuation."""
    from services.generate import parse_args as generate_args
    from services.generate import run as generate

    print(f"swarm up: generating {args.generate_tokens} tokens through the swarm (greedy):", flush=True)
    argv = [
        "--coordinator",
        coordinator,
        "--max-tokens",
        str(args.generate_tokens),
        *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
        args.generate,
    ]
    sys.stdout.write(args.generate)
    return asyncio.run(generate(generate_args(argv)))


def serve(coordinator: str, procs: LocalProcesses) -> None:
    """Keep the swarm up until Ctrl-C (or until the coordinator exits)."""
    print(
        f'swarm up: serving the trained model until Ctrl-C: swarm generate --coordinator {coordinator} "ROMEO:"; '
        f"the prompt box of {coordinator}/ ; POST {coordinator}/v1/completions",
        flush=True,
    )
    procs.procs["coordinator"].wait()


def start_coordinator(procs: LocalProcesses, args: argparse.Namespace, run_dir: Path, common: dict) -> str:
    port = fixed_port(args.host)
    env = {
        **common,
        "SWARM_TOKENIZER": str(Path(args.tokenizer).resolve()) if args.tokenizer else "",
        "SWARM_HOST": args.host,
        "SWARM_PORT": str(port),
        "SWARM_STATE_DB": str(run_dir / "coordinator.sqlite"),
        "SWARM_CHECKPOINT_EVERY_S": str(args.checkpoint_every_s),
        "SWARM_AVERAGE_EVERY_S": str(args.average_every_s),
        "SWARM_REBALANCE_EVERY_S": str(args.rebalance_every_s),
    }
    proc = procs.start("coordinator", ["services.coordinator"], env)
    url = f"{_scheme()}://{args.host}:{port}"
    wait_healthy(url, proc, args.ready_timeout_s)
    return url


def _security() -> CommonSettings:
    """The swarm secret and TLS files the children get from this environment
    (SWARM_SECRET or SWARM_SECRET_FILE, SWARM_TLS_*): this supervisor signs and trusts alike."""
    return CommonSettings()


def _scheme() -> str:
    return "https" if _security().tls else "http"


def save_checkpoint(coordinator: str) -> None:
    """Ask the coordinator for a checkpoint of the run as it is now (the end of training)."""
    try:
        with urlopen_swarm(
            _security(),
            coordinator + "/checkpoint",
            data=b"{}",
            method="POST",
            content_type="application/json",
            timeout_s=120,
        ) as resp:
            saved = json.loads(resp.read())
        print(f"swarm up: checkpoint of step {saved['step']} in {saved['path']}", flush=True)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"swarm up: final checkpoint failed: {exc}", file=sys.stderr, flush=True)


def _last_error(log: Path) -> str:
    """``: <the exception that stopped a process> (log: PATH)``, from the end of its log, or ''."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return ""
    errors = [line.strip() for line in lines if re.match(r"^[\w.]+(Error|Exception|Stage): ", line.strip())]
    return f": {errors[-1]} (log: {log})" if errors else f" (log: {log})"


def start_servers(procs: LocalProcesses, args: argparse.Namespace, common: dict) -> dict[str, str]:
    """``stages x replicas`` stage servers; returns their URLs by process name."""
    servers = {}
    for stage in range(args.stages):
        for replica in range(args.replicas):
            port = fixed_port(args.host)
            env = {
                **common,
                "SWARM_STAGE": str(stage),
                "SWARM_PORT": str(port),
                "SWARM_HOST": args.host,
                "SWARM_LR": str(args.lr),
                "SWARM_GLOBAL_BATCH": str(args.global_batch),
                "SWARM_SYNC": args.sync,
                "SWARM_LOCAL_STEPS": str(args.local_steps),
                "SWARM_LORA_RANK": str(args.lora_rank),
                "SWARM_LORA_TARGET_MODULES": args.lora_target_modules,
            }
            name = f"stage{stage}-{replica}"
            procs.start(name, ["services.stage_server"], env)
            servers[name] = f"{_scheme()}://{args.host}:{port}"
    return servers


def trainer_suffixes(trainers: int) -> list[str]:
    """What each trainer's file names end with: nothing for one trainer, ``-0``, ``-1``, ... for several."""
    return [""] if trainers == 1 else [f"-{t}" for t in range(trainers)]


def start_trainers(
    procs: LocalProcesses, args: argparse.Namespace, run_dir: Path, common: dict, *, logs_to_file: bool = False
) -> list:
    trainers = []
    for t, suffix in enumerate(trainer_suffixes(args.trainers)):
        env = {
            **common,
            "SWARM_SHARD_INDEX": str(t),  # the trainers share one sequence of microbatches
            "SWARM_NUM_SHARDS": str(args.trainers),
            "SWARM_STEPS": str(args.steps),
            "SWARM_MICROBATCH_SIZE": str(args.microbatch_size),
            "SWARM_SEQ_LEN": str(args.seq_len),
            "SWARM_IN_FLIGHT": str(args.in_flight),
            "SWARM_ROUTING": args.routing,
            "SWARM_CORPUS": args.corpus,
            "SWARM_TOKENIZER": args.tokenizer,
            "SWARM_METRICS_FILE": str(run_dir / f"metrics{suffix}.jsonl"),
            "SWARM_SUMMARY_FILE": str(run_dir / f"summary{suffix}.json"),
            "SWARM_METRICS_PORT": str(fixed_port(args.host)),  # each trainer's Prometheus /metrics
            "SWARM_PROGRESS": "off",  # this supervisor shows the progress of all trainers
        }
        trainers.append(procs.start(f"trainer{suffix}", ["services.trainer"], env, log_to_file=logs_to_file))
    return trainers


def watch_trainers(trainers: list[subprocess.Popen], follower: MetricsFollower, display: ProgressDisplay) -> int:
    """Wait until every trainer has exited, showing their progress as their metrics files
    grow (read every PROGRESS_POLL_S); returns their worst exit status."""
    with display:
        while True:
            follower.poll()
            display.show(*follower.totals())
            running = [t for t in trainers if t.poll() is None]
            if not running:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                running[0].wait(timeout=PROGRESS_POLL_S)
    return max(t.returncode for t in trainers)


def stage_mfu(stages: list[dict]) -> str:
    """Each stage's MFU over the run, busy / wall, from a trainer's summary, and the peaks' sources."""

    def percent(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.3g}%"

    shown = "; ".join(f"{s['stage']}: {percent(s['mfu_busy'])} / {percent(s['mfu_wall'])}" for s in stages)
    peaks = sorted({p for s in stages for p in s["peaks"]})
    return f"MFU per stage (busy / wall) {shown} (peak: {'; '.join(peaks)})"


def report_trainers(trainers: list[subprocess.Popen], run_dir: Path) -> None:
    """One line per trainer from its summary file: with the bar on, their own output went to their logs."""
    for suffix, proc in zip(trainer_suffixes(len(trainers)), trainers):
        summary_file = run_dir / f"summary{suffix}.json"
        if summary_file.exists():
            s = json.loads(summary_file.read_text())
            print(
                f"swarm up: trainer{suffix}: {s['steps']} steps, "
                f"{s['microbatches_completed']}/{s['microbatches_scheduled']} microbatches, {s['tokens_per_s']:,.0f} "
                f"tokens/s, held-out loss {s['eval_loss_before']:.3f} -> {s['eval_loss_after']:.3f} ({summary_file})",
                flush=True,
            )
            if s.get("stages"):
                print(f"swarm up: trainer{suffix}: {stage_mfu(s['stages'])}", flush=True)
            lost = [x for x in s.get("swarm_losses", []) if x["steps_lost_total"] or x["samples_dropped"]]
            if lost:
                print(
                    f"swarm up: trainer{suffix}: lost "
                    + "; ".join(
                        f"stage {x['stage']}: {x['steps_lost_total']} steps, {x['samples_dropped']} samples dropped"
                        for x in lost
                    ),
                    flush=True,
                )
        if proc.returncode:
            print(
                (
                    f"swarm up: trainer{suffix} exited with status {proc.returncode}: see "
                    f"{run_dir / f'trainer{suffix}.log'}"
                ),
                file=sys.stderr,
                flush=True,
            )


def write_plot(run_dir: Path) -> None:
    """RUN_DIR/training.png: loss and tokens/s against step, from the trainers' metrics files."""
    try:
        out = plot_metrics(run_dir, run_dir / "training.png")
    except (MetricsError, OSError) as exc:
        print(f"swarm up: no plot of the run: {exc}", file=sys.stderr, flush=True)
        return
    print(f"swarm up: loss and tokens/s against step in {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
