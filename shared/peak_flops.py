"""The peak FLOP/s of the device a process computes on: what MFU divides achieved model FLOP/s by.

Where the peak comes from (:attr:`Peak.source`), first that applies:

- ``setting``: a figure given (``SWARM_PEAK_TFLOPS`` > 0), for the precision the stage computes in;
- ``table``: a CUDA device known by name, at the vendor's dense figure for the precision
  (:data:`GPU_PEAK_TFLOPS`; the datasheets' "with sparsity" figures are twice these);
- ``probe``: measured. The best rate of repeated square matrix multiplications on the
  device in that precision, in at most :data:`PROBE_BUDGET_S` seconds (the best of many
  short runs, so a busy machine lowers it little). On a CPU it is measured with one thread
  and multiplied by the threads the process computes with: the peak of the threads in use,
  not of the machine. A probe's result is cached in a file per machine, device, precision
  and torch version (``$XDG_CACHE_HOME/swarm-mesh/peak_flops.json``), under a file lock, so
  it is measured once per machine, not by every server nor at every join.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PROBE_BUDGET_S = 0.25  # measuring time of one probe (the first multiplication, a warm-up, not included)
PROBE_SIZE = {"cpu": 512, "cuda": 4096}  # square matrices: 0.27 GFLOP (~2 ms at 120 GFLOP/s), 137 GFLOP
CACHE_NAME = "peak_flops.json"
# wall-clock seconds of a joiner's speed probe: five of the kernel's 100 ms CPU-quota periods,
# so that a cgroup cap shows (a probe inside one period runs at full speed)
SPEED_PROBE_S = 0.5

# Dense tensor-core (bf16) and plain FP32 (no TF32, torch's default for float32 matmuls)
# TFLOP/s from NVIDIA's datasheets; the first pattern that matches the device's name wins.
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*NVL", {"bf16": 835.0, "fp32": 60.0}),  # H100 NVL
    (r"H100.*PCIe", {"bf16": 756.0, "fp32": 51.0}),  # H100 PCIe
    (r"H100", {"bf16": 989.0, "fp32": 67.0}),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    (r"H200.*NVL", {"bf16": 835.0, "fp32": 60.0}),  # H200 NVL
    (r"H200", {"bf16": 989.0, "fp32": 67.0}),  # H200 SXM, GH200
    (r"A100", {"bf16": 312.0, "fp32": 19.5}),  # A100 SXM and PCIe, 40 and 80 GB
    (r"L40S", {"bf16": 362.0, "fp32": 91.6}),  # L40S
    (r"\bL4\b", {"bf16": 121.0, "fp32": 30.3}),  # L4
)


@dataclass(frozen=True)
class Peak:
    """A peak rate: FLOP/s of the whole process (every thread it computes with)."""

    flops: float
    source: str  # "setting", "table" or "probe"
    device: str  # what it is the peak of, e.g. "NVIDIA H100 80GB HBM3 bf16", "AMD EPYC fp32 x 1 thread"

    def to_json(self) -> dict:
        return {"peak_flops": self.flops, "peak_source": self.source, "peak_device": self.device}


def table_peak(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of a CUDA device known by its name, in ``precision``; None if unknown."""
    for pattern, tflops in GPU_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE) and precision in tflops:
            return tflops[precision] * 1e12
    return None


def resolve_peak(
    device: torch.device | str,
    precision: str,
    *,
    threads: int,
    setting_tflops: float = 0.0,
    cache_dir: Path | None = None,
) -> Peak:
    """The peak of ``device`` computing in ``precision`` ("fp32" or "bf16") with ``threads``
    torch threads (CPU): the setting if > 0, else the table's (CUDA), else a probe's (cached)."""
    device = torch.device(device)
    name = device_name(device)
    if setting_tflops > 0:
        return Peak(setting_tflops * 1e12, "setting", f"{name} {precision} (SWARM_PEAK_TFLOPS)")
    if device.type == "cuda" and (flops := table_peak(name, precision)) is not None:
        return Peak(flops, "table", f"{name} {precision}")
    per_unit = cached_probe(device, precision, cache_dir or default_cache_dir())
    if device.type == "cpu":
        return Peak(per_unit * threads, "probe", f"{name} {precision} x {threads} thread{'s' * (threads != 1)}")
    return Peak(per_unit, "probe", f"{name} {precision}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)[:100]
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()[:100]
    return platform.processor() or platform.machine() or "cpu"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm-mesh"


def cached_probe(device: torch.device, precision: str, cache_dir: Path) -> float:
    """:func:`probe_flops` of ``device`` (per thread on a CPU), measured once per machine: read
    from the cache file, else measured and written there. The lock makes servers that start
    together wait for one probe instead of each measuring the others' load."""
    key = f"{device_name(device)}|{device.type}|{precision}|torch {torch.__version__}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / CACHE_NAME
    with open(cache_dir / f"{CACHE_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read_cache(path)
        if key in cached:
            return float(cached[key])
        flops = probe_flops(device, precision)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, key: flops}, indent=1))
        tmp.replace(path)
        return flops


def _read_cache(path: Path) -> dict:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def probe_flops(device: torch.device, precision: str, budget_s: float = PROBE_BUDGET_S) -> float:
    """The best FLOP/s of ``n x n`` matrix products on ``device`` in ``precision`` over about
    ``budget_s`` seconds; on a CPU with one torch thread (the rate of one thread)."""
    with _products(device, precision) as (product, flops):
        best, deadline = 0.0, None
        while deadline is None or time.perf_counter() < deadline:
            _sync(device)
            started = time.perf_counter()
            product()
            elapsed = time.perf_counter() - started
            if deadline is None:  # the first product warms up (allocations, kernels): not counted
                deadline = time.perf_counter() + budget_s
                continue
            best = max(best, flops / elapsed)
    return best


def sustained_flops(device: torch.device, precision: str = "fp32", budget_s: float = SPEED_PROBE_S) -> float:
    """The FLOP/s this process gets now: every ``n x n`` product done in about ``budget_s``
    seconds of wall-clock time over those seconds (one thread on a CPU), not the best of
    them as :func:`probe_flops`. A CPU cap (a cgroup quota), or neighbours on the same
    cores, lower it as they lower the process's work: what a joining server declares as
    its speed (``SWARM_SPEED_FLOPS``). The first product, a warm-up, is not counted."""
    with _products(device, precision) as (product, flops):
        product()
        products, started = 0, time.perf_counter()
        while time.perf_counter() - started < budget_s:
            product()
            products += 1
        return products * flops / (time.perf_counter() - started)


@contextlib.contextmanager
def _products(device: torch.device, precision: str):
    """``(product, flops)``: a function that multiplies two ``n x n`` matrices on ``device``
    and waits for it, and the FLOPs of one product; on a CPU with one torch thread meanwhile."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    n = PROBE_SIZE["cuda" if device.type == "cuda" else "cpu"]
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))

    def product() -> None:
        torch.mm(a, b)
        _sync(device)

    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield product, 2 * n**3
    finally:
        torch.set_num_threads(threads)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
