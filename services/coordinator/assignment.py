"""The coordinator's side of rebalancing: its registry seen as the policy's view, and the
policy built from its settings.

The decisions themselves live in :mod:`shared.policy` (where a loss would hurt most, the
weakest stage, the best single move, topology replans, confirmation on consecutive
checks); the rebalancing loop in ``app.py`` calls :func:`swarm_view` and
:meth:`RebalancingPolicy.check` each period and orders what comes back. Pure logic, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.coordinator.placement import Joiner, placement_inputs, uses_topology
from services.coordinator.registry import RegisteredServer, Registry
from shared.config import CoordinatorSettings
from shared.policy.rebalancing import RebalancingPolicy
from shared.policy.throughput import ThroughputRebalancer
from shared.policy.topology import TopologyRebalancer
from shared.policy.view import PlacementInputs, SwarmView


def rebalancing_policy(settings: CoordinatorSettings) -> RebalancingPolicy:
    """The policy with the coordinator's settings: ``rebalance_min_gain`` for the throughput
    rule, ``placement.min_gain``, ``placement.max_moves`` and ``placement.budget_s`` for the
    topology rule; every rule (the resilience rule's repairs too) confirms a move on two
    consecutive checks."""
    return RebalancingPolicy(
        throughput=ThroughputRebalancer(min_gain=settings.rebalance_min_gain),
        topology=TopologyRebalancer(
            min_gain=settings.placement.min_gain,
            max_moves_fraction=settings.placement.max_moves,
            time_budget_s=settings.placement.budget_s,
        ),
    )


def swarm_view(registry: Registry, settings: CoordinatorSettings, live: Sequence[RegisteredServer]) -> SwarmView:
    """The ``live`` servers (``registry.live()``) as the policy's view, with the stages handed
    to servers that have not registered yet (joiners, and servers moving there) as pending
    joins, the speeds and links every one declared, and the topology planner's inputs when
    placement plans with the network (``settings.placement.mode``, see ``uses_topology``)."""
    topology = None
    if uses_topology(settings.placement.mode, registry.rtt_ms, registry.reports):
        topology = network_inputs(registry, settings, live)
    return registry.swarm(registry.pending_joins(), live=live, topology=topology)


def network_inputs(
    registry: Registry,
    settings: CoordinatorSettings,
    live: Sequence[RegisteredServer],
    joiners: Iterable[Joiner] = (),
) -> PlacementInputs:
    """The network planner's inputs: the ``live`` servers with the registry's measured RTTs
    and reports, the coordinator's averaging and bandwidth settings, and ``joiners``."""
    return placement_inputs(
        live,
        registry.rtt_ms,
        registry.reports,
        num_stages=registry.num_stages,
        average_every_s=settings.average_every_s,
        averaging_codec=settings.averaging_codec,
        bandwidth_gbps=settings.placement.bandwidth_gbps,
        joiners=joiners,
    )
