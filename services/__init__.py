"""swarm-mesh services: stage server, trainer (and the `swarm` command line)."""
