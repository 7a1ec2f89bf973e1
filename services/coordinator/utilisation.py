"""The stages' model FLOPs utilisation (MFU) as their servers report it, for ``/swarm``,
``swarm status`` and the dashboard. Plain logic, no HTTP.

Each stage server sends its meter's report (``services/stage_server/utilisation.py``) as
``utilisation`` in its registrations and heartbeats: soft state, like its throughput, kept
for live servers only. A stage's figures sum its replicas': wall MFU is their achieved
FLOP/s over the sum of their peaks (every replica computes at once), busy MFU their model
FLOPs over their compute seconds weighted by each one's peak.
"""

from __future__ import annotations

import math

from shared.errors import BadPayload

NUMBERS = (
    "model_flops",
    "compute_s",
    "peak_flops",
    "flops_per_s_busy",
    "mfu_busy",
    "flops_per_s_wall",
    "mfu_wall",
    "window_s",
)
COUNTS = ("tokens_trained", "tokens_evaluated")
LABELS = {"peak_source": 16, "peak_device": 160}  # field -> longest accepted
MAX_VALUE = 1e30


def check_utilisation(value) -> dict:
    """The report in a registration or heartbeat, validated (unknown fields dropped)."""
    if not isinstance(value, dict):
        raise BadPayload(
            "'utilisation' must be an object {model_flops, compute_s, peak_flops, mfu_busy, mfu_wall, ...}"
        )
    out: dict = {}
    for key in NUMBERS:
        v = value.get(key, 0.0)
        if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v <= MAX_VALUE:
            raise BadPayload(f"'utilisation.{key}' must be a finite number in [0, 1e30]")
        out[key] = float(v)
    for key in COUNTS:
        v = value.get(key, 0)
        if type(v) is not int or not 0 <= v < 2**63:
            raise BadPayload(f"'utilisation.{key}' must be an int in [0, 2**63)")
        out[key] = v
    for key, max_len in LABELS.items():
        v = value.get(key, "")
        if not isinstance(v, str) or len(v) > max_len:
            raise BadPayload(f"'utilisation.{key}' must be a string of at most {max_len} characters")
        out[key] = v
    return out


def stage_utilisation(reports: list[dict]) -> dict | None:
    """One stage's figures from its replicas' reports; None when none reported."""
    if not reports:
        return None
    peak = sum(r["peak_flops"] for r in reports)
    wall = sum(r["flops_per_s_wall"] for r in reports)
    flops = sum(r["model_flops"] for r in reports)
    busy_peak_s = sum(r["compute_s"] * r["peak_flops"] for r in reports)  # FLOPs the peak would have done
    return {
        "replicas": len(reports),
        "model_flops": flops,
        "flops_per_s_wall": wall,
        "peak_flops": peak,
        "mfu_wall": wall / peak if peak else 0.0,
        "mfu_busy": flops / busy_peak_s if busy_peak_s else 0.0,
        "peaks": sorted({f"{r['peak_source']}: {r['peak_device']}" for r in reports}),  # where each came from
    }


class UtilisationBoard:
    """The latest report of each server, by server id."""

    def __init__(self):
        self._reports: dict[str, dict] = {}

    def record(self, server_id: str, report: dict) -> None:
        self._reports[server_id] = report

    def annotate(self, view: dict) -> None:
        """Add to a ``Registry.view()`` each live replica's report (``utilisation``, where it
        sent one) and each stage's figures (None without reports); forget the servers no longer live."""
        live = set()
        for stage in view["stages"]:
            reports = []
            for replica in stage["replicas"]:
                live.add(replica["server_id"])
                if (report := self._reports.get(replica["server_id"])) is not None:
                    replica["utilisation"] = report
                    reports.append(report)
            stage["utilisation"] = stage_utilisation(reports)
        for server_id in set(self._reports) - live:
            del self._reports[server_id]
