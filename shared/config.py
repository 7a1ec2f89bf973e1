"""Service configuration: one frozen settings object per service, read from ``SWARM_*``.

Every field can be set by an environment variable ``SWARM_<FIELD>`` (e.g.
``SWARM_NUM_STAGES=4``) or by the matching command-line flag, which wins. Units are in
the names (``_s`` seconds, ``_mb`` mebibytes).

Where a flat list grew, settings are grouped in small frozen sections (:class:`Section`):
``settings.placement.min_gain``, ``settings.inject.delay_s``. A section's fields keep their
flat names everywhere outside the code: ``SWARM_PLACEMENT_MIN_GAIN``, ``--placement-min-gain``
and the keyword ``placement_min_gain=`` set ``placement.min_gain``; the section's own name
sets its ``BARE`` field (``SWARM_PLACEMENT=topology``: ``placement.mode``). Errors name the
flat name too.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from shared.codec import DEFAULT_INT8_BLOCK, FLOAT_CODECS, INT8_BLOCK_SIZES
from shared.model import PRESETS, ModelConfig, config_from_preset

Codec = Literal["fp32", "fp16", "bf16", "int8", "int4"]
assert set(Codec.__args__) == set(FLOAT_CODECS)

# ``json_schema_extra`` of a fault-injection setting (``inject_*``): read from SWARM_* and its
# flag like any other, but for the tests only, and left out of the production CLIs' --help.
TEST_ONLY = {"test_only": True}


def is_test_only(field: FieldInfo) -> bool:
    """Whether ``field`` is a test-only (fault-injection) setting."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("test_only"))


class Section(BaseModel):
    """A small group of settings under one name (``placement``), set by flat names: field
    ``min_gain`` of section ``placement`` is ``SWARM_PLACEMENT_MIN_GAIN`` / ``--placement-min-gain``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    BARE: ClassVar[str] = ""  # the field set by the section's own name (SWARM_PLACEMENT: placement.mode)


class PlacementSettings(Section):
    """How the coordinator places servers on stages (joins and rebalancing)."""

    BARE: ClassVar[str] = "mode"

    mode: Literal["auto", "throughput", "topology"] = Field(
        "auto",
        description=(
            "how servers are placed on stages (joins and rebalancing): 'throughput' balances stage capacities; "
            "'topology' plans with the network cost model (measured RTTs, regions, model size); 'auto': topology once "
            "servers report RTTs or regions"
        ),
    )
    min_gain: float = Field(
        0.05,
        ge=0,
        le=10,
        description=(
            "topology placement: move servers only if the predicted step time falls by this fraction (on two "
            "consecutive checks)"
        ),
    )
    max_moves: float = Field(
        0.2,
        gt=0,
        le=1,
        description="topology placement: at most this fraction of the servers (at least 1) moves per rebalancing",
    )
    budget_s: float = Field(
        3.0,
        gt=0,
        le=60,
        description="topology placement: planner time per rebalancing check (a join gets a fifth of it)",
    )
    bandwidth_gbps: float = Field(
        1.0,
        gt=0,
        description="topology placement: bandwidth assumed between servers of unknown or unlisted regions (Gbit/s)",
    )


class LoraSettings(Section):
    """LoRA fine-tuning (``shared.lora``): low-rank adapters on the frozen model; the same on
    every server of a run, except ``base_dtype``."""

    rank: int = Field(
        0,
        ge=0,
        le=4096,
        description=(
            "LoRA rank: train low-rank adapters on the target modules of the frozen model (only the adapters' "
            "gradients go into step rounds, only their optimizer state exists); 0: train every weight"
        ),
    )
    alpha: float = Field(8.0, gt=0, description="LoRA alpha: the adapters' output is scaled by alpha / rank (peft's)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (peft's lora_dropout)")
    target_modules: str = Field(
        "all-linear",
        description=(
            "comma-separated Hugging Face module names the adapters go on, matched as peft matches them (a module's "
            "name or its last parts, e.g. q_proj,v_proj); 'all-linear': every linear layer of the blocks"
        ),
    )
    base_dtype: Literal["fp32", "bf16", "int8"] = Field(
        "fp32",
        description=(
            "how the frozen base weights are held: fp32, bf16, or int8 (bitsandbytes blockwise codes, dequantised at "
            "each use): less memory, the adapters and their optimizer state stay fp32"
        ),
    )

    def config(self):
        """The adapters' ``shared.lora.LoraConfig``, or None when LoRA is off."""
        from shared.lora import LoraConfig

        if not self.rank:
            return None
        targets = LoraConfig.parse_targets(self.target_modules)
        return LoraConfig(self.rank, self.alpha, self.dropout, targets, self.base_dtype)


class FaultInjection(Section):
    """TEST ONLY: faults a stage server injects into its own work, for the chaos and service
    tests (``SWARM_INJECT_*``); every field is marked test-only and left out of ``--help``."""

    delay_s: float = Field(
        0.0,
        ge=0,
        description=(
            "TEST ONLY (fault injection): extra seconds per request and forward pass of work (a backward counts 2, "
            "the last stage's 3)"
        ),
        json_schema_extra=TEST_ONLY,
    )
    garbage: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "TEST ONLY (fault injection): probability that a /forward or /backward reply body is replaced by random "
            "bytes (tests of a replica that returns garbage)"
        ),
        json_schema_extra=TEST_ONLY,
    )
    byzantine: Literal["", "sign_flip", "scale", "random"] = Field(
        "",
        description=(
            "TEST ONLY (fault injection): send these values into averaging rounds instead of the parameters (tests "
            "of robust averaging)"
        ),
        json_schema_extra=TEST_ONLY,
    )
    byzantine_factor: float = Field(
        1000.0,
        gt=0,
        description="TEST ONLY (fault injection): the factor of inject_byzantine",
        json_schema_extra=TEST_ONLY,
    )


def _sections(cls: type[BaseModel]) -> dict[str, type[Section]]:
    """The section fields of ``cls``: name -> section model."""
    return {
        name: field.annotation
        for name, field in cls.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section)
    }


def _flat_name(section: str, model: type[Section], field: str) -> str:
    return section if field == model.BARE else f"{section}_{field}"


def settings_fields(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    """Every setting of ``cls`` by its flat name (``SWARM_<NAME>``, ``--<name>``), in order;
    a section's fields stand in for the section (``placement_min_gain``: ``placement.min_gain``)."""
    sections, fields = _sections(cls), {}
    for name, field in cls.model_fields.items():
        if name not in sections:
            fields[name] = field
            continue
        for inner, inner_field in sections[name].model_fields.items():
            fields[_flat_name(name, sections[name], inner)] = inner_field
    return fields


def _section_paths(cls: type[BaseModel]) -> dict[str, tuple[str, str]]:
    """The flat name of each section field of ``cls`` -> (section, field)."""
    return {
        _flat_name(section, model, field): (section, field)
        for section, model in _sections(cls).items()
        for field in model.model_fields
    }


def _nest_flat_keys(cls: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (keywords) with flat section keys moved into their sections, which they override:
    ``placement_min_gain=0.1`` -> ``placement={"min_gain": 0.1}``; ``placement="topology"`` (not a
    dict or section) -> ``placement={"mode": "topology"}``. A section given whole becomes the dict of
    the fields it sets, so the environment still fills in the others, as it does for flat keys."""
    paths, sections = _section_paths(cls), _sections(cls)
    nested: dict[str, dict[str, Any]] = {}
    out = {}
    for key, value in values.items():
        if key in paths and not (key in sections and isinstance(value, (dict, Section))):
            section, field = paths[key]
            nested.setdefault(section, {})[field] = value
        elif isinstance(value, Section) and key in sections:
            out[key] = value.model_dump(exclude_unset=True)
        else:
            out[key] = value
    for section, fields in nested.items():
        out[section] = {**out.get(section, {}), **fields}
    return out


def _with_flat_names(cls: type[BaseModel], exc: ValidationError) -> ValidationError:
    """``exc`` with each error in a section located by the flat name (``placement.min_gain`` ->
    ``placement_min_gain``), the name the setting is set by."""
    sections = _sections(cls)
    errors = exc.errors(include_url=False)
    if not any(len(e["loc"]) > 1 and e["loc"][0] in sections for e in errors):
        return exc
    details = []
    for e in errors:
        loc = e["loc"]
        if len(loc) > 1 and loc[0] in sections:
            loc = (_flat_name(loc[0], sections[loc[0]], str(loc[1])), *loc[2:])
        details.append(
            {"type": e["type"], "loc": loc, "input": e["input"], **({"ctx": e["ctx"]} if "ctx" in e else {})}
        )
    return ValidationError.from_exception_data(exc.title, details)


class _SectionedEnvSource(EnvSettingsSource):
    """The ``SWARM_*`` environment, with a section's fields read by their flat names
    (``SWARM_PLACEMENT_MIN_GAIN`` -> ``placement.min_gain``, ``SWARM_PLACEMENT`` -> its ``BARE``
    field) instead of the section as one JSON variable."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if field_name in _sections(self.settings_cls):
            return None, field_name, False  # filled in by __call__
        return super().get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        for flat, (section, field) in _section_paths(self.settings_cls).items():
            value = self.env_vars.get(self._apply_case_sensitive(f"{self.env_prefix}{flat}"))
            if value is not None:
                data.setdefault(section, {})[field] = value
        return data


class CommonSettings(BaseSettings):
    """Settings every service reads."""

    model_config = SettingsConfigDict(env_prefix="SWARM_", frozen=True, extra="forbid")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**_nest_flat_keys(type(self), values))
        except ValidationError as exc:
            raise _with_flat_names(type(self), exc) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _SectionedEnvSource(settings_cls), dotenv_settings, file_secret_settings

    run_id: str = Field("local", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    num_threads: int = Field(1, ge=1, le=256, description="torch threads per process")
    device: str = "cpu"
    secret: SecretStr = Field(
        SecretStr(""),
        description=(
            "the swarm's shared secret: every request but GET /health "
            "and /metrics is signed with it (HMAC); empty: no signing"
        ),
    )
    secret_file: str = Field("", description="file holding the swarm's secret (instead of SWARM_SECRET)")
    auth_max_skew_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="signed requests older or newer than this (by the receiver's clock) are refused",
    )
    tls_cert_file: str = Field("", description="PEM certificate: serve HTTPS (with tls_key_file); URLs become https://")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file")
    tls_ca_file: str = Field(
        "",
        description=(
            "PEM certificates trusted when calling other services (e.g. "
            "a self-signed swarm certificate); empty: the system's"
        ),
    )

    def secret_bytes(self) -> bytes | None:
        """The swarm secret (from ``secret`` or ``secret_file``), or None: requests are not signed."""
        from shared.auth import load_secret

        return load_secret(self.secret.get_secret_value(), self.secret_file)

    @model_validator(mode="after")
    def _security(self):
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("SWARM_TLS_CERT_FILE and SWARM_TLS_KEY_FILE go together")
        self.secret_bytes()  # a secret too short, or a file that cannot be read, fails here, at start
        return self

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError(f"SWARM_DEVICE must be 'cpu' or 'cuda[:N]', got {v!r}")
        return v


class DiscoverySettings(CommonSettings):
    """How a service finds the coordinator and keeps its lease."""

    coordinator: str = Field("", description="coordinator URL; empty: find one by mDNS on the LAN")
    mdns: bool = Field(True, description="announce and browse with mDNS (zeroconf); off across regions")
    mdns_interfaces: str = Field(
        "all", description="'all' or comma-separated IPv4 addresses of the interfaces mDNS uses"
    )
    mdns_timeout_s: float = Field(10.0, gt=0, description="how long to look for a coordinator by mDNS")
    heartbeat_s: float = Field(2.0, gt=0, description="seconds between heartbeats; a lease expires after 3 missed")

    @field_validator("coordinator")
    @classmethod
    def _coordinator_url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"SWARM_COORDINATOR must be an http(s) URL, got {v!r}")
        return v.rstrip("/")


class ModelSettings(CommonSettings):
    """What every member of a run must agree on: the model, its cut and the wire."""

    model: str = Field(
        "tiny",
        description=(
            "a model preset (tiny, small, base, medium, large, xl; llama-tiny, llama-10m, llama-135m, llama-1b, "
            "llama-7b) or a Hugging Face model directory (config.json + safetensors); members of a run compare the "
            "model's config, not the path"
        ),
    )
    num_stages: int = Field(4, ge=1, le=1024)
    seed: int = Field(0, ge=0, lt=2**31)
    wire_codec: Codec = "int8"
    int8_block: int = DEFAULT_INT8_BLOCK

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        from shared.hf import is_hf_dir, read_hf_config

        if v in PRESETS:
            return v
        if is_hf_dir(v):
            read_hf_config(v)  # a missing or unsupported config.json fails here, naming the file
            return v
        raise ValueError(
            f"SWARM_MODEL must be one of {sorted(PRESETS)} or a Hugging Face model directory (config.json + "
            f"safetensors), got {v!r}"
        )

    @field_validator("int8_block")
    @classmethod
    def _known_block(cls, v: int) -> int:
        if v not in INT8_BLOCK_SIZES:
            raise ValueError(f"SWARM_INT8_BLOCK must be one of {INT8_BLOCK_SIZES}, got {v}")
        return v

    def gpt_config(self) -> ModelConfig:
        """The model's config, of either family (a preset's, or read from the directory's config.json)."""
        from shared.hf import read_hf_config

        return config_from_preset(self.model) if self.model in PRESETS else read_hf_config(self.model)


class StageServerSettings(ModelSettings, DiscoverySettings):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    advertise_url: str = Field("", description="URL others reach this server at; default http://HOST:PORT")
    stage: int | Literal["auto", "standby"] = Field(
        0,
        description=(
            "stage to serve, or 'auto': the coordinator picks where a loss would hurt most; 'standby': the server "
            "starts, waits without a stage and takes one when a stage is left with fewer than two replicas"
        ),
    )
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    optimizer: Literal["adamw", "nadamw"] = Field(
        "adamw",
        description=(
            "'adamw', or 'nadamw': NAdam's Nesterov look-ahead with decoupled weight decay, Pluralis' correction for "
            "gradients that arrive a step late (measured in docs/benchmarks.md); the same on every server of a run"
        ),
    )
    beta1: float = Field(
        0.9, ge=0, lt=1, description="the optimizer's first-moment decay (Pluralis use 0.99 with nadamw)"
    )
    global_batch: int = Field(
        32,
        ge=1,
        description=(
            "samples of one global step: the replicas of a stage together accumulate this many, all-reduce their "
            "gradients and take the same AdamW step; the same on every server of a run"
        ),
    )
    warmup_steps: int = Field(10, ge=0, description="global steps of linear learning-rate warm-up")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="learning rate after the warm-up: 'constant', or 'cosine' down to min_lr_ratio x lr at total_steps",
    )
    total_steps: int = Field(
        0,
        ge=0,
        description="the cosine schedule's length in global steps (warm-up included); needed by lr_schedule=cosine",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine schedule ends at this fraction of lr")
    max_grad_norm: float = Field(
        1.0,
        ge=0,
        description="clip the stage's all-reduced gradient to this norm before each step (per stage); 0: no clipping",
    )
    sync: Literal["global", "local"] = Field(
        "global",
        description=(
            "'global': the replicas of a stage all-reduce every global step's gradient and take the same step; 'local' "
            "(DiLoCo, for very slow links): each replica steps on the samples it served, and every local_steps steps "
            "the replicas average what they learned and take an outer Nesterov step; the same on every server of a run"
        ),
    )
    local_steps: int = Field(
        10, ge=1, le=100_000, description="sync=local: global steps between outer steps (DiLoCo's H)"
    )
    outer_lr: float = Field(
        0.7,
        gt=0,
        le=10,
        description=(
            "sync=local: learning rate of the outer step (1 with "
            "outer_momentum 0: plain averaging of the replicas' weights)"
        ),
    )
    outer_momentum: float = Field(
        0.5,
        ge=0,
        lt=1,
        description=(
            "sync=local: Nesterov momentum of the outer step (DiLoCo's 0.9 is tuned for hundreds of local steps; at "
            "10, 0.5 measured best, see docs/architecture.md)"
        ),
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=1000,
        description=(
            "a backward's gradient goes into a global step at most this many steps after the weights its forward ran "
            "on (kept for it: at most this + 1 weights versions); a later one is refused (409 stale_forward) and the "
            "trainer runs the microbatch again"
        ),
    )
    max_body_mb: float = Field(128.0, gt=0, description="largest request body accepted (413 past it)")
    max_queue: int = Field(64, ge=1, description="requests queued for compute before 503")
    backward_cache: int = Field(16, ge=0, description="forward graphs kept to skip the backward recompute")
    chain_held_mb: float = Field(
        1024.0,
        gt=0,
        description=(
            "chain routing: megabytes that chains in progress may hold here (each its input and output until its "
            "backward); past it a new chain gets 503 overloaded"
        ),
    )
    session_memory_mb: float = Field(
        512.0,
        gt=0,
        description=(
            "inference sessions: megabytes of attention (KV) cache that all sessions on this server may hold; past it "
            "a new session gets 503 overloaded"
        ),
    )
    session_max_mb: float = Field(
        128.0,
        gt=0,
        description=(
            "inference sessions: megabytes of KV cache one session may hold (its batch x max_length); a larger one is "
            "refused with 400"
        ),
    )
    session_ttl_s: float = Field(
        300.0, gt=0, description="inference sessions: a session idle this long is closed and its cache freed"
    )
    inject: FaultInjection = Field(
        default_factory=FaultInjection, description="TEST ONLY: fault injection (SWARM_INJECT_*), see FaultInjection"
    )
    lora: LoraSettings = Field(
        default_factory=LoraSettings, description="LoRA fine-tuning of the frozen model (SWARM_LORA_*)"
    )
    drain_timeout_s: float = Field(30.0, gt=0)
    checkpoint_dir: str = Field(
        "", description="resume from the latest checkpoint here when no live replica of the stage has state to give"
    )
    join_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "timeout of the state download when joining a stage, and how long a --stage auto server asks a "
            "coordinator not reachable yet for its stage"
        ),
    )
    step_snapshot_dir: str = Field(
        "",
        description=(
            "BENCH: write the stage's weights after every global step into this directory "
            "(DIR/step-K/stage-S.safetensors, the first replica of a step wins), so that a bench evaluates every "
            "step off the training clock (bench/arena.py); empty: none"
        ),
    )
    recovery: Literal["checkpoint", "checkfree", "fresh"] = Field(
        "checkpoint",
        description=(
            "how a server builds its stage when no live replica of it has state to give (every one died): "
            "'checkpoint', the stage's latest checkpoint in SWARM_CHECKPOINT_DIR (else fresh); 'checkfree', the "
            "average of the neighbouring stages' weights, weighted by their last gradient norms (CheckFree; else "
            "checkpoint); 'fresh', the initial weights. It then takes the stage's step number (catch-up)"
        ),
    )
    recovery_warmup_steps: int = Field(
        10,
        ge=0,
        description=(
            "global steps over which the learning rate rises again after a recovery that starts with fresh AdamW "
            "moments ('checkfree', 'fresh', or a checkpoint without them); 0: full rate at once"
        ),
    )
    speed_flops: float = Field(
        0.0,
        ge=0,
        description=(
            "the compute rate (FLOP/s) this server declares to the coordinator, which places joining servers by "
            "the declared speeds as a swarm forms (no one has served yet); 0: a --stage auto server measures it as it "
            "joins (half a second of matrix products in its own process, so its CPU cap and neighbours count), "
            "others declare none"
        ),
    )
    link_mbit: float = Field(
        0.0,
        ge=0,
        le=1e7,
        description=(
            "the rate of this server's network link in Mbit/s (the slower of up and down), declared to the "
            "coordinator: a --stage auto server whose link is under half the swarm's median joins the stage of its "
            "need with the most capacity, where the step rounds it slows cost least; 0: none declared (placement "
            "then leaves links out)"
        ),
    )
    region: str = Field(
        "",
        max_length=64,
        pattern=r"^[A-Za-z0-9._-]*$",
        description=(
            "where this server runs: a region of the shipped network table (Oregon, Virginia, Ohio, Tokyo, Seoul, "
            "Singapore, Sydney, London, Frankfurt, Ireland) or any name shared by servers in one place; the "
            "coordinator's placement uses it for links it has not measured; empty: unknown"
        ),
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description=(
            "'bf16': the stage computes under bf16 autocast on CUDA, with fp32 master weights and optimizer state; "
            "'fp32' (the only choice on CPU)"
        ),
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "recompute each block's activations in the backward instead of keeping them from the forward (less memory, "
            "about 1/3 more compute)"
        ),
    )
    peak_tflops: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description=(
            "the device's peak TFLOP/s for this server's precision and threads, what its MFU divides by; 0: a known "
            "GPU's dense datasheet figure, else measured by a short matmul (on CPU: one thread's, times "
            "SWARM_NUM_THREADS; cached per machine)"
        ),
    )
    memory_check: bool = Field(
        True,
        description=(
            "at start, refuse a stage whose estimated memory (weights, gradients, AdamW state, gradient buckets) "
            "exceeds what the device has free"
        ),
    )

    @model_validator(mode="after")
    def _schedule(self):
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"SWARM_LR_SCHEDULE=cosine needs SWARM_TOTAL_STEPS > SWARM_WARMUP_STEPS ({self.warmup_steps}), got "
                f"{self.total_steps}"
            )
        if self.precision == "bf16" and not self.device.startswith("cuda"):
            raise ValueError(
                f"SWARM_PRECISION=bf16 needs SWARM_DEVICE=cuda (on {self.device} a stage computes in fp32)"
            )
        if (lora := self.lora.config()) is not None:
            from shared.lora import target_modules

            target_modules(self.gpt_config(), lora)  # a target the model lacks, or a rank too large: said now
        return self


class CoordinatorSettings(DiscoverySettings):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    advertise_url: str = Field("", description="URL others reach the coordinator at; default http://HOST:PORT")
    num_stages: int = Field(4, ge=1, le=1024)
    state_db: str = Field("coordinator.sqlite", description="SQLite file with the registry and run state")
    lease_heartbeats: int = Field(3, ge=1, description="missed heartbeats after which a lease expires")
    max_servers: int = Field(4096, ge=1, description="registry size limit")
    average_every_s: float = Field(
        30.0,
        ge=0,
        description=(
            "seconds between checks that each stage's replicas are identical (a digest per replica); replicas that "
            "drifted apart are averaged; 0: only when asked (POST /average)"
        ),
    )
    averaging_codec: Codec = Field(
        "int4",
        description=(
            "wire codec of the parts exchanged in averaging and step rounds (the all-reduce of a stage's gradients); "
            "every replica loads the decoded values, so replicas stay bit-identical with any codec; a stage of one "
            "replica sends nothing and compresses nothing (docs/benchmarks.md, 'Step-round codecs')"
        ),
    )
    error_feedback: bool = Field(
        False,
        description=(
            "step rounds with a lossy SWARM_AVERAGING_CODEC: each replica adds what the codec lost of its last step's "
            "gradient parts (and of the part it reduced) to the next step's before compressing; kept per replica, "
            "outside the digest, dropped on a resync, join or state load"
        ),
    )
    averaging_timeout_s: float = Field(20.0, gt=0, description="an averaging round never waits longer than this")
    step_timeout_s: float = Field(
        20.0,
        gt=0,
        description=(
            "a step round (the all-reduce of a stage's accumulated gradients) never waits longer than this: a member "
            "that lags is left out, its samples dropped"
        ),
    )
    schedule: Literal["async", "sync"] = Field(
        "sync",
        description=(
            "when trainers may start the microbatches of a global step: 'async' while every stage is at most "
            "SWARM_MAX_STALENESS steps behind it (bounded-staleness pipelining); 'sync' only once every stage took the "
            "step before (GPipe/1F1B semantics: the same model as one process)"
        ),
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=1000,
        description=(
            "the 'async' schedule admits the microbatches of a global step while every stage is at most this many "
            "steps behind it (set it as on the stage servers)"
        ),
    )
    averaging_aggregator: Literal["mean", "centered_clip"] = Field(
        "mean",
        description=(
            "how each part is reduced: the sample-weighted mean, or CenteredClip, which a faulty or malicious replica "
            "cannot drag away (honest majority)"
        ),
    )
    rebalance_every_s: float = Field(
        30.0, ge=0, description="seconds between rebalancing checks; 0: never move servers"
    )
    rebalance_min_gain: float = Field(
        1 / 0.75,
        ge=1.0,
        description="throughput placement: move a server only if the weakest stage's capacity grows by this factor",
    )
    hot_spares: bool = Field(
        False,
        description=(
            "keep the replicas whose stage does not need their compute out of routing (GET /swarm marks them "
            "'spare'): while a stage keeps at least the weakest stage's capacity without a replica (declared speeds, "
            "else measured throughputs), that replica holds no samples, so its step rounds cost little, and it serves "
            "when its stage needs it; false (the default for now): every replica serves"
        ),
    )
    placement: PlacementSettings = Field(
        default_factory=PlacementSettings, description="placement of servers on stages (SWARM_PLACEMENT*)"
    )
    checkpoint_dir: str = Field("", description="directory for checkpoints; empty: no checkpoints")
    checkpoint_every_s: float = Field(60.0, gt=0, description="seconds between checkpoints")
    keep_checkpoints: int = Field(3, ge=1, description="checkpoints kept on disk")
    tokenizer: str = Field(
        "",
        description=(
            "a Hugging Face tokenizer.json or a directory holding one, for the completions endpoint (/v1/completions); "
            "empty: the servers' model directory's if it exists here, else bytes when the model's vocabulary is 256 "
            "(the byte presets)"
        ),
    )
    max_generations: int = Field(
        4, ge=1, le=1024, description="generations the completions endpoint runs at once; past it a request gets 429"
    )


class TrainerSettings(ModelSettings, DiscoverySettings):
    stages: str = Field("", description="stage server URLs (replicas ',' stages ';'); empty: ask the coordinator")
    corpus: str = Field(
        "",
        description=(
            "data to train on: a text file, JSONL (a 'text' field per line), Parquet (a 'text' column), or a directory "
            "of such shards; empty: the bundled Shakespeare corpus"
        ),
    )
    tokenizer: str = Field(
        "",
        description=(
            "a Hugging Face tokenizer.json (or a directory holding one, e.g. from swarm tokenizer train); empty: the "
            "model directory's tokenizer, or bytes for the byte-level presets"
        ),
    )
    token_cache_dir: str = Field(
        "",
        description=(
            "where the corpus, tokenized once, is cached as memory-mapped token ids (reused by later runs); empty: "
            "~/.cache/swarm-mesh/tokens"
        ),
    )
    seq_len: int = Field(128, ge=1)
    microbatch_size: int = Field(8, ge=1)
    in_flight: int = Field(4, ge=1, le=1024, description="microbatches in flight at once")
    steps: int = Field(
        200,
        ge=1,
        description=(
            "global steps of the run (of SWARM_GLOBAL_BATCH samples each, all trainers together): the trainer stops "
            "once stage 0 took this many, and never feeds more than the samples of the steps left"
        ),
    )
    start_step: int = Field(
        0, ge=0, description="resume: the global steps already trained (the run continues at this step)"
    )
    shard_index: int = Field(
        0,
        ge=0,
        description=(
            "this trainer's share of the data: microbatches shard_index, "
            "shard_index + num_shards, ... of the run's sequence"
        ),
    )
    num_shards: int = Field(
        1, ge=1, le=4096, description="trainers sharing the run's microbatch sequence (see shard_index)"
    )
    routing: Literal["relay", "chain"] = Field(
        "chain",
        description=(
            "'chain': the trainer sends the route it picked with the token ids to stage 0 and the stage servers pass "
            "activations and gradients straight to each other; 'relay': the trainer carries every tensor between "
            "stages (a star, as SWARM's reference code)"
        ),
    )
    forward_timeout_s: float = Field(30.0, gt=0)
    stage_wait_s: float = Field(
        120.0,
        ge=0,
        description=(
            "how long a microbatch waits for a stage none of whose replicas is usable (every one failed: preempted, "
            "restarting, being replaced) before its failures count and it may fail; 0: no waiting"
        ),
    )
    backward_timeout_s: float = Field(60.0, gt=0)
    info_timeout_s: float = Field(5.0, gt=0, description="timeout of each GET /info when checking the swarm at start")
    max_retries: int = Field(3, ge=0, le=100, description="extra tries of a failed hop before the microbatch fails")
    log_every: int = Field(10, ge=1, description="log a line every N steps")
    eval_every: int = Field(
        0,
        ge=0,
        description=(
            "also evaluate the held-out loss every N global steps, beside the training (the summary's eval_curve: loss "
            "against samples and wall time); 0: only before and after the run"
        ),
    )
    final_average: bool = Field(
        True,
        description=(
            "before the final evaluation, ask the coordinator to check that every stage's replicas are identical, "
            "repairing any drift (POST /average)"
        ),
    )
    final_average_timeout_s: float = Field(
        120.0, gt=0, description="how long the final averaging may take before the trainer evaluates anyway"
    )
    progress: Literal["auto", "bar", "off"] = Field(
        "auto",
        description=(
            "progress on stderr: 'bar' (live, even into a pipe), 'off', or 'auto': a bar on a terminal, else a plain "
            "line every log_every steps (none with JSON logs)"
        ),
    )
    metrics_file: str = Field("", description="append one JSON line per step here")
    summary_file: str = Field("", description="write the run's full summary (per-step losses included) here as JSON")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="serve Prometheus GET /metrics on this port while training; 0: off"
    )
    metrics_host: str = Field("127.0.0.1", description="interface of the metrics endpoint (0.0.0.0 in a container)")

    @model_validator(mode="after")
    def _shard(self):
        if self.shard_index >= self.num_shards:
            raise ValueError(f"SWARM_SHARD_INDEX={self.shard_index} must be below SWARM_NUM_SHARDS={self.num_shards}")
        return self

    def stage_urls(self) -> list[list[str]]:
        """Parse ``stages`` into one list of replica URLs per stage."""
        groups = [[u.strip().rstrip("/") for u in g.split(",") if u.strip()] for g in self.stages.split(";")]
        if len(groups) != self.num_stages or any(not g for g in groups):
            raise ValueError(
                f"SWARM_STAGES must list {self.num_stages} stages separated by ';' (replicas by ','), "
                f"got {self.stages!r}"
            )
        for url in (u for g in groups for u in g):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"SWARM_STAGES: {url!r} is not an http(s) URL")
        return groups


def advertised_url(host: str, port: int, advertise_url: str = "", *, tls: bool = False) -> str:
    """The URL peers use to reach a service listening on ``host:port`` (https with TLS on)."""
    if advertise_url:
        return advertise_url.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        import socket

        host = socket.gethostbyname(socket.gethostname())
    return f"{'https' if tls else 'http'}://{host}:{port}"


def known_settings_fields() -> set[str]:
    """Flat names of every setting of every settings class (CommonSettings and its subclasses)."""
    fields, todo = set(), [CommonSettings]
    while todo:
        cls = todo.pop()
        fields |= set(settings_fields(cls))
        todo.extend(cls.__subclasses__())
    return fields


def unknown_swarm_variables() -> list[str]:
    """SWARM_* environment variables that no settings class reads (most likely typos)."""
    known = {f"SWARM_{name.upper()}" for name in known_settings_fields()}
    return sorted(k for k in os.environ if k.upper().startswith("SWARM_") and k.upper() not in known)


def parse_settings(cls: type[BaseSettings], argv: list[str] | None, prog: str, description: str = "") -> BaseSettings:
    """Build ``cls`` from ``SWARM_*`` variables, overridden by ``--flag value`` for any field.

    Every setting ``num_stages`` gets a flag ``--num-stages`` (a section's by flat name:
    ``--placement-min-gain``); values are validated by the settings class, and a bad one exits
    with a message naming the setting. Test-only (fault-injection) settings have flags too, but
    ``--help`` only names them in its epilog.
    """
    import argparse

    fields = settings_fields(cls)
    test_only = [f"--{name.replace('_', '-')}" for name, field in fields.items() if is_test_only(field)]
    epilog = (
        f"test only, never set in production: {', '.join(test_only)} (SWARM_INJECT_*) inject faults for the tests"
        if test_only
        else None
    )
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    for name, field in fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            metavar=name.upper(),
            help=argparse.SUPPRESS if is_test_only(field) else field.description or f"(env SWARM_{name.upper()})",
        )
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    for name in unknown_swarm_variables():
        print(f"{prog}: warning: {name} is set but no swarm-mesh setting has that name; ignored", file=sys.stderr)
    try:
        return cls(**args)
    except ValueError as exc:  # pydantic.ValidationError is a ValueError
        parser.exit(2, f"{prog}: invalid settings:\n{exc}\n")
