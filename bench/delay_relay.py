"""A TCP relay that adds one-way latency: the arena's stand-in for ``netem``, which this
kernel lacks (see ``bench/arena_net.py``).

``python -m bench.delay_relay --listen HOST:PORT --to HOST:PORT --delay-ms D`` accepts
connections on ``--listen`` and opens one to ``--to`` for each. Every chunk read from
either side is written to the other ``D`` ms after it arrived: the chunks are delayed, not
serialized (a chunk does not wait for the delay of the one before it, only for its own),
so the relay adds latency without capping bandwidth. Each direction buffers at most
``--max-buffer`` bytes in flight; past that it stops reading, and TCP's own flow control
slows the sender, as a full link would. An end's EOF is passed on after the delay too.

Run inside a peer's network namespace in front of a service listening on loopback: every
connection to that peer, from anywhere in the arena, then sees ``D`` ms each way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time

CHUNK = 64 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, max_buffer: int) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived; EOF likewise.
    At most ``max_buffer`` bytes wait in between (then reading pauses)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    held = 0
    drained = asyncio.Condition()

    async def read() -> None:
        nonlocal held
        while True:
            async with drained:
                await drained.wait_for(lambda: held < max_buffer)
            data = await reader.read(CHUNK)
            held += len(data)
            queue.put_nowait((time.monotonic() + delay_s, data))
            if not data:
                return

    async def write() -> None:
        nonlocal held
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            async with drained:
                held -= len(data)
                drained.notify_all()

    reading = asyncio.create_task(read())
    try:
        await write()
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await reading


async def _serve_one(client_r, client_w, target: tuple[str, int], delay_s: float, max_buffer: int) -> None:
    try:
        upstream_r, upstream_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    try:
        await asyncio.gather(_pump(client_r, upstream_w, delay_s, max_buffer), _pump(upstream_r, client_w, delay_s, max_buffer))
    except (ConnectionError, OSError):
        pass
    finally:
        for w in (client_w, upstream_w):
            w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def main_async(listen: tuple[str, int], target: tuple[str, int], delay_s: float, max_buffer: int) -> None:
    server = await asyncio.start_server(lambda r, w: _serve_one(r, w, target, delay_s, max_buffer), *listen, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"delay_relay: {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}, {delay_s * 1000:g} ms each way", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delay_relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=_address, required=True)
    p.add_argument("--to", type=_address, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--max-buffer", type=int, default=8 * 2**20, help="bytes in flight per direction (default 8 MiB)")
    args = p.parse_args(argv)
    if args.delay_ms < 0:
        p.error("--delay-ms must be >= 0")
    asyncio.run(main_async(args.listen, args.to, args.delay_ms / 1000, args.max_buffer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
