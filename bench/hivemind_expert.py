"""hivemind's side of the hop and codec benches, where hivemind is installed (``pip install -e ".[bench]"``).

``python -m bench.hivemind_expert --address-file FILE``: a hivemind ``Server`` in its own
process (as the mesh's stage server is), with its DHT and p2p daemon on 127.0.0.1 only
(NAT port mapping, AutoNAT and relays off, no bootstrap peers), serving the hop bench's
stage (the same ``build_stage`` module, same dimensions and seed) as two experts: one whose
inputs, outputs and gradients travel with hivemind's 8-bit blockwise compression
(``BLOCKWISE_8BIT``), one uncompressed (``NONE``). It writes its peer id and addresses to
FILE once ready and serves until SIGTERM, then shuts its server and DHT down.

:class:`HivemindHops` is the client in the bench process: it starts that server, calls the
experts through ``RemoteExpert`` (forward, then backward through autograd) and, on exit,
stops its own p2p daemon and hivemind's client event-loop thread, stops the server, and
kills whatever is left in the server's process group. Every wait is bounded.

hivemind 1.1.12 decodes its 8-bit formats with ``int()`` on a one-element array, which
numpy >= 2.4 refuses (TypeError); :func:`use_blockwise_decode_fix` then registers the same
blockwise decode with that one read fixed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch

from shared.model import build_stage, config_from_preset

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# p2p daemon settings: listen on loopback, probe nothing outside (no UPnP/NAT-PMP, AutoNAT or relays)
P2P_LOCAL = {"host_maddrs": [LOOPBACK], "nat_port_map": False, "auto_nat": False, "use_relay": False}
EXPERTS = {"int8": "int8.0", "fp32": "fp32.0"}  # our codec -> the expert sending hivemind's closest format
START_TIMEOUT_S = 120.0  # torch + hivemind imports and two p2p daemons on 2 busy cores
STOP_TIMEOUT_S = 20.0


def installed() -> bool:
    return importlib.util.find_spec("hivemind") is not None


def compression_of(codec: str):
    """hivemind's compression for the experts standing in for our ``codec``."""
    from hivemind.proto import runtime_pb2

    return {"int8": runtime_pb2.BLOCKWISE_8BIT, "fp32": runtime_pb2.NONE}[codec]


def use_blockwise_decode_fix() -> bool:
    """Make hivemind's ``BLOCKWISE_8BIT`` decode work under numpy >= 2.4; returns whether it was needed.

    hivemind's own decode is kept where it works, so the bench measures hivemind unchanged."""
    from hivemind.compression import deserialize_torch_tensor, serialization, serialize_torch_tensor
    from hivemind.compression.quantization import BlockwiseQuantization
    from hivemind.proto import runtime_pb2

    try:
        deserialize_torch_tensor(serialize_torch_tensor(torch.ones(4096), runtime_pb2.BLOCKWISE_8BIT))
        return False
    except TypeError:
        pass

    class Numpy24BlockwiseQuantization(BlockwiseQuantization):
        """hivemind 1.1.12's ``BlockwiseQuantization.extract`` with the two header sizes read as scalars."""

        def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
            from bitsandbytes.functional import dequantize_blockwise

            buffer = serialized_tensor.buffer
            absmax_size, codebook_size = np.frombuffer(buffer, count=2, dtype=np.int64).tolist()
            absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
            codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=self.codebook_dtype)
            quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=self.indices_dtype)
            result = dequantize_blockwise(
                torch.as_tensor(quantized).reshape(tuple(serialized_tensor.size)),
                absmax=torch.as_tensor(absmax),
                code=torch.as_tensor(codebook),
                blocksize=4096,
                nested=False,
            )
            return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)

    serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = Numpy24BlockwiseQuantization()
    return True


# --- the server (its own process) ---


def serve(args: argparse.Namespace) -> int:
    """Serve the stage as hivemind experts until SIGTERM; write the address file once ready."""
    import hivemind
    from hivemind.moe.server import ModuleBackend, Server
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    torch.set_num_threads(1)
    use_blockwise_decode_fix()
    cfg = config_from_preset(args.model, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head)
    module = build_stage(cfg, args.stage, args.num_stages, args.seed)  # hidden (B, T, C) -> hidden (B, T, C)
    sample = (cfg.block_size, cfg.d_model)  # the schema's shape; hivemind checks structure and compression only
    backends = {
        uid: ModuleBackend(
            uid,
            module,
            args_schema=(BatchTensorDescriptor(*sample, compression=compression_of(codec)),),
            outputs_schema=BatchTensorDescriptor(*sample, compression=compression_of(codec)),
            max_batch_size=args.max_batch,
        )
        for codec, uid in EXPERTS.items()
    }
    dht = hivemind.DHT(start=True, **P2P_LOCAL)
    server = Server(dht, backends, num_connection_handlers=1, update_period=600)
    try:
        server.run_in_background(await_ready=True, timeout=START_TIMEOUT_S)
        # only now: the processes hivemind forked keep the default SIGTERM, which its shutdown sends them
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        threading.Thread(target=_stop_when_orphaned, args=(stop,), daemon=True).start()
        address = {"peer_id": dht.peer_id.to_base58(), "maddrs": [str(m) for m in dht.get_visible_maddrs()]}
        tmp = Path(args.address_file + ".tmp")
        tmp.write_text(json.dumps(address))
        tmp.rename(args.address_file)
        stop.wait()
    finally:
        server.shutdown()  # connection handlers, the DHT (and its p2p daemon), the runtime and its pools
        server.join(timeout=STOP_TIMEOUT_S)
        dht.shutdown()
    return 0


def _stop_when_orphaned(stop: threading.Event) -> None:
    """Set ``stop`` once the process that started this one is gone (a bench killed with
    SIGKILL cannot stop us): the server then shuts down as on SIGTERM."""
    parent = os.getppid()
    while not stop.wait(1.0):
        if os.getppid() != parent:
            stop.set()


# --- the client (the bench process) ---


class HivemindHops:
    """The hivemind server in a child process and ``RemoteExpert``s calling it from this process.

    ``dims``: the model preset and the dimensions that replace its own (``model``, ``d_model``,
    ``n_layer``, ``n_head``). ``procs`` is the bench's :class:`~bench.processes.BenchProcesses`:
    the server child carries the bench's run id, and so do both p2p daemons. ``deadline_s``
    bounds the whole use: past it the server's process group is killed, which fails a call in
    flight instead of hanging."""

    def __init__(self, procs, dims: dict, stage: int, num_stages: int, deadline_s: float):
        self.procs, self.dims, self.stage, self.num_stages = procs, dims, stage, num_stages
        self.deadline_s = deadline_s
        self.server: subprocess.Popen | None = None
        self.p2p = None
        self.experts: dict[str, object] = {}
        self._policy = None
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> "HivemindHops":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        from hivemind.moe.client.expert import RemoteExpert
        from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
        from hivemind.moe.expert_uid import ExpertInfo
        from hivemind.p2p import P2P, PeerID

        self._policy = asyncio.get_event_loop_policy()  # hivemind installs uvloop's; later benches get theirs back
        use_blockwise_decode_fix()
        address_file = self.procs.log_dir / f"hivemind-{os.getpid()}.json"
        address_file.unlink(missing_ok=True)
        dims = [f"--{k.replace('_', '-')}={v}" for k, v in self.dims.items()]
        args = [f"--address-file={address_file}", f"--stage={self.stage}", f"--num-stages={self.num_stages}"]
        self.server = self.procs.start("hivemind-server", ["bench.hivemind_expert", *args, *dims], {})
        self._watchdog = threading.Timer(self.deadline_s, self._kill_server)
        self._watchdog.daemon = True
        self._watchdog.start()
        address = self._wait_for(address_file)
        with _environ(SWARM_RUN_ID=self.procs.run_id):  # our p2p daemon carries the run id, as the server's do
            self.p2p = RemoteExpertWorker.run_coroutine(
                asyncio.wait_for(P2P.create(initial_peers=address["maddrs"], **P2P_LOCAL), START_TIMEOUT_S)
            )
        peer = PeerID.from_base58(address["peer_id"])
        self.experts = {codec: RemoteExpert(ExpertInfo(uid, peer), self.p2p) for codec, uid in EXPERTS.items()}

    def _wait_for(self, address_file: Path) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not address_file.exists():
            if self.server.poll() is not None:
                raise RuntimeError(f"the hivemind server exited ({self.server.returncode}); see its log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the hivemind server was not ready in {START_TIMEOUT_S:.0f} s; see its log")
            time.sleep(0.1)
        return json.loads(address_file.read_text())

    def hop(self, codec: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """One forward + backward through the ``codec`` expert; returns the input's gradient."""
        x = x.detach().requires_grad_(True)
        self.experts[codec](x).backward(g)
        return x.grad

    def _kill_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop our p2p daemon and hivemind's client thread, then the server and all it started."""
        from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.p2p is not None:
            with suppress(Exception):
                RemoteExpertWorker.run_coroutine(asyncio.wait_for(self.p2p.shutdown(), STOP_TIMEOUT_S))
            child = self.p2p._child
            if child is not None and child.returncode is None:
                with suppress(ProcessLookupError):
                    child.kill()
        _stop_remote_expert_worker()
        if self.server is not None:
            if self.server.poll() is None:
                self.server.send_signal(signal.SIGTERM)
                with suppress(subprocess.TimeoutExpired):
                    self.server.wait(timeout=STOP_TIMEOUT_S)
            with suppress(ProcessLookupError):  # its DHT, connection handler, pools and p2p daemon, if any is left
                os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(timeout=STOP_TIMEOUT_S)
        if self._policy is not None:
            asyncio.set_event_loop_policy(self._policy)


def _stop_remote_expert_worker() -> None:
    """Stop the event-loop thread that hivemind's ``RemoteExpert`` calls run on (it has no public stop;
    hivemind starts a new one on the next call)."""
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    thread, loop_future = RemoteExpertWorker._event_thread, RemoteExpertWorker._event_loop_fut
    if thread is None or not thread.is_alive():
        return
    loop = loop_future.result(timeout=STOP_TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=STOP_TIMEOUT_S)
    RemoteExpertWorker._event_thread = None


@contextmanager
def _environ(**values: str):
    """Environment variables set for the duration of a block (what a child started in it inherits)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hivemind_expert", description=__doc__.split("\n\n")[1])
    p.add_argument("--address-file", required=True, help="write the peer id and addresses here once ready")
    p.add_argument("--model", default="tiny", help="the preset whose dimensions the next options replace")
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-head", type=int, required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--num-stages", type=int, required=True)
    p.add_argument("--seed", type=int, default=0, help="the stage server's SWARM_SEED (default 0, as there)")
    p.add_argument("--max-batch", type=int, default=4096, help="rows (dim 0) per task at most")
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
