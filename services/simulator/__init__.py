"""``swarm simulate``: a discrete-event simulation of a swarm across regions, with
preemption, using the trainer's real wiring and the topology planner."""

from .sim import Report, SimConfig, Simulation, simulate

__all__ = ["Report", "SimConfig", "Simulation", "simulate"]
