"""The WAN arena's network: every peer in its own Linux network namespace, behind an access
link shaped in both directions and with its own latency, on one machine.

Layout (all names start with ``swa<pid>-``, so a run's leftovers are recognisable):

- a hub namespace (``swa<pid>-<n>-hub``) where :mod:`bench.delay_switch` joins the peers'
  links: a learning switch that delays each frame by the latency of the link it came in
  on plus that of the link it goes out on (this kernel has no ``netem``);
- per peer, a namespace (``swa<pid>-<n>-<peer index>``) with one veth into the hub and an
  address ``10.77.0.N/24``; the peer's veth end shapes its upload, the hub's end its
  download, each with a token bucket (``tc qdisc ... tbf``) at the peer's rate. So every
  connection between two peers, whatever its ports (HTTP, gloo), crosses both peers'
  buckets and both links' latencies: a peer-to-peer RTT is twice the sum of the two;
- compute: an optional CPU cap per peer (cgroup v1 ``cpu.cfs_quota_us``, or v2
  ``cpu.max``), the processes started in the peer joining it.

Everything is created by :class:`Arena` and removed by it (``with Arena(...)``), also on an
error or Ctrl-C: processes stopped, namespaces deleted (their veths and qdiscs with them),
cgroups removed. :func:`cleanup_stale` removes what a killed run left. Nothing outside the
arena's own addresses is contacted. Needs root, ``ip`` and ``tc``: :func:`unavailable`
says why not, for the bench to skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
PREFIX = "swa"
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
MTU = 16000  # large frames: the switch forwards about 1,600 a second at 200 Mbit/s
REPO = Path(__file__).resolve().parents[1]  # for the arena's own Python processes (``-m bench...``)
# Held shared while an arena exists and exclusively by `make compose` (.ci/compose.py), whose
# Docker engine rewrites the host's firewall: the two never run side by side.
HOST_NETWORK_LOCK = Path("/run/lock/swarm-mesh-host-network.lock")
LOCK_WAIT_S = 900.0
_ARENAS = 0  # arenas built by this process: each gets its own names


@dataclass(frozen=True)
class PeerSpec:
    name: str  # e.g. "stage0", "trainer"
    rate_mbit: float  # access link, each direction
    one_way_ms: float  # latency of the access link, each direction
    cpus: float | None = None  # CPU cap in cores (None: uncapped)


@dataclass
class Peer:
    spec: PeerSpec
    index: int
    netns: str
    address: str
    veth_peer: str
    veth_hub: str
    cgroup: Path | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)


def unavailable() -> str | None:
    """Why this machine cannot build an arena (None: it can)."""
    if os.geteuid() != 0:
        return "the arena needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the arena needs {tool!r} (iproute2)"
    return None


def _hold_host_network():
    """A shared hold on :data:`HOST_NETWORK_LOCK`, waiting at most :data:`LOCK_WAIT_S` for a
    running `make compose` to finish (the file object; closing it releases the hold)."""
    HOST_NETWORK_LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock = open(HOST_NETWORK_LOCK, "a")  # noqa: SIM115 - held while the arena exists
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return lock
        except BlockingIOError as exc:
            if time.monotonic() > deadline:
                lock.close()
                raise RuntimeError(
                    f"{HOST_NETWORK_LOCK} held for {LOCK_WAIT_S:.0f} s (is `make compose` running?)"
                ) from exc
            time.sleep(1.0)


def _run(
    *argv: str, netns: str | None = None, check: bool = True, env: dict[str, str] | None = None, timeout_s: float = 30.0
) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(argv)
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env} if env else None
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
        )
    return result


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Network namespaces whose names start with ``prefix``."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove the namespaces and cgroups of arenas whose process is gone (a run killed with
    SIGKILL), and SIGKILL the processes still running in them (peers, the delay switch);
    returns the namespaces removed."""
    removed = []
    for ns in namespaces(prefix):
        owner = ns[len(prefix) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            _kill_all(_run("ip", "netns", "pids", ns, check=False).stdout.split())
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    for root in (CGROUP_V1, CGROUP_V2):
        for path in root.glob(f"{prefix}*") if root.is_dir() else ():
            owner = path.name[len(prefix) :].split("-", 1)[0]
            if owner.isdigit() and not _alive(int(owner)):
                with contextlib.suppress(OSError):
                    _kill_all((path / "cgroup.procs").read_text().split())
                with contextlib.suppress(OSError):
                    path.rmdir()
    return removed


def _kill_all(pids: list[str]) -> None:
    for pid in pids:
        if pid.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Arena:
    """``with Arena(peers) as arena``: the namespaces, links and caps of ``peers``; start
    processes in a peer with :meth:`popen` (a service listens on its peer's ``address``)."""

    def __init__(self, peers: list[PeerSpec]):
        if not peers or len(peers) > 250:
            raise ValueError(f"an arena holds 1 to 250 peers, got {len(peers)}")
        if len({p.name for p in peers}) != len(peers):
            raise ValueError("peer names must be unique")
        for p in peers:
            if not p.rate_mbit > 0 or p.one_way_ms < 0 or (p.cpus is not None and not p.cpus > 0):
                raise ValueError(f"peer {p.name!r}: rate must be > 0, latency >= 0 and cpus > 0 or None")
        global _ARENAS
        _ARENAS += 1
        self.id = f"{PREFIX}{os.getpid()}-{_ARENAS}"
        self.hub = f"{self.id}-hub"
        short = f"{os.getpid() % 100_000}{_ARENAS % 100}"  # interface names have 15 characters at most
        self.peers = {
            spec.name: Peer(spec, i, f"{self.id}-{i}", f"{SUBNET}.{i + 1}", f"a{short}p{i}", f"a{short}h{i}")
            for i, spec in enumerate(peers)
        }
        self._built = False
        self._switch: subprocess.Popen | None = None
        self._lock = None

    # ---------------------------------------------------------------- build and tear down
    def __enter__(self) -> Arena:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        try:
            self._lock = _hold_host_network()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        self._built = True
        cleanup_stale()
        _run("ip", "netns", "add", self.hub)
        _run("ip", "link", "set", "lo", "up", netns=self.hub)
        for peer in self.peers.values():
            _run("ip", "netns", "add", peer.netns)
            _run("ip", "link", "set", "lo", "up", netns=peer.netns)
            _run("ip", "link", "add", peer.veth_hub, "type", "veth", "peer", "name", peer.veth_peer, netns=self.hub)
            _run("ip", "link", "set", peer.veth_peer, "netns", peer.netns, netns=self.hub)
            _run("ip", "link", "set", peer.veth_hub, "mtu", str(MTU), "up", netns=self.hub)
            _run("ip", "addr", "add", f"{peer.address}/24", "dev", peer.veth_peer, netns=peer.netns)
            _run("ip", "link", "set", peer.veth_peer, "mtu", str(MTU), "up", netns=peer.netns)
            _run(
                sys.executable,
                "-c",
                f"from bench.delay_switch import transmit_checksum_off; transmit_checksum_off({peer.veth_peer!r})",
                netns=peer.netns,
                env={"PYTHONPATH": str(REPO)},
            )
            for netns, dev in ((peer.netns, peer.veth_peer), (self.hub, peer.veth_hub)):  # upload, download
                _run("tc", "qdisc", "add", "dev", dev, "root", *tbf_args(peer.spec.rate_mbit), netns=netns)
            if peer.spec.cpus is not None:
                peer.cgroup = _make_cgroup(f"{self.id}-{peer.index}", peer.spec.cpus)
        ports = [f"{p.veth_hub}:{p.spec.one_way_ms}" for p in self.peers.values()]
        self._switch = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, sys.executable, "-m", "bench.delay_switch", *ports],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            start_new_session=True,
            text=True,
        )
        ready = self._switch.stdout.readline()  # it prints its ports once its sockets are open
        if not ready.startswith('{"switch"'):
            raise RuntimeError(f"the arena's switch did not start: {ready.strip() or self._switch.wait(5)}")

    def stop_processes(self, first: tuple[str, ...] = ()) -> None:
        """Stop every process started in a peer, those of the peers ``first`` before the others
        (clients before their servers); the network stays."""
        for peer in sorted(self.peers.values(), key=lambda p: p.spec.name not in first):
            for proc in peer.processes:
                _stop(proc)
            peer.processes.clear()

    def close(self) -> None:
        """Stop every process, delete every namespace and cgroup; safe to call twice."""
        self.stop_processes()
        if not self._built:
            if self._lock is not None:
                self._lock.close()
                self._lock = None
            return
        if self._switch is not None:
            _stop(self._switch)
            self._switch.stdout.close()
            self._switch = None
        for peer in self.peers.values():
            _run("ip", "netns", "del", peer.netns, check=False)
            if peer.cgroup is not None:
                _remove_cgroup(peer.cgroup)
                peer.cgroup = None
        _run("ip", "netns", "del", self.hub, check=False)
        self._built = False
        if self._lock is not None:
            self._lock.close()  # releases the shared hold
            self._lock = None

    # ---------------------------------------------------------------- use
    def popen(
        self, peer: str, argv: list[str], *, env: dict[str, str] | None = None, log: Path | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``peer``'s namespace (and CPU cap), with this process's
        environment less its ``SWARM_*`` settings, plus ``env``; stopped by :meth:`close`."""
        p = self.peers[peer]
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            base = {
                k: v for k, v in os.environ.items() if not k.startswith("SWARM_")
            }  # the caller's swarm settings stay out
            proc = subprocess.Popen(
                ["ip", "netns", "exec", p.netns, *argv],
                env={**base, "PYTHONPATH": str(REPO), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if log:
                out.close()
        if p.cgroup is not None:
            _join_cgroup(p.cgroup, proc.pid)  # its children (ip netns exec execs in place) inherit it
        p.processes.append(proc)
        return proc

    def run(self, peer: str, argv: list[str], *, timeout_s: float = 30.0) -> str:
        """Run ``argv`` inside ``peer``'s namespace to its end; its stdout (RuntimeError if it fails)."""
        return _run(*argv, netns=self.peers[peer].netns, env={"PYTHONPATH": str(REPO)}, timeout_s=timeout_s + 5).stdout

    def kill(self, peer: str, proc: subprocess.Popen) -> None:
        """SIGKILL ``proc`` (a process :meth:`popen` started in ``peer``) and its children: a crash."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.peers[peer].processes.remove(proc)

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes each peer sent and received on its link so far, read from the hub's side of
        its veth (what the peer sent arrives there: the hub's ``rx``)."""
        import json

        links = json.loads(_run("ip", "-j", "-s", "link", "show", netns=self.hub).stdout)
        by_name = {link["ifname"]: link["stats64"] for link in links if "stats64" in link}
        return {
            name: {"sent": by_name[p.veth_hub]["rx"]["bytes"], "received": by_name[p.veth_hub]["tx"]["bytes"]}
            for name, p in self.peers.items()
            if p.veth_hub in by_name
        }

    def qdiscs(self) -> dict[str, str]:
        """The tbf lines of every shaped interface, as ``tc`` shows them (peer -> upload | download)."""
        shown = {}
        for name, peer in self.peers.items():
            up = _run("tc", "qdisc", "show", "dev", peer.veth_peer, netns=peer.netns, check=False).stdout.strip()
            down = _run("tc", "qdisc", "show", "dev", peer.veth_hub, netns=self.hub, check=False).stdout.strip()
            shown[name] = f"{up} | {down}"
        return shown


def tbf_args(rate_mbit: float) -> list[str]:
    """A token bucket at ``rate_mbit``: burst at least one timer tick of the rate (else it
    cannot reach it) and two of the arena's largest frames, a queue of up to 2 s."""
    burst = max(2 * (MTU + 14), int(rate_mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "2000ms"]


def wait_listening(arena: Arena, peer: str, host: str, port: int, timeout_s: float = 10.0) -> None:
    """Until something accepts TCP connections on ``host:port`` inside ``peer`` (bounded)."""
    deadline = time.monotonic() + timeout_s
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=0.5).close()"
    while True:
        if _run(sys.executable, "-c", probe, netns=arena.peers[peer].netns, check=False).returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on {host}:{port} in {peer} after {timeout_s} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace_s)


def _make_cgroup(name: str, cpus: float) -> Path:
    quota = max(1000, int(cpus * CFS_PERIOD_US))
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        path = CGROUP_V1 / name
        path.mkdir()
        (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(quota))
        return path
    if (CGROUP_V2 / "cgroup.controllers").exists() and "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text().split():
        path = CGROUP_V2 / name
        path.mkdir()
        (path / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
        return path
    raise RuntimeError("no cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max) to cap a peer's CPU")


def _join_cgroup(path: Path, pid: int) -> None:
    (path / "cgroup.procs").write_text(str(pid))


def _remove_cgroup(path: Path) -> None:
    procs = path / "cgroup.procs"
    for _ in range(50):  # its processes were stopped; the directory goes once they are reaped
        with contextlib.suppress(OSError):
            if procs.exists() and procs.read_text().split():
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            path.rmdir()
            return
        time.sleep(0.1)


def measure_link(arena: Arena, src: str, dst: str, *, port: int = 7000, seconds: float = 3.0, pings: int = 20) -> dict:
    """The path from ``src`` to ``dst`` as the arena built it: a bulk transfer into ``dst``
    (about ``seconds`` long at the set rate) and a ping-pong. The set figures are the slower
    end's rate and twice the sum of the two links' latencies."""
    import json

    a, b = arena.peers[src], arena.peers[dst]
    rate = min(a.spec.rate_mbit, b.spec.rate_mbit)
    server = arena.popen(
        dst, [sys.executable, "-m", "bench.arena_probe", "serve", "--host", b.address, "--port", str(port)]
    )
    try:
        wait_listening(arena, src, b.address, port)
        to, env = f"{b.address}:{port}", {"PYTHONPATH": str(REPO)}
        nbytes = max(2**20, int(rate * 1e6 / 8 * seconds))
        sent = json.loads(
            _run(
                sys.executable,
                "-m",
                "bench.arena_probe",
                "send",
                "--to",
                to,
                "--bytes",
                str(nbytes),
                netns=a.netns,
                env=env,
            ).stdout
        )
        rtt = json.loads(
            _run(
                sys.executable,
                "-m",
                "bench.arena_probe",
                "ping",
                "--to",
                to,
                "--count",
                str(pings),
                netns=a.netns,
                env=env,
            ).stdout
        )
    finally:
        _stop(server)
        b.processes.remove(server)
    return {
        "from": src,
        "to": dst,
        "set_mbit": rate,
        "mbit_s": round(sent["mbit_s"], 2),
        "bytes": sent["bytes"],
        "set_rtt_ms": 2 * (a.spec.one_way_ms + b.spec.one_way_ms),
        "rtt_ms": round(rtt["rtt_ms_median"], 2),
        "rtt_ms_min": round(rtt["rtt_ms_min"], 2),
        "rtt_ms_max": round(rtt["rtt_ms_max"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.arena_net links``: build two-peer arenas at the given rates and
    latency and print each path as measured; ``cleanup``: remove what killed runs left."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m bench.arena_net", description=main.__doc__.split(";")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    links = sub.add_parser("links", help="measure two-peer links as the arena builds them")
    links.add_argument("--rates", default="10,50,200", help="Mbit/s, comma-separated (default 10,50,200)")
    links.add_argument(
        "--one-way-ms",
        type=float,
        default=10.0,
        help="one-way latency of each peer's link: 2 x 10 ms = 20 ms one way peer to peer (default 10)",
    )
    sub.add_parser("cleanup", help="remove the namespaces and cgroups of arenas whose process is gone")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"arena: skipped: {why}", file=sys.stderr)
        return 0 if args.cmd == "cleanup" else 2
    if args.cmd == "cleanup":
        print(json.dumps({"removed": cleanup_stale()}))
        return 0
    for rate in (float(r) for r in args.rates.split(",")):
        with Arena([PeerSpec("a", rate, args.one_way_ms), PeerSpec("b", rate, args.one_way_ms)]) as arena:
            print(json.dumps(measure_link(arena, "a", "b")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
