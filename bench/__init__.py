"""Benchmarks: ``swarm bench NAME|all`` (see ``bench/__main__.py``) and others under ``bench/``."""
