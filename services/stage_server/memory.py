"""Will a stage fit its device? Checked at start, before any weight is allocated, so that a
stage too large fails with a message naming the settings instead of an out-of-memory error
later (petals#308).

The estimate counts the stage's parameters (on the meta device: no memory) times
:data:`BYTES_PER_PARAMETER`: fp32 weights, the gradient the optimizer step sets, AdamW's
two moments and two gradient buckets (the step being filled and the next), and the older weights versions
kept for backwards in flight (``SWARM_MAX_STALENESS`` of them at most). Activations
come on top and depend on the trainers' microbatches, which a server does not know: the
check is a floor, not a promise. Free memory: ``torch.cuda.mem_get_info`` on CUDA,
``MemAvailable`` of ``/proc/meminfo`` on CPU (Linux); where neither is known the check
is skipped.

With LoRA (``SWARM_LORA_RANK``) the per-parameter bytes count for the adapters only; the
frozen base counts its own dtype's bytes (fp32 4, bf16 2, int8 about 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model import ModelConfig, StageSpec, stage_model

BYTES_PER_PARAMETER = 4 * (1 + 1 + 2 + 2)
BYTES_PER_KEPT_VERSION = 4  # an older weights version kept for the backwards of forwards in flight (fp32)
BASE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 256}  # a frozen base value under LoRA (int8: + absmax)


def stage_parameters(cfg: ModelConfig, spec: StageSpec) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in stage_model(cfg, spec).parameters())


def free_memory_bytes(device: str | torch.device) -> int | None:
    """Free memory of ``device`` in bytes, or None where it cannot be known."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_stage_memory(
    cfg: ModelConfig,
    spec: StageSpec,
    device: str | torch.device,
    *,
    max_staleness: int = 0,
    free_bytes: int | None = None,
    lora=None,
) -> int:
    """The stage's estimated need in bytes, with ``max_staleness`` older weights versions kept
    for backwards in flight (fp32 each); ValueError naming the settings if ``device`` has less
    free (``free_bytes``, default: measured)."""
    params = stage_parameters(cfg, spec)
    per_parameter = BYTES_PER_PARAMETER + BYTES_PER_KEPT_VERSION * max_staleness
    if lora is None:
        need = params * per_parameter
    else:
        from shared.lora import adapter_parameters

        need = int(params * BASE_BYTES[lora.base_dtype] + adapter_parameters(cfg, lora, spec) * per_parameter)
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    if free is not None and need > free:
        raise ValueError(
            f"stage {spec.index} of {spec.num_stages} ({params / 1e6:,.0f}M parameters, layers "
            f"{spec.layers.start}..{spec.layers.stop - 1}) needs about {need / 2**30:.1f} GiB ({per_parameter} "
            f"bytes per {'adapter ' if lora else ''}parameter: fp32 weights, gradient, AdamW moments, gradient "
            "buckets, and "
            f"{max_staleness} older weights versions for backwards in flight; activations on top) but "
            f"{device} has {free / 2**30:.1f} GiB free: cut the model into more stages (SWARM_NUM_STAGES), keep fewer "
            "versions (SWARM_MAX_STALENESS), use a device with more memory (SWARM_DEVICE), or skip this check "
            "(SWARM_MEMORY_CHECK=false)"
        )
    return need
