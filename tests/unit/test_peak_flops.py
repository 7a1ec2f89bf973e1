"""The device peak MFU divides by (``shared.peak_flops``): a setting, a known GPU's datasheet
figure, or a probe measured once per machine and cached."""

from __future__ import annotations

import json

import pytest

from shared import peak_flops
from shared.peak_flops import Peak, probe_flops, resolve_peak, sustained_flops, table_peak


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),  # SXM
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA H200 NVL", "fp32", 60.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L4", "bf16", 121.0),
    ],
)
def test_known_gpus_have_their_dense_datasheet_peak(name, precision, tflops):
    assert table_peak(name, precision) == pytest.approx(tflops * 1e12)


def test_unknown_gpus_and_precisions_are_not_guessed():
    assert table_peak("NVIDIA GeForce GTX 1080", "fp32") is None
    assert table_peak("NVIDIA H100 80GB HBM3", "fp8") is None


def test_the_setting_wins():
    peak = resolve_peak("cpu", "fp32", threads=2, setting_tflops=1.5)
    assert (peak.flops, peak.source) == (1.5e12, "setting") and "SWARM_PEAK_TFLOPS" in peak.device


def test_a_cpu_probe_runs_once_per_machine_and_counts_the_threads_in_use(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peak_flops, "probe_flops", lambda device, precision: calls.append(precision) or 5e10)
    one = resolve_peak("cpu", "fp32", threads=1, cache_dir=tmp_path)
    two = resolve_peak("cpu", "fp32", threads=2, cache_dir=tmp_path)  # another server, a rejoin: read back
    assert calls == ["fp32"]
    assert one == Peak(5e10, "probe", one.device) and one.device.endswith("fp32 x 1 thread")
    assert (two.flops, two.source) == (1e11, "probe") and two.device.endswith("x 2 threads")
    (value,) = json.loads((tmp_path / "peak_flops.json").read_text()).values()
    assert value == 5e10


def test_a_probe_measures_a_rate_and_leaves_the_threads_as_they_were():
    threads = peak_flops.torch.get_num_threads()
    assert probe_flops(peak_flops.torch.device("cpu"), "fp32", budget_s=0.02) > 0
    assert peak_flops.torch.get_num_threads() == threads


def test_a_joiner_s_speed_is_its_work_over_wall_clock_time_where_the_peak_is_its_best_product(monkeypatch):
    """A CPU cap lets a process compute in bursts: here every product takes 1 ms and every
    second one waits 9 ms more, as a throttled process does. The peak probe keeps its best
    product (1 ms); the sustained rate, what a joiner declares, counts the waits too."""
    now = [0.0]
    calls = [0]

    def product(a, b):
        calls[0] += 1
        now[0] += 0.001 + (0.009 if calls[0] % 2 == 0 else 0.0)
        return a

    monkeypatch.setattr(peak_flops.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(peak_flops.torch, "mm", product)
    cpu = peak_flops.torch.device("cpu")
    one_product = 2 * peak_flops.PROBE_SIZE["cpu"] ** 3
    assert probe_flops(cpu, "fp32", budget_s=0.5) == pytest.approx(one_product / 0.001)
    threads = peak_flops.torch.get_num_threads()
    assert sustained_flops(cpu, "fp32", budget_s=0.5) == pytest.approx(one_product / 0.0055, rel=0.02)
    assert peak_flops.torch.get_num_threads() == threads
