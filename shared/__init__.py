"""swarm-mesh shared library: wire codec, model and its partition, config, logging.

Nothing here runs a server; services import it, never the other way round.
"""

WIRE_VERSION = 1


def package_version() -> str:
    """This installation's version of swarm-mesh ("unknown" when run from a bare tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarm-mesh")
    except PackageNotFoundError:
        return "unknown"
