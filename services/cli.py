"""The ``swarm`` command: one entry point for every service.

    swarm coordinator  the registry with leases          (python -m services.coordinator)
    swarm server ...   serve one pipeline stage          (python -m services.stage_server)
    swarm train ...    train through stage servers       (python -m services.trainer)
    swarm status       the live swarm as a table         (python -m services.status)
    swarm up ...       a whole swarm on this machine     (python -m services.local_swarm)
    swarm export ...   the model from a checkpoint       (python -m services.export)
    swarm generate ... text through the live swarm       (python -m services.generate)
    swarm tokenizer train ...  a BPE tokenizer on a corpus (python -m services.tokenizer_train)

Each sub-command takes ``--help``; every setting is also an environment variable SWARM_*.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "coordinator": ("services.coordinator.__main__", "keep the registry of a run's stage servers"),
    "server": ("services.stage_server.__main__", "serve one pipeline stage"),
    "train": ("services.trainer.__main__", "train through stage servers"),
    "status": ("services.status", "show the live swarm: stages, replicas, throughput, lease age"),
    "up": ("services.local_swarm", "run a coordinator, stage servers and trainers on loopback and train"),
    "export": (
        "services.export",
        "write the whole model from a checkpoint: one safetensors file, or a Hugging Face directory (--format hf)",
    ),
    "generate": (
        "services.generate",
        "generate text through the live swarm: inference sessions on the stage servers, streamed to the terminal",
    ),
    "tokenizer": ("services.tokenizer_train", "train a byte-level BPE tokenizer on a corpus (swarm tokenizer train)"),
    "plot": ("services.plot", "draw loss and tokens/s against step from a run's metrics as a PNG"),
    "simulate": (
        "services.simulator.__main__",
        "simulate a swarm across regions with preemption (SWARM vs fixed pipelines)",
    ),
    "bench": ("bench.__main__", "benchmarks against one process, torch pipelining and hivemind; tables and JSON"),
}


def usage() -> str:
    lines = ["usage: swarm COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'swarm COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"swarm: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
