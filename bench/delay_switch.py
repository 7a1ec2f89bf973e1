"""A learning Ethernet switch that adds latency: the arena's stand-in for ``netem``, which
this kernel lacks (see ``bench/arena_net.py``).

``python -m bench.delay_switch PORT:MS [PORT:MS ...]``, run in the arena's hub namespace,
opens a raw socket (``AF_PACKET``) on each hub-side veth and forwards every frame that
arrives on one port to the port that leads to its destination MAC (learnt from the frames'
sources; flooded while unknown), ``MS`` of the port it came in on plus ``MS`` of the port
it goes out on later: each port is a peer's access link and its latency, so a peer-to-peer
path has both links' latencies, in each direction. Frames are delayed, not serialized, so
the switch adds latency without capping bandwidth (the peers' ``tbf`` buckets do that).

Two things make raw forwarding between veths work: the peers' veths send with their
transmit checksum offload off (see :func:`transmit_checksum_off`: a frame forwarded with
a checksum left for the hardware would be dropped by the receiver), and a large MTU on
every veth (few, large frames: a Python loop keeps up with hundreds of Mbit/s).
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import json
import signal
import socket
import struct
import sys

ETH_P_ALL = 0x0003
SIOCETHTOOL = 0x8946
ETHTOOL_STXCSUM = 0x00000017
MAX_FRAME = 70_000


def transmit_checksum_off(ifname: str) -> None:
    """``ethtool -K IFNAME tx off`` without ethtool (not installed here): the SIOCETHTOOL
    ioctl, in the calling process's network namespace."""
    value = (ctypes.c_uint32 * 2)(ETHTOOL_STXCSUM, 0)
    ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(value)) + bytes(16)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)


class DelaySwitch:
    def __init__(self, ports: dict[str, float]):
        """``ports``: hub-side interface name -> one-way latency of that access link, seconds."""
        self.delay = dict(ports)
        self.socks: dict[str, socket.socket] = {}
        self.where: dict[bytes, str] = {}  # MAC -> port it was last seen on
        self.frames = {"in": 0, "out": 0, "dropped": 0}

    def open(self) -> None:
        for name in self.delay:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((name, 0))
            s.setblocking(False)
            self.socks[name] = s

    def _receive(self, port: str) -> None:
        loop = asyncio.get_running_loop()
        sock = self.socks[port]
        while True:
            try:
                frame, address = sock.recvfrom(MAX_FRAME)
            except BlockingIOError:
                return
            if address[2] == socket.PACKET_OUTGOING:  # our own transmissions, seen again
                continue
            self.frames["in"] += 1
            self.where[frame[6:12]] = port
            out = self.where.get(frame[0:6])
            targets = [out] if out is not None else [p for p in self.socks if p != port]
            for target in targets:
                if target != port:
                    loop.call_later(self.delay[port] + self.delay[target], self._send, target, frame)

    def _send(self, port: str, frame: bytes) -> None:
        try:
            self.socks[port].send(frame)
            self.frames["out"] += 1
        except OSError:  # the peer's end is down, or its queue is full: a lost frame, as on a link
            self.frames["dropped"] += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        for port, sock in self.socks.items():
            loop.add_reader(sock.fileno(), self._receive, port)
        print(json.dumps({"switch": {p: d * 1000 for p, d in self.delay.items()}}), flush=True)
        await stop.wait()
        print(json.dumps({"frames": self.frames}), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or any(":" not in a for a in args):
        print("usage: python -m bench.delay_switch PORT:MS [PORT:MS ...]", file=sys.stderr)
        return 2
    ports = {name: float(ms) / 1000 for name, ms in (a.rsplit(":", 1) for a in args)}
    switch = DelaySwitch(ports)
    switch.open()
    asyncio.run(switch.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
