"""Topology-aware placement: where stage servers should sit in a swarm spread over regions.

- :mod:`.network`: peers, regions, the shipped latency/bandwidth matrix (``data/``);
- :mod:`.cost`: seconds per step of a placement (DT-FM's cost, and the SWARM cost);
- :mod:`.objective`: that cost evaluated group by group, incrementally, with caches;
- :mod:`.search`: greedy seeds, local search, evolutionary search, exhaustive search;
- :mod:`.planner`: what the coordinator calls: ``plan``, ``place_joiners``, ``replan``.

Pure computation: no I/O besides reading the shipped data, no networking.
"""

from .cost import DTFM_GPT3_XL, StepCost, Workload, dtfm_cost, step_cost
from .network import INTRA_REGION, Link, Network, Peer, regional_network, world_network
from .planner import Placement, Replan, place_joiners, placement_cost, plan, replan

__all__ = [
    "DTFM_GPT3_XL",
    "INTRA_REGION",
    "Link",
    "Network",
    "Peer",
    "Placement",
    "Replan",
    "StepCost",
    "Workload",
    "dtfm_cost",
    "place_joiners",
    "placement_cost",
    "plan",
    "regional_network",
    "replan",
    "step_cost",
    "world_network",
]
