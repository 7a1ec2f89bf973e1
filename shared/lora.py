"""LoRA: low-rank adapters on a stage's linear layers, the base weights frozen.

``SWARM_LORA_RANK=R`` (``--lora-rank``) turns a stage's training into adapter training, as
``peft``'s ``LoraConfig`` does it: every parameter of the stage is frozen, and each target
linear layer ``W`` (Hugging Face module names, matched as peft matches them: a module's full
name equals a target or ends with ``.target``; ``all-linear``: every linear layer of the
blocks, not the LM head) computes ``W x + B A dropout(x) * alpha / R`` with ``A`` (R, in)
and ``B`` (out, R) trainable. ``A`` starts Kaiming-uniform (peft's init, drawn from
``(seed, parameter name)`` so that replicas and any cut of the model into stages start
alike), ``B`` at zero: the model starts as the base model. Activation gradients still
flow through the frozen layers to earlier stages.

Our parameter names gain ``<module>.lora_A`` and ``<module>.lora_B`` (``blocks.3.attn.wq.lora_A``);
peft's are ``base_model.model.<HF module>.lora_A.weight`` (:func:`peft_name`). GPT-2's
Conv1D layers take the same adapter tensors with ``fan_in_fan_out`` set.

The frozen base may be held in ``bf16`` or ``int8`` (bitsandbytes blockwise absmax codes,
dequantised at every use; CPU and CUDA) to save memory (``SWARM_LORA_BASE_DTYPE``); the
base's content fingerprint (:func:`base_fingerprint`: SHA-256 of the stage's base tensors as
loaded, in fp32) is taken before, and a state, checkpoint or export of adapters is refused on
a base whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.model import ModelConfig, StageSpec, stage_model

ALL_LINEAR = "all-linear"
BASE_DTYPES = ("fp32", "bf16", "int8")
INT8_BLOCK = 256  # values per absmax block of an int8 base weight
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


class LoraError(ValueError):
    """A LoRA setting that cannot apply to the model; the message names the setting."""


@dataclass(frozen=True)
class LoraConfig:
    """What every replica of a run must agree on (compared in states and checkpoints)."""

    rank: int
    alpha: float = 8.0  # peft's default lora_alpha; the adapters' output is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    base_dtype: str = "fp32"

    def __post_init__(self):
        if self.rank < 1:
            raise LoraError(f"SWARM_LORA_RANK must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"SWARM_LORA_DROPOUT must be in [0, 1), got {self.dropout}")
        if self.base_dtype not in BASE_DTYPES:
            raise LoraError(f"SWARM_LORA_BASE_DTYPE must be one of {BASE_DTYPES}, got {self.base_dtype!r}")
        if not self.target_modules or any(not t for t in self.target_modules):
            raise LoraError(f"SWARM_LORA_TARGET_MODULES needs module names, got {list(self.target_modules)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        """What must match between replicas (the base dtype is each server's own choice of memory)."""
        d = asdict(self)
        d.pop("base_dtype")
        d["target_modules"] = list(self.target_modules)
        return d

    @staticmethod
    def parse_targets(text: str) -> tuple[str, ...]:
        """``SWARM_LORA_TARGET_MODULES`` (comma-separated names) as the config's tuple."""
        return tuple(t.strip() for t in text.split(",") if t.strip())

    @classmethod
    def from_dict(cls, d: dict) -> LoraConfig:
        return cls(
            rank=int(d["rank"]),
            alpha=float(d["alpha"]),
            dropout=float(d["dropout"]),
            target_modules=tuple(d["target_modules"]),
        )


# ---------------------------------------------------------------- which modules
def _hf_module(cfg: ModelConfig, module: str) -> str:
    from shared.hf import hf_name

    return hf_name(cfg, module + ".weight").removesuffix(".weight")


def linear_modules(cfg: ModelConfig, spec: StageSpec | None = None) -> dict[str, tuple[int, int]]:
    """The linear layers of the blocks (of stage ``spec``, default: the whole model) that
    LoRA may target: our module name -> (in_features, out_features). Never the LM head."""
    from shared.model import whole_model

    with torch.device("meta"):
        model = stage_model(cfg, spec) if spec is not None else whole_model(cfg)
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.startswith("blocks.")
    }


def _matches(hf_module: str, target: str) -> bool:
    return hf_module == target or hf_module.endswith("." + target)


def target_modules(cfg: ModelConfig, lora: LoraConfig, spec: StageSpec | None = None) -> dict[str, tuple[int, int]]:
    """The modules (our names) of stage ``spec`` (default: the whole model) that ``lora``
    targets, with their (in, out); :class:`LoraError` for a target that names no module of
    the whole model, or a rank larger than a target's dimensions."""
    whole = linear_modules(cfg)
    hf = {name: _hf_module(cfg, name) for name in whole}
    if ALL_LINEAR in lora.target_modules:
        chosen = set(whole)
    else:
        chosen = set()
        for target in lora.target_modules:
            hits = {name for name in whole if _matches(hf[name], target)}
            if not hits:
                known = sorted({h.rsplit(".", 1)[-1] for h in hf.values()})
                raise LoraError(
                    f"SWARM_LORA_TARGET_MODULES: {target!r} names no linear layer of this {cfg.family} model; its "
                    f"layers are {known} (or '{ALL_LINEAR}')"
                )
            chosen |= hits
    for name in sorted(chosen):
        fan_in, fan_out = whole[name]
        if lora.rank > min(fan_in, fan_out):
            raise LoraError(
                f"SWARM_LORA_RANK={lora.rank} is larger than {hf[name]} allows ({fan_in} -> {fan_out}: at most "
                f"{min(fan_in, fan_out)})"
            )
    here = linear_modules(cfg, spec) if spec is not None else whole
    return {name: here[name] for name in sorted(chosen) if name in here}


def adapter_parameters(cfg: ModelConfig, lora: LoraConfig, spec: StageSpec | None = None) -> int:
    """Trainable values of stage ``spec`` (default: the whole model) under ``lora``."""
    return sum(lora.rank * (i + o) for i, o in target_modules(cfg, lora, spec).values())


# ---------------------------------------------------------------- the layer
class LoraLinear(nn.Linear):
    """A frozen linear layer plus its adapter. Keeps ``weight`` (and ``bias``) under their
    names, so the base's parameter names do not change; ``int8``: the weight is held as
    bitsandbytes codes and absmax buffers instead (``weight`` is then no parameter)."""

    def __init__(self, base: nn.Linear, lora: LoraConfig, generator: torch.Generator):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scaling, self.base_dtype = lora.scaling, lora.base_dtype
        weight = base.weight.detach()
        if lora.base_dtype == "int8":
            import bitsandbytes.functional as bnbf

            codes, state = bnbf.quantize_blockwise(weight.float().reshape(-1).contiguous(), blocksize=INT8_BLOCK)
            self.register_parameter("weight", None)
            self.register_buffer("weight_codes", codes)
            self.register_buffer("weight_absmax", state.absmax)
            self.register_buffer("weight_code", state.code)
        else:
            dtype = torch.bfloat16 if lora.base_dtype == "bf16" else weight.dtype
            self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.bias = base.bias
        device = weight.device
        a = torch.empty(lora.rank, self.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # peft's init of lora_A
        self.lora_A = nn.Parameter(a.to(device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, lora.rank, device=device))
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight is not None:
            return self.weight.to(dtype)
        import bitsandbytes.functional as bnbf

        flat = bnbf.dequantize_blockwise(
            self.weight_codes, absmax=self.weight_absmax, code=self.weight_code, blocksize=INT8_BLOCK
        )
        return flat.view(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.base_weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y + F.linear(F.linear(self.lora_dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * (
            self.scaling
        )

    def merged_weight(self) -> torch.Tensor:
        """W + B A alpha / r, fp32 (what ``--merge`` writes)."""
        with torch.no_grad():
            return self.base_weight(torch.float32) + (self.lora_B.float() @ self.lora_A.float()) * self.scaling


@dataclass(frozen=True)
class LoraReport:
    """What :func:`apply_lora` did to one stage."""

    targets: tuple[str, ...]  # our module names that got an adapter
    trainable: int  # adapter values
    frozen: int  # base values
    base_fingerprint: str


def apply_lora(model: nn.Module, cfg: ModelConfig, lora: LoraConfig, seed: int) -> LoraReport:
    """Freeze every parameter of stage ``model`` and put an adapter on each target module it
    holds (in place). A stage with no target module trains nothing (the report says so)."""
    spec = model.spec
    targets = target_modules(cfg, lora, spec)
    fingerprint = base_fingerprint(model)
    frozen = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}.lora_A".encode()))
        setattr(parent, attr, LoraLinear(getattr(parent, attr), lora, gen))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return LoraReport(tuple(targets), trainable, frozen, fingerprint)


def base_fingerprint(model: nn.Module) -> str:
    """SHA-256 of the stage's base parameters (names and fp32 values), adapters left out."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if ".lora_" in name:
            continue
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


# ---------------------------------------------------------------- peft out
def peft_name(cfg: ModelConfig, name: str) -> str:
    """peft's key of our adapter parameter ``blocks.i.<module>.lora_A`` (or ``lora_B``)."""
    module, _, kind = name.rpartition(".")
    if kind not in ("lora_A", "lora_B"):
        raise LoraError(f"{name!r} is not an adapter parameter")
    return f"{_PEFT_PREFIX}{_hf_module(cfg, module)}.{kind}.weight"


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def adapter_config(cfg: ModelConfig, lora: LoraConfig, modules: list[str], base_model: str = "") -> dict:
    """``adapter_config.json`` for ``peft.PeftModel.from_pretrained`` (targets by full name, as
    peft writes them for ``all-linear``)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(_hf_module(cfg, m) for m in modules),
        "bias": "none",
        "fan_in_fan_out": cfg.family == "gpt",  # GPT-2's Conv1D layers
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def save_peft(
    out_dir: str | Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoraConfig, base_model: str = ""
) -> list[Path]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` of ``adapters`` (our names)."""
    import safetensors.torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted({name.rpartition(".")[0] for name in adapters})
    tensors = {peft_name(cfg, n): t.detach().to("cpu", torch.float32).contiguous() for n, t in adapters.items()}
    config = out / ADAPTER_CONFIG
    config.write_text(json.dumps(adapter_config(cfg, lora, modules, base_model), indent=2) + "\n")
    weights = out / ADAPTER_WEIGHTS
    safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt"})
    return [config, weights]


def merge_into(params: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], lora: LoraConfig) -> None:
    """Add each adapter's ``B A alpha / r`` to its base weight in ``params`` (our names, fp32, in place)."""
    modules = sorted({name.rpartition(".")[0] for name in adapters})
    for module in modules:
        a, b = adapters[f"{module}.lora_A"].float(), adapters[f"{module}.lora_B"].float()
        w = params[f"{module}.weight"]
        params[f"{module}.weight"] = w.float() + (b @ a) * lora.scaling
