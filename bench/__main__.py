"""``swarm bench NAME|all`` (``python -m bench``): benchmarks of the mesh side by side with
the alternatives, both sides measured in the same run on the same machine.

Each bench prints a table and writes it as JSON (``--out``, default ``bench/results``):
``NAME.json`` with the rows, the parameters, the machine and the date. ``--quick`` runs
tiny sizes (the smoke test). ``--markdown FILE`` also writes the tables as markdown
(what ``docs/benchmarks.md`` quotes). Every process a bench starts is stopped by it, also
on an error or Ctrl-C. Torch runs one thread per process unless a bench says otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import BenchResult, format_markdown, format_table, machine, write_json
from shared.log import configure_logging

BENCHES = {
    "codec": "encode+decode speed, error and bytes of every wire codec against memcpy (and hivemind)",
    "hop": "one forward+backward hop over loopback against the stage's compute (and hivemind)",
    "square_cube": "mesh tokens/s over one process as the model grows",
    "pipelining": "mesh tokens/s over torch.distributed.pipelining (gloo, 1F1B)",
    "churn": "tokens/s with a replica killed and restarted every 20 s, against no faults",
    "rebalancing": "throughput before and after rebalancing 1:2:4 replicas, against the exhaustive optimum",
    "convergence": "loss after the same samples: fp32/fp16/int8 wires, 1 vs 2 replicas, global vs local (DiLoCo) sync",
    "generation": (
        "time per new token through the swarm at 32 and 512 tokens "
        "of context: sessions with KV caches vs the whole prefix"
    ),
    "joins": "seconds from a server's start (cold) or its assignment (standby) to its first served microbatch",
    "arena": "time to a target loss on shaped links, uneven peers and churn: mesh int8/fp32 vs torch pipelining (root)",
}
ALIASES = {"square-cube": "square_cube"}


@dataclass
class BenchContext:
    """What a bench gets: the size knob, a directory for its processes' logs, and a cache
    shared by the benches of one invocation (a measurement one bench made and another needs)."""

    quick: bool
    log_dir: Path
    cache: dict = field(default_factory=dict)

    def logs(self, name: str) -> Path:
        path = self.log_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="swarm bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benches:\n" + "\n".join(f"  {n.replace('_', '-'):<12} {h}" for n, h in BENCHES.items()),
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="bench names, or 'all'")
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes: checks that every bench runs, measures nothing worth quoting"
    )
    p.add_argument("--out", default="bench/results", help="directory of the JSON results (default bench/results)")
    p.add_argument("--markdown", default="", help="also write the tables as markdown to this file")
    args = p.parse_args(argv)
    names = []
    for name in args.names:
        name = ALIASES.get(name, name)
        if name == "all":
            names += list(BENCHES)
        elif name in BENCHES:
            names.append(name)
        else:
            p.error(f"unknown bench {name!r}; choose from all, {', '.join(n.replace('_', '-') for n in BENCHES)}")
    args.names = list(dict.fromkeys(names))
    return args


def run_bench(name: str, ctx: BenchContext) -> BenchResult:
    module = importlib.import_module(f"bench.{name}")
    started = time.monotonic()
    try:
        result = module.run(ctx)
    except Exception as exc:  # a bench that could not run says why in its table; the others still run
        traceback.print_exc()
        result = BenchResult(
            name,
            BENCHES[name],
            ["error"],
            [{"error": f"{type(exc).__name__}: {exc}"}],
            notes=["the bench failed; see the error and the logs"],
        )
    result.elapsed_s = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    configure_logging("console", "error")  # services run inside this process by some benches: their errors only
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # an optional 4-bit kernel we never use
    out = Path(args.out)
    ctx = BenchContext(quick=args.quick, log_dir=out / "logs")
    command = "swarm bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop children on SIGTERM as on Ctrl-C
    signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # Ctrl-C works even where SIGINT was ignored (a background job)
    info = machine()
    print(
        (
            f"swarm bench: {', '.join(args.names)} on {info['cores']} cores ({info['cpu']}), load "
            f"{info['load_avg_1m']}; results in {out}/"
        ),
        flush=True,
    )
    started, failed, markdown = time.monotonic(), [], []
    try:
        for name in args.names:
            result = run_bench(name, ctx)
            print(format_table(result) + "\n", flush=True)
            write_json(
                result,
                out / f"{name}.json",
                command=command,
                machine_info={**info, "load_avg_1m_after": machine()["load_avg_1m"]},
                quick=args.quick,
            )
            markdown.append(format_markdown(result))
            if result.columns == ["error"]:
                failed.append(name)
    except KeyboardInterrupt:
        print("\nswarm bench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    total = time.monotonic() - started
    if args.markdown:
        header = (
            f"Command: `{command}`. Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
            f"load {info['load_avg_1m']} at start. Date: {info['date_utc']} UTC. Total {total:.0f} s.\n\n"
        )
        Path(args.markdown).write_text(header + "\n".join(markdown))
    print(
        f"swarm bench: {len(args.names)} benches in {total:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
