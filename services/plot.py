"""``swarm plot``: loss and tokens/s against step, from a run's metrics, as a PNG.

Reads a trainer's metrics file (one JSON object per step: ``step``, ``loss``,
``tokens_per_s``, ...) or a run directory (each ``metrics*.jsonl`` in it: one per trainer)
and draws two panels that share the step axis, one line per trainer.
Exit status: 0 written, 2 no usable metrics (missing, empty or malformed: the message says which).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


class MetricsError(ValueError):
    """Metrics that cannot be plotted; the message names the file (and line) at fault."""


def metrics_files(source: Path) -> list[Path]:
    """The metrics files of ``source``: the file itself, or each ``metrics*.jsonl`` of a run directory."""
    if source.is_dir():
        files = sorted(source.glob("metrics*.jsonl"))
        if not files:
            raise MetricsError(f"{source} holds no metrics*.jsonl file")
        return files
    if not source.is_file():
        raise MetricsError(f"{source} does not exist")
    return [source]


def read_metrics(path: Path) -> list[dict]:
    """The records of one metrics file, in step order. A step that goes back (a rerun in the
    same directory, or a resume from an earlier checkpoint) replaces the records from that
    step on. A last line without its newline that does not parse is still being written: left out."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    records: list[dict] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = _parse_record(line)
        except ValueError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise MetricsError(f"{path}:{number}: not a metrics record ({exc})") from None
        while records and records[-1]["step"] >= record["step"]:
            records.pop()
        records.append(record)
    if not records:
        raise MetricsError(f"{path} is empty: no step recorded")
    return records


def _parse_record(line: str) -> dict:
    record = json.loads(line)  # json.JSONDecodeError is a ValueError
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    step, loss, tokens_per_s = record.get("step"), record.get("loss"), record.get("tokens_per_s")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"'step' must be an integer >= 1, got {step!r}")
    if loss is not None and not _is_number(loss):
        raise ValueError(f"'loss' must be a number or null, got {loss!r}")
    if not _is_number(tokens_per_s):
        raise ValueError(f"'tokens_per_s' must be a number, got {tokens_per_s!r}")
    return record


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def plot_metrics(source: str | Path, out: str | Path) -> Path:
    """Write the PNG of ``source``'s metrics (a file or a run directory) to ``out``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    source, out = Path(source), Path(out)
    series = {path: read_metrics(path) for path in metrics_files(source)}
    fig = Figure(figsize=(8, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    for path, records in series.items():
        steps = [r["step"] for r in records]
        label = path.stem if len(series) > 1 else None
        loss_ax.plot(steps, [math.nan if r["loss"] is None else r["loss"] for r in records], linewidth=1, label=label)
        speed_ax.plot(steps, [r["tokens_per_s"] for r in records], linewidth=1, label=label)
    loss_ax.set_ylabel("training loss")
    run = source.name if source.is_dir() else f"{source.parent.name}/{source.name}"
    loss_ax.set_title(f"{run}: loss and throughput per step")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    speed_ax.set_ylim(bottom=0)
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def default_out(source: Path) -> Path:
    """``RUN_DIR/training.png`` for a run directory, ``NAME.png`` beside a metrics file ``NAME.jsonl``."""
    return source / "training.png" if source.is_dir() else source.with_suffix(".png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarm plot", description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path, help="a metrics file (metrics.jsonl) or a run directory (runs/<time>)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG to write (default: RUN_DIR/training.png, or NAME.png beside NAME.jsonl)",
    )
    args = p.parse_args(argv)
    try:
        out = plot_metrics(args.source, args.out or default_out(args.source))
    except (MetricsError, OSError) as exc:  # OSError: unreadable metrics, unwritable PNG
        print(f"swarm plot: {exc}", file=sys.stderr)
        return 2
    print(f"swarm plot: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
