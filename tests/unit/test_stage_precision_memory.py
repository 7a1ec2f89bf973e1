"""A stage's memory check at start, activation checkpointing and bf16 autocast in the runtime.

The CUDA path (bf16 autocast, a real device's free memory) runs only where a GPU is.
"""

from __future__ import annotations

import pytest
import torch

from services.stage_server.app import build_runtime
from services.stage_server.memory import BYTES_PER_PARAMETER, check_stage_memory, free_memory_bytes, stage_parameters
from services.stage_server.runtime import OptimizerConfig, StageRuntime
from shared.config import StageServerSettings
from shared.model import PRESETS, partition

GiB = 2**30


def settings(**kw) -> StageServerSettings:
    return StageServerSettings(**{"run_id": "t", "mdns": False, "coordinator": "", "wire_codec": "fp32", **kw})


def test_the_estimate_counts_the_stage_only():
    cfg = PRESETS["llama-7b"]
    specs = partition(cfg, 4)
    need = check_stage_memory(cfg, specs[1], "cpu", free_bytes=10**15)
    assert need == stage_parameters(cfg, specs[1]) * BYTES_PER_PARAMETER
    assert 8 * 202e6 < stage_parameters(cfg, specs[1]) < 9 * 203e6  # 8 of 32 layers, ~202M each


def test_a_stage_too_large_is_refused_naming_the_settings():
    cfg = PRESETS["llama-7b"]
    with pytest.raises(ValueError) as exc:
        check_stage_memory(cfg, partition(cfg, 1)[0], "cuda:0", free_bytes=80 * GiB)  # 7B x 24 bytes > 80 GiB
    message = str(exc.value)
    assert "SWARM_NUM_STAGES" in message and "SWARM_MEMORY_CHECK" in message and "cuda:0" in message
    check_stage_memory(cfg, partition(cfg, 8)[3], "cuda:0", free_bytes=80 * GiB)  # an eighth fits


def test_the_kept_weights_versions_are_counted_and_named_in_the_refusal():
    cfg = PRESETS["llama-7b"]
    spec = partition(cfg, 8)[3]
    params = stage_parameters(cfg, spec)
    assert check_stage_memory(cfg, spec, "cpu", max_staleness=2, free_bytes=10**15) == params * (
        BYTES_PER_PARAMETER + 2 * 4
    )
    fits_one_version = params * BYTES_PER_PARAMETER + 1
    check_stage_memory(cfg, spec, "cuda:0", max_staleness=0, free_bytes=fits_one_version)
    with pytest.raises(ValueError, match="SWARM_MAX_STALENESS") as exc:
        check_stage_memory(cfg, spec, "cuda:0", max_staleness=1, free_bytes=fits_one_version)
    assert "1 older weights versions" in str(exc.value)


def test_on_this_cpu_the_check_reads_free_memory_and_refuses_a_whole_7b_before_allocating():
    free = free_memory_bytes("cpu")
    if free is None:
        pytest.skip("no /proc/meminfo: free CPU memory is unknown here, the check is skipped")
    if free > 6.8e9 * BYTES_PER_PARAMETER:
        pytest.skip(f"this machine has {free / GiB:.0f} GiB free: a whole 7B fits")
    with pytest.raises(ValueError, match="SWARM_NUM_STAGES"):
        build_runtime(settings(model="llama-7b", num_stages=1, stage=0))  # fails on the meta count, in milliseconds
    assert build_runtime(settings(model="tiny", num_stages=4, stage=1)).step == 0


def test_bf16_needs_cuda():
    with pytest.raises(ValueError, match="SWARM_PRECISION"):
        settings(precision="bf16")


def runtime_grads(**kw) -> dict[str, torch.Tensor]:
    cfg = PRESETS["llama-tiny"]
    rt = StageRuntime(cfg, 1, 4, seed=0, optim=OptimizerConfig(global_batch=10**6), **kw)
    gen = torch.Generator().manual_seed(0)
    hidden, grad = torch.randn(2, 16, cfg.d_model, generator=gen), torch.randn(2, 16, cfg.d_model, generator=gen)
    result = rt.backward("mb", 0, hidden.to(rt.device), None, grad.to(rt.device))
    return {"input": result.grad_inputs.cpu(), **{k: v.cpu() for k, v in rt.accumulated_gradients().items()}}


def test_activation_checkpointing_in_a_stage_gives_the_same_gradients():
    plain, checkpointed = runtime_grads(), runtime_grads(activation_checkpointing=True)
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6), name


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the bf16/CUDA path is untested on this machine"
)
def test_a_cuda_stage_in_bf16_with_checkpointing_runs_steps_and_keeps_fp32_weights():
    cpu = runtime_grads()
    cuda = runtime_grads(device="cuda", precision="bf16", activation_checkpointing=True)
    for name in cpu:  # bf16 compute: close, not equal
        cos = torch.nn.functional.cosine_similarity(cpu[name].flatten(), cuda[name].flatten().float(), dim=0)
        assert cos > 0.98, f"{name}: cosine {cos:.3f}"
    rt = build_runtime(
        settings(
            model="llama-tiny",
            num_stages=2,
            stage=1,
            device="cuda",
            precision="bf16",
            activation_checkpointing=True,
            global_batch=2,
        )
    )
    assert all(p.dtype == torch.float32 and p.is_cuda for p in rt.params)
    hidden = torch.randn(2, 16, rt.cfg.d_model, device="cuda")
    targets = torch.randint(0, rt.cfg.vocab_size, (2, 16), device="cuda")
    rt.backward("a", 0, hidden, targets, None)  # the global batch: one step
    assert rt.step == 1 and torch.isfinite(torch.tensor(rt.stats.last_grad_norm))
    check_stage_memory(rt.cfg, rt.spec, "cuda")  # the real device's free memory
