"""Topology-aware placement in the coordinator: the registry's view turned into the
planner's inputs (:mod:`shared.topology`) and a stage for a joining server. Rebalancing
with these inputs is the policy's topology rule (:mod:`shared.policy.topology`).

What the planner needs and where it comes from:

- **peers**: every live server with its reported throughput (samples per busy second);
  a server that has not measured one yet (no work so far) counts at the median of the
  others. Its region is the one it reports (``SWARM_REGION``); a server that reports
  none is a region of its own.
- **network**: the shipped 10-region table for pairs of known regions, the intra-region
  link inside one region, and for any other pair a fallback link (the median measured
  RTT, ``SWARM_PLACEMENT_BANDWIDTH_GBPS``). Every RTT a server measured to a peer (its
  heartbeats' ``rtt_ms``; a joiner's ``/assign`` body) replaces the pair's latency (the
  mean of both directions); bandwidth is never measured, it stays the pair's regions'.
- **workload**: from the servers' reports: samples per optimizer step (their setting),
  activation wire bytes per sample (measured on their traffic), the stage's parameters
  (what averaging moves, in the averaging codec); the averaging period in steps is
  ``average_every_s`` over the predicted compute time of a step.

Pure logic, no I/O: the app gathers the inputs on its event loop and runs the planner in
a thread.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.policy.view import PlacementInputs
from shared.topology import INTRA_REGION, Link, Network, Peer, Workload, place_joiners, world_network

# wire bytes per value of a step round's parts by codec (int4 with its scales: 0.53, measured by bench.step_codecs)
BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.53}
GB = 2**30
DEFAULT_SAMPLES_PER_STEP = 32
NEVER_AVERAGED_STEPS = 1e12  # averaging off: its traffic weighs nothing per step
JOIN_EVALUATIONS = 5_000  # placements a join may evaluate (it also has a time budget)


@dataclass(frozen=True)
class Joiner:
    """A server that asks for a stage (``/assign``), or was handed one and has not registered yet (``stage``)."""

    peer_id: str
    region: str = ""
    rtt_ms: Mapping[str, float] = field(default_factory=dict)  # peer URL -> ms, measured by the joiner
    stage: int | None = None


def uses_topology(mode: str, rtt_ms: Mapping[str, Mapping], reports: Mapping, joiner: Joiner | None = None) -> bool:
    """Whether placement plans with the network (``mode`` 'topology', or 'auto' once some
    server, or the joiner, reported round-trip times or a region) rather than by throughput."""
    if mode != "auto":
        return mode == "topology"
    if joiner is not None and (joiner.rtt_ms or joiner.region):
        return True
    return any(rtt_ms.values()) or any(r.region for r in reports.values())


@functools.lru_cache(maxsize=1)
def _world() -> Network:
    return world_network()


def region_of(peer_id: str, region: str) -> str:
    """The reported region, or a region of the peer's own when it reported none."""
    return region or f"?{peer_id}"


def placement_inputs(
    servers: Sequence,
    rtt_ms: Mapping[str, Mapping[str, float]],
    reports: Mapping,
    *,
    num_stages: int,
    average_every_s: float,
    averaging_codec: str,
    bandwidth_gbps: float,
    joiners: Iterable[Joiner] = (),
) -> PlacementInputs:
    """The planner's inputs from the registry's live ``servers`` (``server_id``, ``stage``,
    ``url``, ``throughput``), their measured ``rtt_ms`` and ``reports`` (``ServerReport``),
    and ``joiners`` (pending hand-outs keep their stage; one without a stage is to be placed)."""
    joiners = list(joiners)
    measured_throughputs = [s.throughput for s in servers if s.throughput > 0]
    typical = statistics.median(measured_throughputs) if measured_throughputs else 1.0
    peers, current, id_of_url = [], {}, {}
    for s in servers:
        report = reports.get(s.server_id)
        peers.append(
            Peer(
                s.server_id,
                region_of(s.server_id, report.region if report else ""),
                s.throughput if s.throughput > 0 else typical,
            )
        )
        current[s.server_id] = s.stage
        id_of_url[s.url.rstrip("/")] = s.server_id
    for j in joiners:
        peers.append(Peer(j.peer_id, region_of(j.peer_id, j.region), typical))
        if j.stage is not None:
            current[j.peer_id] = j.stage

    # measured round-trip times, both directions of a pair averaged
    samples: dict[tuple[str, str], list[float]] = {}
    reported = [(s.server_id, rtt_ms.get(s.server_id, {})) for s in servers] + [(j.peer_id, j.rtt_ms) for j in joiners]
    for a, times in reported:
        for url, ms in times.items():
            b = id_of_url.get(url.rstrip("/"))
            if b is not None and b != a:
                samples.setdefault((a, b) if a <= b else (b, a), []).append(ms)
    all_times = [ms for values in samples.values() for ms in values]
    fallback = Link(statistics.median(all_times) if all_times else INTRA_REGION.rtt_ms, bandwidth_gbps)
    network = _world().with_fallback(fallback)
    region = {p.peer_id: p.region for p in peers}
    network = network.with_measurements(
        {
            (a, b): Link(sum(v) / len(v), network.region_link(region[a], region[b]).bandwidth_gbps)
            for (a, b), v in samples.items()
        }
    )

    workload = _workload(peers, current, reports.values(), num_stages, average_every_s, averaging_codec)
    return PlacementInputs(peers, network, workload, current)


def _workload(
    peers: Sequence[Peer],
    current: Mapping[str, int],
    reports: Iterable,
    num_stages: int,
    average_every_s: float,
    codec: str,
) -> Workload:
    reports = list(reports)
    per_step = [r.samples_per_step for r in reports if r.samples_per_step > 0]
    samples_per_step = statistics.median(per_step) if per_step else DEFAULT_SAMPLES_PER_STEP
    activation_gb = max((r.activation_bytes_per_sample for r in reports), default=0.0) / GB
    gradient_gb = max((r.parameters for r in reports), default=0) * BYTES_PER_VALUE.get(codec, 4) / GB
    if average_every_s <= 0:
        every_steps = NEVER_AVERAGED_STEPS
    else:
        capacity = [0.0] * num_stages
        for p in peers:
            if p.peer_id in current:
                capacity[current[p.peer_id]] += p.throughput
        weakest = min(capacity)
        every_steps = max(1.0, average_every_s * weakest / samples_per_step) if weakest > 0 else 1.0
    return Workload(samples_per_step, activation_gb, gradient_gb, every_steps)


def stage_for_joiner(
    inputs: PlacementInputs,
    joiner_id: str,
    num_stages: int,
    *,
    time_budget_s: float,
    max_evaluations: float = JOIN_EVALUATIONS,
) -> int:
    """The stage where ``joiner_id`` makes the predicted step cheapest (an empty stage
    first); nobody else moves."""
    placed = place_joiners(
        inputs.current,
        inputs.peers,
        inputs.network,
        inputs.workload,
        num_stages,
        time_budget_s=time_budget_s,
        max_evaluations=max_evaluations,
    )
    return placed[joiner_id]
