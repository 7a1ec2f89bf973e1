"""Measure an arena link: a bulk transfer (bandwidth) and a ping-pong (round-trip time),
run in two peers' namespaces (see ``bench/arena_net.py``). Prints one JSON line.

    python -m bench.arena_probe serve --host ADDRESS --port P   # in the peer measured
    python -m bench.arena_probe send --to HOST:PORT --bytes N
    python -m bench.arena_probe ping --to HOST:PORT --count N
    python -m bench.arena_probe wait-http --url URL [--key K --at-least N] --timeout S

The server reads a one-byte mode: ``b`` (bulk: it counts bytes until EOF and answers the
count and the seconds from the first to the last byte, so the sender's slow start and the
link's latency do not count against the rate) or ``p`` (echo every 8-byte message back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
import time

ROUND_TRIP_MESSAGE = 8


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        mode = await reader.readexactly(1)
        if mode == b"b":
            received, first, last = 0, None, None
            while data := await reader.read(256 * 1024):
                now = time.monotonic()
                first = first if first is not None else now
                received, last = received + len(data), now
            writer.write(struct.pack("!Qd", received, (last - first) if first is not None else 0.0))
        elif mode == b"p":
            while True:
                try:
                    msg = await reader.readexactly(ROUND_TRIP_MESSAGE)
                except asyncio.IncompleteReadError:
                    break
                writer.write(msg)
                await writer.drain()
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def serve(host: str, port: int) -> None:
    server = await asyncio.start_server(_handle, host, port, reuse_address=True)
    print(json.dumps({"serving": port}), flush=True)
    async with server:
        await server.serve_forever()


async def send(host: str, port: int, nbytes: int) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    writer.write(b"b")
    chunk = bytes(64 * 1024)
    left = nbytes
    while left > 0:
        writer.write(chunk[: min(left, len(chunk))])
        left -= min(left, len(chunk))
        await writer.drain()
    writer.write_eof()
    received, seconds = struct.unpack("!Qd", await reader.readexactly(16))
    writer.close()
    return {
        "bytes": received,
        "receive_s": seconds,
        "mbit_s": received * 8 / seconds / 1e6 if seconds else None,
        "total_s": time.monotonic() - started,
    }


async def ping(host: str, port: int, count: int) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"p")
    rtts = []
    for i in range(count):
        t = time.monotonic()
        writer.write(struct.pack("!Q", i))
        await writer.drain()
        await reader.readexactly(ROUND_TRIP_MESSAGE)
        rtts.append(time.monotonic() - t)
    writer.close()
    rtts.sort()
    return {
        "count": count,
        "rtt_ms_median": rtts[len(rtts) // 2] * 1000,
        "rtt_ms_min": rtts[0] * 1000,
        "rtt_ms_max": rtts[-1] * 1000,
    }


def wait_http(url: str, key: str, at_least: float, timeout_s: float) -> dict:
    """Poll ``GET url`` (every 0.2 s, at most ``timeout_s``) until it answers 200 with a JSON
    object whose ``key`` is at least ``at_least`` (no key: any 200); returns that object.
    How the arena waits for a service that only its own namespaces can reach."""
    import urllib.request

    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                body = json.loads(resp.read())
            if not key or (isinstance(body.get(key), (int, float)) and body[key] >= at_least):
                return body
            last = f"{key}={body.get(key)!r}"
        except (OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    raise SystemExit(f"{url}: not ready after {timeout_s} s ({last})")


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.arena_probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True)
    b = sub.add_parser("send")
    b.add_argument("--to", type=_address, required=True)
    b.add_argument("--bytes", type=int, default=4 * 2**20)
    q = sub.add_parser("ping")
    q.add_argument("--to", type=_address, required=True)
    q.add_argument("--count", type=int, default=20)
    w = sub.add_parser("wait-http")
    w.add_argument("--url", required=True)
    w.add_argument("--key", default="")
    w.add_argument("--at-least", type=float, default=0.0)
    w.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.cmd == "wait-http":
        print(json.dumps(wait_http(args.url, args.key, args.at_least, args.timeout)), flush=True)
    elif args.cmd == "serve":
        asyncio.run(serve(args.host, args.port))
    elif args.cmd == "send":
        print(json.dumps(asyncio.run(send(*args.to, args.bytes))), flush=True)
    else:
        print(json.dumps(asyncio.run(ping(*args.to, args.count))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
