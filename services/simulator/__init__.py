"""``swarm simulate``: a discrete-event simulation of a swarm across regions, with
preemption, using the trainer's real wiring and the topology planner, against fixed
pipelines that repair themselves with spares."""

from .fixed import FixedPipelineSimulation
from .records import Report, SimConfig
from .sim import Simulation, simulate

__all__ = ["FixedPipelineSimulation", "Report", "SimConfig", "Simulation", "simulate"]
