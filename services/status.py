"""``swarm status``: the live swarm as the coordinator sees it, as a table.

The coordinator comes from ``--coordinator URL``, ``SWARM_COORDINATOR``, or mDNS.
Exit status: 0 printed, 2 no coordinator found or reachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.request

from shared.policy.throughput import weakest


def render(view: dict) -> str:
    """A readable table of GET /swarm: stages with their global step (and the samples
    accumulated of the next global batch), the samples dropped, the duplicate backwards
    refused at each (a microbatch counts once per stage) and the steps whose updates it lost
    (every replica holding them died), their replicas, throughput and
    lease age; the standby servers waiting for a stage; then, once servers report it, each
    stage's model FLOPs utilisation."""
    stages = view["stages"]
    weakest_index = weakest([s["capacity"] for s in stages], [len(s["replicas"]) for s in stages])
    weakest_stage = -1 if weakest_index is None else stages[weakest_index]["stage"]
    lines = [
        f"run {view.get('run_id', '?')}: {len(stages)} stages, {sum(len(s['replicas']) for s in stages)} replicas, "
        f"heartbeat {view['heartbeat_s']:g} s, lease {view['lease_s']:g} s",
        "",
        f"{'stage':>5}  {'replicas':>8}  {'capacity':>12}  {'global step':>11}  {'next batch':>12}  {'dropped':>7}"
        f"  {'duplicates':>10}  {'steps lost':>10}",
    ]
    for s in stages:
        mark = "  <- weakest" if s["stage"] == weakest_stage and len(stages) > 1 else ""
        step = s.get("step") or {}
        batch = f"{step.get('accumulated', 0)}/{step.get('global_batch', 0)}" if step.get("global_batch") else "-"
        lines.append(
            f"{s['stage']:>5}  {len(s['replicas']):>8}  {s['capacity']:>10.1f}/s  {step.get('step', '-'):>11}  "
            f"{batch:>12}  {step.get('samples_dropped', 0):>7}  {step.get('duplicates_refused', 0):>10}"
            f"  {step.get('steps_lost_total', 0):>10}{mark}"
        )
        for r in s["replicas"]:
            lines.append(
                f"{'':>7}{r['url']:<32} {r['server_id']:<20} {r['throughput']:>8.1f} samples/s  "
                f"queue {r['queue_length']:>3}  lease age {r['lease_age_s']:>5.1f} s"
            )
    standby = view.get("standby") or []
    if standby:
        lines += ["", f"standby (waiting for a stage left with one replica): {len(standby)}"]
        lines += [f"{'':>7}{w['server_id']}" + (f"  region {w['region']}" if w.get("region") else "") for w in standby]
    return "\n".join(lines + utilisation_lines(stages))


def utilisation_lines(stages: list[dict]) -> list[str]:
    """The MFU table: per stage (its replicas together) busy and wall MFU, achieved and peak
    FLOP/s, where the peaks came from; nothing when no server reported its utilisation."""
    if not any(s.get("utilisation") for s in stages):
        return []
    lines = [
        "",
        "MFU: model FLOPs / peak FLOP/s; busy: over the forward and backward compute seconds, wall: over the last "
        "minute",
        f"{'stage':>5}  {'replicas':>8}  {'MFU busy':>8}  {'MFU wall':>8}  {'wall FLOP/s':>13}  {'peak':>13}"
        "  peak from",
    ]
    for s in stages:
        u = s.get("utilisation")
        if not u:
            lines.append(f"{s['stage']:>5}  {'-':>8}")
            continue
        lines.append(
            f"{s['stage']:>5}  {u['replicas']:>8}  {_percent(u['mfu_busy']):>8}  {_percent(u['mfu_wall']):>8}  "
            f"{_flops(u['flops_per_s_wall']):>13}  {_flops(u['peak_flops']):>13}  {'; '.join(u['peaks'])}"
        )
    return lines


def _percent(x: float) -> str:
    return f"{100 * x:.3g}%"


def _flops(x: float) -> str:
    """FLOP/s with a unit prefix: 1.23 TFLOP/s."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}FLOP/s"
    return f"{x:.3g} FLOP/s"


def fetch(coordinator: str, timeout_s: float = 5.0) -> dict:
    """GET /swarm, signed with the swarm secret and over TLS as SWARM_SECRET(_FILE) and SWARM_TLS_CA_FILE say."""
    from shared.config import CommonSettings
    from shared.http import urlopen_swarm

    with urlopen_swarm(CommonSettings(), coordinator.rstrip("/") + "/swarm", timeout_s=timeout_s) as resp:
        return json.loads(resp.read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swarm status", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--coordinator",
        default=os.environ.get("SWARM_COORDINATOR", ""),
        help="coordinator URL (default: SWARM_COORDINATOR, else mDNS)",
    )
    p.add_argument("--run-id", default=os.environ.get("SWARM_RUN_ID"), help="with mDNS: the run to look for")
    p.add_argument("--mdns-interfaces", default=os.environ.get("SWARM_MDNS_INTERFACES", "all"))
    p.add_argument("--json", action="store_true", help="print the raw view as JSON")
    args = p.parse_args(argv)
    coordinator = args.coordinator
    if not coordinator:
        from shared.discovery import find_coordinator

        coordinator = (
            asyncio.run(find_coordinator(args.run_id, interfaces_spec=args.mdns_interfaces, timeout_s=5.0)) or ""
        )
    if not coordinator:
        print(
            "swarm status: no coordinator given (--coordinator, SWARM_COORDINATOR) and none found by mDNS",
            file=sys.stderr,
        )
        return 2
    try:
        view = fetch(coordinator)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"swarm status: cannot read {coordinator}/swarm: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(view, indent=2) if args.json else render(view))
    return 0


if __name__ == "__main__":
    sys.exit(main())
