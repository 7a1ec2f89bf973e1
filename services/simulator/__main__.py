"""``swarm simulate``: simulate a swarm (SWARM wiring and rebalancing against fixed
pipelines that repair themselves with spares) and print a table; ``--json PATH`` also
writes the reports.

    swarm simulate --peers 1000 --stages 8 --duration 300 --lifetime 600
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from .records import MODES, Report, SimConfig
from .sim import simulate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="swarm simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=(*MODES, "both"), default="both", help="swarm, fixed pipelines, or both (default)")
    p.add_argument("--peers", type=int, default=d.num_peers, help="peers at the start")
    p.add_argument("--stages", type=int, default=d.num_stages)
    p.add_argument("--model", default=d.model, help="shared.model preset (sizes of a stage)")
    p.add_argument("--duration", type=float, default=d.duration_s, help="simulated seconds")
    p.add_argument(
        "--lifetime", type=float, default=d.mean_lifetime_s, help="mean peer lifetime in s (inf: no preemption)"
    )
    p.add_argument("--join-rate", type=float, default=None, help="joins per s (default: peers / lifetime)")
    p.add_argument("--microbatch", type=int, default=d.microbatch, help="samples per microbatch")
    p.add_argument(
        "--in-flight", type=int, default=d.microbatches_in_flight, help="microbatches in flight, whole swarm"
    )
    p.add_argument("--trainers", type=int, default=d.trainers)
    p.add_argument("--average-every", type=float, default=d.average_every_s, help="s between averaging rounds")
    p.add_argument("--rebalance-every", type=float, default=d.rebalance_every_s, help="s between replans")
    p.add_argument("--lease", type=float, default=d.lease_s, help="s after which a silent peer counts as dead")
    p.add_argument(
        "--dead-peer-timeout", type=float, default=d.dead_peer_timeout_s, help="s before a request to a dead peer fails"
    )
    p.add_argument(
        "--repair-delay",
        type=float,
        default=d.repair_delay_s,
        help="fixed pipelines: s to restart a repaired pipeline, on top of detection and the state download",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="write the reports as JSON")
    return p.parse_args(argv)


def render(reports: list[Report]) -> str:
    """The reports side by side: throughput over time, utilisation, losses, cost of the run."""
    rows = [
        ("tokens/s", lambda r: f"{r.tokens_per_s:,.0f}"),
        ("tokens/s per window", lambda r: " ".join(f"{t / 1e3:.0f}k" for t in r.tokens_per_s_windows)),
        ("kept (last/best window)", lambda r: f"{_kept(r):.0%}"),
        ("stage utilisation", lambda r: " ".join(f"{u:.2f}" for u in r.stage_utilisation)),
        ("replicas at end", lambda r: " ".join(str(n) for n in r.stage_replicas_end)),
        ("lost work", lambda r: f"{r.lost_work_fraction:.1%}"),
        ("lost microbatches", lambda r: f"{r.lost_microbatches} of {r.lost_microbatches + r.completed_microbatches}"),
        ("failed hops", lambda r: f"{r.failed_hops:,}"),
        ("deaths / joins / moves", lambda r: f"{r.deaths} / {r.joins} / {r.moves}"),
        ("repairs (detect + restart s)", _repairs),
        ("averaging rounds, mean s", lambda r: f"{r.averaging_rounds}, {r.mean_averaging_s:.1f}"),
        ("events", lambda r: f"{r.events:,}"),
        ("cpu s (planner s)", lambda r: f"{r.cpu_s:.1f} ({r.planner_s:.1f})"),
    ]
    first = reports[0]
    lines = [f"{first.peers} peers, {first.stages} stages, {first.duration_s:g} simulated s", ""]
    width = max(len(name) for name, _ in rows)
    cols = [[fmt(r) for r in reports] for _, fmt in rows]
    col_w = [max(len(r.mode), *(len(c[i]) for c in cols)) for i, r in enumerate(reports)]
    lines.append(" " * width + "  " + "  ".join(r.mode.ljust(w) for r, w in zip(reports, col_w)))
    for (name, _), values in zip(rows, cols):
        lines.append(name.ljust(width) + "  " + "  ".join(v.ljust(w) for v, w in zip(values, col_w)))
    return "\n".join(lines)


def _repairs(report: Report) -> str:
    if report.mode != "fixed":
        return "-"
    return f"{report.repairs} ({report.mean_detection_s:.1f} + {report.mean_repair_s:.1f})"


def _kept(report: Report) -> float:
    """Throughput in the last window over the best window (the first ones fill the pipeline)."""
    best = max(report.tokens_per_s_windows)
    return report.tokens_per_s_windows[-1] / best if best else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = MODES if args.mode == "both" else (args.mode,)
    reports = []
    for mode in modes:
        config = SimConfig(
            mode=mode,
            num_peers=args.peers,
            num_stages=args.stages,
            model=args.model,
            duration_s=args.duration,
            mean_lifetime_s=math.inf if args.lifetime <= 0 else args.lifetime,
            join_rate_per_s=args.join_rate,
            microbatch=args.microbatch,
            microbatches_in_flight=args.in_flight,
            trainers=args.trainers,
            average_every_s=args.average_every,
            rebalance_every_s=args.rebalance_every,
            lease_s=args.lease,
            dead_peer_timeout_s=args.dead_peer_timeout,
            repair_delay_s=args.repair_delay,
            seed=args.seed,
        )
        reports.append(simulate(config))
    print(render(reports))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in reports], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
