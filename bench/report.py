"""What a bench returns, and how it is shown: a plain-text table, JSON, markdown.

Every bench returns a :class:`BenchResult`: named columns, one dict per row, the
parameters it ran with and notes (how to read it, what was not measured and why). The
runner adds the machine and the date, prints the table and writes the JSON.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

NOT_INSTALLED = "not installed"


@dataclass
class BenchResult:
    name: str
    title: str
    columns: list[str]  # keys of the rows, in the order shown
    rows: list[dict] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # the headline figures (ratios), for the docs
    elapsed_s: float = 0.0


def machine() -> dict:
    """Where the figures were taken: CPU, cores, load, library versions."""
    import torch

    cpu = ""
    try:
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2e}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def format_table(result: BenchResult) -> str:
    """The rows as an aligned text table, notes after it."""
    cells = [[_cell(row.get(c)) for c in result.columns] for row in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths)))

    out = [
        f"== {result.name}: {result.title} ({result.elapsed_s:.0f} s)",
        line(result.columns),
        line(["-" * w for w in widths]),
    ]
    out += [line(r) for r in cells]
    out += [f"  * {note}" for note in result.notes]
    return "\n".join(out)


def format_markdown(result: BenchResult) -> str:
    """The rows as a markdown table (for docs/benchmarks.md), notes as a list."""
    out = [
        f"### {result.name}: {result.title}",
        "",
        "| " + " | ".join(result.columns) + " |",
        "|" + "---|" * len(result.columns),
    ]
    out += [
        "| " + " | ".join(_cell(row.get(c)).replace("|", "\\|") for c in result.columns) + " |" for row in result.rows
    ]
    if result.notes:
        out.append("")
        out += [f"- {note}" for note in result.notes]
    return "\n".join(out) + "\n"


def _json_safe(value):
    """NaN and infinities become null: strict JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(result: BenchResult, path: Path, *, command: str, machine_info: dict, quick: bool) -> None:
    record = {"bench": result.name, "command": command, "quick": quick, "machine": machine_info, **asdict(result)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(record), indent=1, allow_nan=False) + "\n")
