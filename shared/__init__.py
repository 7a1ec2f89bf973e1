"""swarm-mesh shared library: wire codec, model and its partition, config, logging.

Nothing here runs a server; services import it, never the other way round.
"""

WIRE_VERSION = 1
