"""StageRuntime: one pipeline stage's weights, its kept weights versions, optimizer and
gradient accumulation.

Plain logic, no networking. Every method that touches parameters is called from the
server's single compute worker, so none of them race.

**Each backward runs on its forward's weights** (PipeDream-2BW's weight stashing,
generalised to ``max_staleness``). Every write of the weights (an optimizer step, a loaded
state, an averaged or outer-stepped state) goes through :meth:`StageRuntime.new_version`:
if a forward in flight here ran on the current parameter tensors, they are kept as they
are and the write goes to fresh copies (the optimizer's state moves with them), so the
cached graphs that hold the old tensors stay valid. A version is kept while a forward that
ran on it waits for its backward, and only while it is within ``max_staleness`` steps of
the stage's: at most ``max_staleness + 1`` versions, the current one included. A backward
uses its forward's cached graph, or recomputes the forward on its forward's version (the
graph was evicted, or another replica of a ``global`` stage ran the forward at the same
step: replicas at one step hold identical weights); when that version is not kept here it
is refused with :class:`StaleForward` and the trainer runs the microbatch again. No
forward is ever recomputed on other weights than its own (``other_weights_backwards``
counts a violation and stays 0).

Steps are global (see ``stepping.py``): a backward only accumulates its gradient, into
the bucket of the global step it was given (the coordinator hands each microbatch a
step, so that every step holds exactly the global batch; a backward may fill the next
step's bucket while the current one is all-reduced). Its gradient, computed on version
step ``f``, may go into bucket ``b`` with ``f <= b <= f + max_staleness`` only: the step
``b`` takes the weights from ``b`` to ``b + 1`` with a gradient ``b - f`` steps old
(bounded-staleness SGD; delay 0 is synchronous training). A later bucket is refused with
:class:`StaleForward`. The stage's replicas all-reduce a step's buckets, and every one of
them calls :meth:`StageRuntime.apply_step` with the same mean gradient, so they stay
bit-identical. ``solo=True`` (a server with no coordinator, or a test) steps on its own as
soon as it alone holds the global batch.

A microbatch id is accumulated at most once here: from its accumulation until its step is
applied (its bucket filling, taken by a step round, or given back) and for ``DEDUP_STEPS``
applied steps after, a backward of the same id computes its input gradient only.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from services.stage_server.local_sync import OuterConfig, OuterOptimizer
from shared.errors import BadPayload, Draining, Overloaded, SwarmError
from shared.lora import LoraConfig, apply_lora
from shared.model import ModelConfig, build_stage

LR_SCHEDULES = ("constant", "cosine")
# 'adamw'; 'nadamw': AdamW's moments with Nesterov's look-ahead (NAdam, decoupled weight
# decay), Pluralis' correction for gradients that arrive a step late (docs/architecture.md)
OPTIMIZERS = ("adamw", "nadamw")
NO_BUCKET = -1  # backward(bucket=NO_BUCKET): the input gradient only, nothing accumulated
DEDUP_STEPS = 16  # a microbatch accumulated in one of this many last steps is not accumulated again (a re-run, a retry)
MAX_FORWARDS_IN_FLIGHT = 4096  # records of forwards awaiting their backward (the oldest forgotten past this)
# seconds the calling task's jobs waited in the compute worker's queue behind other jobs
# (ComputeWorker.run adds to it): what a server's own time on a request takes out, so that
# the time it reports to the trainer's wiring is its service time, not the queue the
# wiring already counts
QUEUED_S: contextvars.ContextVar[float] = contextvars.ContextVar("queued_s", default=0.0)


class StaleForward(SwarmError):
    """The backward's forward ran here more than ``max_staleness`` global steps ago: run the microbatch again."""

    status = 409
    code = "stale_forward"


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (AdamW, or NAdamW) and its schedule, in global steps; the same on every replica of a run."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    name: str = "adamw"  # one of OPTIMIZERS
    momentum_decay: float = 0.004  # nadamw: psi of NAdam's look-ahead schedule mu_t = beta1 (1 - 0.5 x 0.96^(t psi))
    global_batch: int = 32  # samples of one global step (all replicas of the stage together)
    warmup_steps: int = 0  # learning rate rises linearly from lr/warmup_steps to lr
    schedule: str = "constant"  # after warm-up: 'constant', or 'cosine' down to min_lr_ratio x lr at total_steps
    total_steps: int = 0  # the cosine's length in global steps (warm-up included)
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 0.0  # clip the stage's all-reduced gradient norm (0: off)
    # after a recovery that starts from fresh AdamW moments (``StageRuntime.catch_up``), the
    # learning rate rises again linearly over this many steps (0: full rate at once)
    recovery_warmup_steps: int = 0

    def __post_init__(self):
        assert self.name in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}"
        assert self.schedule in LR_SCHEDULES, f"schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}"
        assert self.schedule != "cosine" or self.total_steps > self.warmup_steps, (
            "a cosine schedule needs total_steps > warmup_steps"
        )

    def lr_at(self, step: int) -> float:
        """Learning rate of global step ``step``.

        0-based: the step that takes the weights from ``step`` to ``step + 1``.
        """
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "cosine":
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
            return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        return self.lr

    def recovery_factor(self, step: int, recovered_at: int | None) -> float:
        """What the learning rate of ``step`` is multiplied by after a recovery at ``recovered_at``."""
        if recovered_at is None or not self.recovery_warmup_steps or step < recovered_at:
            return 1.0
        return min(1.0, (step - recovered_at + 1) / self.recovery_warmup_steps)


def make_optimizer(params: list[torch.Tensor], optim: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of ``optim.name`` over ``params``, weight decay on matrices only: the
    stage servers' and the arena's pipelining baseline's."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if optim.name == "nadamw":
        return torch.optim.NAdam(
            groups, lr=optim.lr, betas=optim.betas, momentum_decay=optim.momentum_decay, decoupled_weight_decay=True
        )
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas)


@dataclass
class StageStats:
    forwards: int = 0
    backwards: int = 0  # backwards whose gradient was accumulated here
    backwards_run: int = (
        0  # every backward computed: accumulated, a duplicate, dropped (its step taken) or past the run's last step
    )
    samples: int = 0  # samples whose gradient was accumulated here
    optimizer_steps: int = 0  # global steps applied: the stage's step
    cache_hits: int = 0
    compute_s: float = 0.0
    last_grad_norm: float = 0.0  # norm of the last step's mean gradient, before clipping
    clipped_steps: int = 0
    duplicate_backwards: int = 0  # backwards of a microbatch already accumulated: computed, not accumulated
    stale_backwards: int = 0  # backwards refused: their forward was more than max_staleness steps old
    samples_dropped: int = 0  # accumulated samples that never reached a step (a failed round, a resync)
    last_effective_batch: int = 0  # samples that went into the last step's all-reduced gradient
    stale_gradients: int = 0  # backwards accumulated into a later step than that of the weights they ran on
    recomputes: int = 0  # backwards that recomputed their forward (on its version): the graph was not cached here
    other_weights_backwards: int = 0  # backwards whose forward's weights were gone (refused, not computed): 0
    versions_made: int = 0  # writes of the weights that kept the old tensors for forwards in flight (copies)
    tokens_trained: int = 0  # tokens (batch x seq) of the backwards accumulated here: model FLOPs (shared.flops)
    token_pairs_trained: int = 0  # their (query, key) pairs, batch x seq^2: attention's model FLOPs
    tokens_evaluated: int = 0  # tokens of the evaluation forwards (keep_graph=False)
    token_pairs_evaluated: int = 0  # their (query, key) pairs, batch x seq^2
    tokens_inferred: int = 0  # new positions of inference sessions' forwards (generation, scoring; sessions.py)
    token_pairs_inferred: int = 0  # their (query, key) pairs: each new position with every cached one and the new


@dataclass
class _Bucket:
    """Gradients accumulated for one global step: sums of per-sample-weighted microbatch means."""

    grad_sum: list[torch.Tensor]
    samples: int = 0
    ids: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Forward:
    """A forward run here whose backward may come: the weights version it ran on, and its step."""

    version: int
    step: int


@dataclass
class _CachedForward:
    version: int
    seed: int
    inputs: torch.Tensor  # as received, to check that the backward's input is the same
    targets: torch.Tensor | None  # likewise (last stage)
    leaf: torch.Tensor  # the graph's input (requires grad past the first stage)
    output: torch.Tensor


@dataclass(frozen=True)
class ComputedBackward:
    """A backward's gradients, computed on its forward's weights and not accumulated yet."""

    microbatch_id: str
    weights_step: int  # the step of the weights version it ran on
    grads: tuple  # one per trainable parameter (None: unused)
    grad_inputs: torch.Tensor | None
    loss: float | None
    batch: int
    seq: int


@dataclass(frozen=True)
class BackwardResult:
    grad_inputs: torch.Tensor | None  # None on the first stage (token ids have no gradient)
    loss: float | None  # the microbatch loss, last stage only
    step: int = 0  # the stage's step (weights version in global steps) the backward ran at
    accumulated: bool = True  # False: a duplicate, its gradient was already accumulated
    bucket: int | None = (
        None  # the step whose batch holds the microbatch (a duplicate's: where it went first); None: in none
    )


@dataclass(frozen=True)
class Accumulated:
    """A stage's accumulated gradient handed to a step round (see :meth:`StageRuntime.take_gradients`)."""

    mean: torch.Tensor  # flat fp32 CPU vector: the sample-weighted mean gradient
    samples: int
    microbatch_ids: frozenset[str]


class StageRuntime:
    def __init__(
        self,
        cfg: ModelConfig,
        stage: int,
        num_stages: int,
        *,
        seed: int = 0,
        optim: OptimizerConfig = OptimizerConfig(),
        device: str = "cpu",
        cache_size: int = 16,
        max_staleness: int = 1,
        solo: bool = True,
        outer: OuterConfig | None = None,
        model: torch.nn.Module | None = None,
        precision: str = "fp32",
        activation_checkpointing: bool = False,
        lora: LoraConfig | None = None,
    ):
        """``outer``: ``SWARM_SYNC=local`` (see ``local_sync.py``): each global step applies
        this replica's own gradient, every ``outer.every`` steps an outer step; None: the
        replicas all-reduce every step's gradient (``global``). ``model``: the stage's model
        with its weights (e.g. loaded from a Hugging Face directory); None: built from
        ``seed``. ``precision="bf16"``: forward and backward under bf16 autocast on CUDA,
        the weights and AdamW state stay fp32. ``lora``: train low-rank adapters on the
        frozen model (``shared.lora``); the trainable parameters are then the adapters alone,
        and everything that follows (gradients, steps, versions, digest, state) covers them only."""
        self.cfg, self.device, self.optim_cfg = cfg, torch.device(device), optim
        self.max_staleness, self.solo = max_staleness, solo
        self.model = (model if model is not None else build_stage(cfg, stage, num_stages, seed)).to(self.device)
        self.model.train()
        self.model.checkpoint_blocks = activation_checkpointing
        self.autocast = precision == "bf16" and self.device.type == "cuda"
        self.load_report = None  # what a stage loaded from a Hugging Face directory read (shared.hf.LoadReport)
        self.spec = self.model.spec
        self.lora = lora
        self.lora_report = apply_lora(self.model, cfg, lora, seed) if lora is not None else None
        # the trainable parameters, in model order: what gradients, steps and states cover
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.param_dtype = next(self.model.parameters()).dtype
        # where each parameter sits in the model (a tied head: two places), to install a version
        self._slots = [
            [(m, n) for m in self.model.modules() for n, q in m._parameters.items() if q is p] for p in self.params
        ]
        self.optimizer = make_optimizer(self.params, optim)
        self._buckets: dict[int, _Bucket] = {}  # global step -> what was accumulated for it
        self._recent_ids: deque[tuple[int, frozenset[str]]] = deque(
            maxlen=DEDUP_STEPS
        )  # (step, its microbatches) of the last steps applied
        self.version = 0  # the weights version: bumped by every write of the weights
        self._kept: dict[int, list[torch.Tensor]] = {}  # older versions still needed: version -> its parameters
        self._spare: list[torch.Tensor] | None = None  # the tensors of a version let go, for the next one
        self._version_steps: dict[int, int] = {0: 0}  # version -> the stage's step when it was made
        # step numbers these weights took without their updates (catch_up; carried in the state):
        # a backward of a forward that ran elsewhere at one of them ran on other weights
        self.caught_up: set[int] = set()
        # the step at which these weights were recovered with fresh AdamW moments (a stage whose
        # every replica died; carried in the state): the learning rate warms up again from it
        self.recovered_at: int | None = None
        self._forwards: OrderedDict[str, _Forward] = OrderedDict()  # forwards whose backward may come
        self._taken: dict[int, frozenset[str]] = {}  # step -> microbatch ids of its bucket, taken by a step round
        self.stats = StageStats()
        self._cache: OrderedDict[str, _CachedForward] = OrderedDict()
        self._cache_size = cache_size
        self.outer = OuterOptimizer(outer, flat_parameters(self.params)) if outer else None
        # called with this runtime after every global step it takes (on the compute worker):
        # SWARM_STEP_SNAPSHOT_DIR's writer (``state.StepSnapshots``), else nothing
        self.on_step: Callable[[StageRuntime], None] | None = None

    # ---------------------------------------------------------------- validation
    def validate(
        self, inputs: torch.Tensor, targets: torch.Tensor | None, grad_outputs: torch.Tensor | None, *, backward: bool
    ) -> None:
        """Raise :class:`BadPayload` unless the tensors fit this stage exactly."""
        cfg = self.cfg
        self.validate_inputs(inputs)
        B, T = inputs.shape[0], inputs.shape[1]
        _check(B >= 1 and 1 <= T <= cfg.block_size, f"need batch >= 1 and 1 <= seq <= {cfg.block_size}, got ({B}, {T})")
        if self.spec.is_last:
            _check(targets is not None, "the last stage needs targets")
            _check(
                not targets.is_floating_point() and targets.dtype != torch.bool,
                f"targets must be integers, got {targets.dtype}",
            )
            _check(tuple(targets.shape) == (B, T), f"targets must have shape {[B, T]}, got {list(targets.shape)}")
            _check(
                int(targets.min()) >= -1 and int(targets.max()) < cfg.vocab_size,
                f"targets must lie in [-1, {cfg.vocab_size})",
            )
            _check(bool((targets != -1).any()), "every target is -1 (ignored): the loss would be undefined")
        elif backward:
            _check(grad_outputs is not None, f"backward of stage {self.spec.index} needs grad_outputs")
            _check(grad_outputs.is_floating_point(), "grad_outputs must be floats")
            _check(
                tuple(grad_outputs.shape) == (B, T, cfg.d_model),
                f"grad_outputs must have shape {[B, T, cfg.d_model]}, got {list(grad_outputs.shape)}",
            )
            _check(bool(torch.isfinite(grad_outputs).all()), "grad_outputs contain non-finite values")

    def validate_inputs(self, inputs: torch.Tensor) -> None:
        """Raise :class:`BadPayload` unless ``inputs`` are this stage's kind.

        Token ids on stage 0, hidden states after.
        """
        cfg = self.cfg
        if self.spec.is_first:
            _check(
                not inputs.is_floating_point() and inputs.dtype != torch.bool,
                f"stage 0 takes integer token ids, got {inputs.dtype}",
            )
            _check(inputs.dim() == 2, f"token ids must be (batch, seq), got shape {list(inputs.shape)}")
            if inputs.numel():
                _check(
                    int(inputs.min()) >= 0 and int(inputs.max()) < cfg.vocab_size,
                    f"token ids must lie in [0, {cfg.vocab_size})",
                )
        else:
            _check(inputs.is_floating_point(), f"stage {self.spec.index} takes float hidden states, got {inputs.dtype}")
            _check(
                inputs.dim() == 3 and inputs.shape[2] == cfg.d_model,
                f"hidden states must be (batch, seq, {cfg.d_model}), got {list(inputs.shape)}",
            )
            _check(bool(torch.isfinite(inputs).all()), "hidden states contain non-finite values")

    # ---------------------------------------------------------------- compute
    def forward(
        self,
        microbatch_id: str,
        seed: int,
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        *,
        keep_graph: bool = True,
    ) -> torch.Tensor:
        """Run the stage. Returns hidden states, or the scalar loss on the last stage.

        ``keep_graph=False`` (evaluation) never caches: no backward will follow.
        """
        self.validate(inputs, targets, None, backward=False)
        inputs, targets, _ = self._as_model_types(inputs, targets, None)
        started = time.perf_counter()
        if keep_graph:
            self._forwards[microbatch_id] = _Forward(self.version, self.step)
            self._forwards.move_to_end(microbatch_id)
            while len(self._forwards) > MAX_FORWARDS_IN_FLIGHT:
                self._cache.pop(self._forwards.popitem(last=False)[0], None)
        if self._cache_size and keep_graph:
            leaf, output = self._run(seed, inputs, targets, grad=True)
            self._remember(microbatch_id, _CachedForward(self.version, seed, inputs, targets, leaf, output))
            output = output.detach()
        else:
            _, output = self._run(seed, inputs, targets, grad=False)
        self.stats.forwards += 1
        self.stats.tokens_evaluated += 0 if keep_graph else inputs.shape[0] * inputs.shape[1]
        self.stats.token_pairs_evaluated += 0 if keep_graph else inputs.shape[0] * inputs.shape[1] ** 2
        self.stats.compute_s += time.perf_counter() - started
        return output

    def backward(
        self,
        microbatch_id: str,
        seed: int,
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        grad_outputs: torch.Tensor | None,
        forward_step: int | None = None,
        bucket: int | None = None,
        late_to_current: bool = False,
    ) -> BackwardResult:
        """Accumulate this microbatch's parameter gradients (once per microbatch id) for global
        step ``bucket`` (None: the current step); return the input gradient. ``forward_step``:
        the step at which this stage ran the microbatch's forward (None: the forward runs now,
        e.g. the last stage's single call). The gradient is computed on the forward's weights
        version (see the module's docstring); :class:`StaleForward` if that version is not kept
        here or ``bucket`` is more than ``max_staleness`` steps after it. A bucket of a step
        already applied counts the samples as dropped, or (``late_to_current``) goes to the
        current step. :meth:`compute_backward` and :meth:`accumulate` in one call; a server
        that learns the bucket while the gradient is computed calls them apart."""
        computed = self.compute_backward(
            microbatch_id, seed, inputs, targets, grad_outputs, forward_step, bucket, late_to_current
        )
        return self.accumulate(computed, bucket, late_to_current)

    def compute_backward(
        self,
        microbatch_id: str,
        seed: int,
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        grad_outputs: torch.Tensor | None,
        forward_step: int | None = None,
        bucket: int | None = None,
        late_to_current: bool = False,
    ) -> ComputedBackward:
        """The microbatch's gradients on its forward's weights version, not accumulated yet
        (:meth:`accumulate`). ``bucket``, where already known, is checked first: a backward
        that its step would refuse as stale is not computed."""
        self.validate(inputs, targets, grad_outputs, backward=True)
        if forward_step is not None:
            self.check_staleness(microbatch_id, forward_step)
        version = self._version_of(microbatch_id, forward_step)
        weights_step = self._version_steps[version] if forward_step is None else forward_step
        if bucket is not None:
            self._refuse_stale(microbatch_id, weights_step, self._bucket_for(bucket, late_to_current))
        inputs, targets, grad_outputs = self._as_model_types(inputs, targets, grad_outputs)
        started = time.perf_counter()
        params = self._params_of(version)
        with self._installed(params):
            leaf, output = self._graph(microbatch_id, version, seed, inputs, targets)
            wrt = params + ([] if self.spec.is_first else [leaf])
            grads = (
                torch.autograd.grad(
                    output, wrt, grad_outputs=None if self.spec.is_last else grad_outputs, allow_unused=True
                )
                if wrt and output.requires_grad
                else ()  # a first stage with nothing to train (LoRA without a target module here)
            )
        self._forwards.pop(microbatch_id, None)
        self._forget_unused_versions()
        self.stats.backwards_run += 1
        self.stats.compute_s += time.perf_counter() - started
        return ComputedBackward(
            microbatch_id,
            weights_step,
            tuple(grads[: len(params)]),
            None if self.spec.is_first else grads[-1],
            float(output.detach()) if self.spec.is_last else None,
            inputs.shape[0],
            inputs.shape[1],
        )

    def accumulate(
        self, computed: ComputedBackward, bucket: int | None = None, late_to_current: bool = False
    ) -> BackwardResult:
        """Add ``computed`` (once per microbatch id) to the bucket of global step ``bucket``
        (None: the current step); see :meth:`backward`."""
        started = time.perf_counter()
        microbatch_id, weights_step = computed.microbatch_id, computed.weights_step
        step, bucket = self.step, self._bucket_for(bucket, late_to_current)
        self._refuse_stale(microbatch_id, weights_step, bucket)
        first_bucket = self.accumulated_in(microbatch_id)
        duplicate = first_bucket is not None
        batch, holder = computed.batch, first_bucket
        if duplicate:
            self.stats.duplicate_backwards += 1
        elif bucket == NO_BUCKET:
            pass
        elif bucket < self.step:  # its step was taken without it (the round timed out on it)
            self.stats.samples_dropped += batch
        else:
            holder = bucket
            if bucket > weights_step:  # bounded staleness: a gradient of older weights than the step it goes into
                self.stats.stale_gradients += 1
            target = self._bucket(bucket)
            for acc, g in zip(target.grad_sum, computed.grads):
                if g is not None:
                    acc.add_(g, alpha=batch)  # gradients of the microbatch mean, weighted by its samples
            target.samples += batch
            target.ids.add(microbatch_id)
            self.stats.backwards += 1
            self.stats.samples += batch
            self.stats.tokens_trained += batch * computed.seq
            self.stats.token_pairs_trained += batch * computed.seq**2
            if self.solo and target.samples >= self.optim_cfg.global_batch and bucket == self.step:
                self.apply_step(self.take_gradients())
        self.stats.compute_s += time.perf_counter() - started
        return BackwardResult(computed.grad_inputs, computed.loss, step, not duplicate and bucket >= step, holder)

    def _bucket_for(self, bucket: int | None, late_to_current: bool) -> int:
        """The step a backward's gradient goes to: ``bucket``, the current step for None, and
        the current one for a late bucket of a step this replica counts alone."""
        step = self.step
        bucket = step if bucket is None else bucket
        if late_to_current and 0 <= bucket < step:  # a replica counting its own steps: late for its step, the next
            bucket = step
        return bucket

    def _refuse_stale(self, microbatch_id: str, weights_step: int, bucket: int) -> None:
        if bucket > weights_step + self.max_staleness:
            self._forwards.pop(microbatch_id, None)
            self._cache.pop(microbatch_id, None)
            self.stats.stale_backwards += 1
            raise StaleForward(
                f"the gradient of {microbatch_id!r}, computed on the weights of step {weights_step}, would go into "
                f"step {bucket} (SWARM_MAX_STALENESS={self.max_staleness}): run the microbatch again"
            )

    def _version_of(self, microbatch_id: str, forward_step: int | None) -> int:
        """The weights version the backward of ``microbatch_id`` runs on: its forward's here;
        else (another replica ran it, or its record aged out) the version this replica had at
        ``forward_step`` in ``global`` mode, where replicas at one step are identical.
        :class:`StaleForward` when that version is not kept (``local`` mode: never another's)."""
        if forward_step is None:
            return self.version  # the forward runs now, with its backward
        ran = self._forwards.get(microbatch_id)
        if ran is not None and ran.step == forward_step:
            return ran.version
        if forward_step in self.caught_up:
            self.stats.stale_backwards += 1
            raise StaleForward(
                f"the forward of {microbatch_id!r} ran elsewhere at step {forward_step}, a step this stage's weights "
                "took without its update (caught up: the replicas that held it are gone): run the microbatch again"
            )
        if self.outer is None:
            kept = [v for v in (*self._kept, self.version) if self._version_steps.get(v) == forward_step]
            if kept:
                return max(kept)
        self.stats.stale_backwards += 1
        raise StaleForward(
            f"the weights that the forward of {microbatch_id!r} ran on (step {forward_step}) are not kept here "
            f"(this stage is at step {self.step}): run the microbatch again"
        )

    def _graph(self, microbatch_id: str, version: int, seed: int, inputs, targets):
        """(leaf, output) of the forward: the cached graph if it is this microbatch's on these
        inputs and version, else the forward recomputed on ``version`` (installed by the caller)."""
        cached = self._cache.pop(microbatch_id, None)
        if (
            cached
            and cached.version == version
            and cached.seed == seed
            and _same(cached.inputs, inputs)
            and _same(cached.targets, targets)
        ):
            self.stats.cache_hits += 1
            return cached.leaf, cached.output
        self.stats.recomputes += 1  # (a cached graph of another run of this id, on other weights, is not used)
        return self._run(seed, inputs, targets, grad=True)

    def accumulated_in(self, microbatch_id: str) -> int | None:
        """The step whose gradient already holds this microbatch (pending, taken by a step round,
        or among the last DEDUP_STEPS applied), or None. Safe from the event loop while the compute worker
        steps: it reads copies (taken whole under the GIL)."""
        for step, b in list(self._buckets.items()):
            if microbatch_id in b.ids:
                return step
        for step, ids in list(self._taken.items()):  # in a step round now
            if microbatch_id in ids:
                return step
        return next((step for step, ids in list(self._recent_ids) if microbatch_id in ids), None)

    def check_staleness(self, microbatch_id: str, forward_step: int) -> None:
        """:class:`StaleForward` if the forward ran more than ``max_staleness`` steps from now."""
        if abs(self.step - forward_step) > self.max_staleness:
            self.stats.stale_backwards += 1
            raise StaleForward(
                f"the forward of {microbatch_id!r} ran at step {forward_step}, this stage is at step {self.step} "
                f"(SWARM_MAX_STALENESS={self.max_staleness}): run the microbatch again"
            )

    @property
    def step(self) -> int:
        """Global steps applied to this stage: the weights' version in steps."""
        return self.stats.optimizer_steps

    def _bucket(self, step: int) -> _Bucket:
        if step not in self._buckets:
            self._buckets[step] = _Bucket([torch.zeros_like(p) for p in self.params])
        return self._buckets[step]

    def accumulators(self) -> list[torch.Tensor]:
        """Every gradient accumulator of every bucket, by step (a write to one bumps its ``_version``)."""
        return [acc for step in sorted(self._buckets) for acc in self._buckets[step].grad_sum]

    def pending(self, step: int | None = None) -> int:
        """Samples accumulated for global step ``step`` (default: the current one)."""
        bucket = self._buckets.get(self.step if step is None else step)
        return bucket.samples if bucket else 0

    def take_gradients(self, step: int | None = None) -> Accumulated:
        """Hand the gradient accumulated for ``step`` (default: the current one) to the step."""
        step = self.step if step is None else step
        bucket = self._buckets.pop(step, None)
        if bucket is None:
            return Accumulated(torch.zeros(sum(p.numel() for p in self.params)), 0, frozenset())
        self._taken[step] = self._taken.get(step, frozenset()) | frozenset(bucket.ids)  # still held until applied
        n = bucket.samples
        mean = (
            torch.cat([(acc / max(n, 1)).reshape(-1).to("cpu", torch.float32) for acc in bucket.grad_sum])
            if bucket.grad_sum
            else torch.empty(0)
        )
        return Accumulated(mean, n, frozenset(bucket.ids))

    def give_back(self, taken: Accumulated, step: int | None = None) -> None:
        """A step round failed before anyone stepped: the gradient taken for it accumulates again."""
        step = self.step if step is None else step
        bucket, offset = self._bucket(step), 0
        self._taken[step] = self._taken.get(step, frozenset()) - taken.microbatch_ids
        for acc in bucket.grad_sum:
            acc.add_(
                taken.mean[offset : offset + acc.numel()].view_as(acc).to(acc.device, acc.dtype), alpha=taken.samples
            )
            offset += acc.numel()
        bucket.samples += taken.samples
        bucket.ids |= taken.microbatch_ids

    def drop(self, taken: Accumulated) -> None:
        """The gradient taken for a step that this replica did not take part in: lost, and
        counted; its microbatches are no longer held here (a re-run may accumulate them)."""
        self.stats.samples_dropped += taken.samples
        self._taken = {k: ids - taken.microbatch_ids for k, ids in self._taken.items() if ids - taken.microbatch_ids}

    def apply_step(self, gradient: Accumulated) -> None:
        """One global step with ``gradient.mean`` (the stage's all-reduced mean gradient): clip,
        schedule, AdamW, into a new weights version. Every replica that calls it with the same
        values stays identical. A step of no sample is refused (``AssertionError``): momentum
        and weight decay would move the weights with nothing learned."""
        assert gradient.samples > 0, "a global step needs a gradient of at least one sample"
        with self.new_version():
            offset = 0
            for p in self.params:
                p.grad = gradient.mean[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
                offset += p.numel()
            assert offset == gradient.mean.numel(), (
                f"a step needs {offset} gradient values, got {gradient.mean.numel()}"
            )
            norm = torch.nn.utils.clip_grad_norm_(
                self.params, self.optim_cfg.max_grad_norm if self.optim_cfg.max_grad_norm > 0 else math.inf
            )
            self.stats.last_grad_norm = float(norm)
            if 0 < self.optim_cfg.max_grad_norm < self.stats.last_grad_norm:
                self.stats.clipped_steps += 1
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(self.step)
            self.optimizer.step()
            for p in self.params:
                p.grad = None
            self._recent_ids.append((self.step, gradient.microbatch_ids | self._taken.pop(self.step, frozenset())))
            self.stats.last_effective_batch = gradient.samples
            self.stats.optimizer_steps += 1
        for old in [k for k in self._buckets if k < self.step]:  # came in after their step was taken
            self.drop(self.take_gradients(old))
        if self.on_step is not None:
            self.on_step(self)

    def pass_step(self) -> None:
        """Global step taken without a gradient of this replica (``local`` mode: it served no
        sample of it): the step counter moves, the weights and the optimizer do not."""
        self._recent_ids.append((self.step, self._taken.pop(self.step, frozenset())))
        self.stats.last_effective_batch = 0
        self.stats.optimizer_steps += 1
        for old in [k for k in self._buckets if k < self.step]:
            self.drop(self.take_gradients(old))
        if self.on_step is not None:
            self.on_step(self)

    def inner_step(self, taken: Accumulated) -> None:
        """``local`` mode: this replica's own gradient of the step, alone (a pass if it served none)."""
        if taken.samples:
            self.apply_step(taken)
        else:
            self.pass_step()
        self.outer.samples += taken.samples

    def outer_gradient(self) -> torch.Tensor:
        """``local`` mode: ``anchor - weights`` (flat fp32, CPU).

        What this replica learned since the last outer step.
        """
        return self.outer.outer_gradient(flat_parameters(self.params))

    def outer_step(self, mean_delta: torch.Tensor) -> None:
        """``local`` mode: the outer step with the replicas' mean outer gradient; the weights become the new anchor."""
        load_flat_parameters(self, self.outer.step(mean_delta))

    def digest(self) -> str:
        """SHA-256 of the weights and the optimizer state: replicas in step have equal digests.
        In ``local`` mode, of what the replicas share: the step, the anchor and the outer momentum."""
        h = hashlib.sha256()
        if self.outer is not None:
            h.update(str(self.step).encode())
            h.update(_tensor_bytes(self.outer.anchor))
            h.update(_tensor_bytes(self.outer.momentum))
            return h.hexdigest()
        for name, p in self.named_params():
            h.update(name.encode())
            h.update(_tensor_bytes(p))
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                h.update(key.encode())
                h.update(_tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
        return h.hexdigest()

    def accumulated_gradients(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """Mean gradient per parameter over the samples accumulated for ``step`` (default: the current one)."""
        bucket = self._buckets.get(self.step if step is None else step)
        if bucket is None:
            return {name: torch.zeros_like(p) for name, p in self.named_params()}
        return {name: acc / max(bucket.samples, 1) for name, acc in zip(self.param_names, bucket.grad_sum)}

    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of every trainable parameter of the current version, in model order."""
        return list(zip(self.param_names, self.params))

    @contextlib.contextmanager
    def new_version(self):
        """Around every write of the weights (an optimizer step, a loaded, averaged or
        outer-stepped state): the write makes a new weights version. If a forward in flight
        ran on the current parameters (its backward will need them), they are kept as they are
        and the write goes to copies, which the model and the optimizer (its state moved over)
        hold from now on; else the write goes to them in place. Frozen parameters are shared by
        every version."""
        if any(f.version == self.version for f in self._forwards.values()):
            old = self.params
            self._kept[self.version] = old
            new = self._copies(old)
            fresh = {id(p): q for p, q in zip(old, new)}
            for group in self.optimizer.param_groups:
                group["params"] = [fresh.get(id(p), p) for p in group["params"]]
            for p, q in zip(old, new):
                if p is not q and p in self.optimizer.state:
                    self.optimizer.state[q] = self.optimizer.state.pop(p)
            self.params = new
            self._install(new)
            self.stats.versions_made += 1
        yield
        self.version += 1
        self._version_steps[self.version] = self.step
        self._forget_unused_versions()

    @property
    def versions_kept(self) -> int:
        """Weights versions held in memory, the current one included (at most ``max_staleness + 1``)."""
        return 1 + len(self._kept)

    def kept_bytes(self) -> int:
        """Bytes of the older weights versions kept for backwards in flight."""
        return sum(p.numel() * p.element_size() for params in self._kept.values() for p in params if p.requires_grad)

    def _copies(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the trainable ``params`` (frozen ones shared), in the tensors of a version let
        go if there is one: steady training alternates between two sets of tensors instead of
        allocating a new one at every step, which fragmented the heap (RSS crept up under load)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return [torch.nn.Parameter(p.detach().clone()) if p.requires_grad else p for p in params]
        with torch.no_grad():
            for q, p in zip(spare, params):
                if p.requires_grad:
                    q.copy_(p)
        return [q if p.requires_grad else p for q, p in zip(spare, params)]

    def _params_of(self, version: int) -> list[torch.Tensor]:
        """The parameters of ``version``; a forward's record keeps its version, so one that is
        gone means this runtime would compute on other weights: counted, and refused."""
        if version != self.version and version not in self._kept:
            self.stats.other_weights_backwards += 1
            raise StaleForward(f"the weights of version {version} are gone: run the microbatch again")
        return self.params if version == self.version else self._kept[version]

    @contextlib.contextmanager
    def _installed(self, params: list[torch.Tensor]):
        """The model computes with ``params`` (a kept version's) inside, the current ones after.
        A checkpointed block recomputed during the backward then uses its forward's weights too."""
        if params is self.params:
            yield
            return
        self._install(params)
        try:
            yield
        finally:
            self._install(self.params)

    def _install(self, params: list[torch.Tensor]) -> None:
        for p, slots in zip(params, self._slots):
            for module, name in slots:
                module._parameters[name] = p

    def _forget_unused_versions(self) -> None:
        """Drop what no backward can use any more: records of forwards more than
        ``max_staleness`` steps old, cached graphs whose record is gone, versions that no
        recorded forward ran on."""
        oldest = self.step - self.max_staleness
        for mb in [mb for mb, f in self._forwards.items() if f.step < oldest]:
            del self._forwards[mb]
        for mb in [mb for mb in self._cache if mb not in self._forwards]:
            del self._cache[mb]
        needed = {f.version for f in self._forwards.values()}
        for version in [v for v in self._kept if v not in needed]:
            self._spare = self._kept.pop(version)  # nothing refers to it any more: the next version's tensors
        self._version_steps = {v: s for v, s in self._version_steps.items() if v in self._kept or v == self.version}

    def lr_at(self, step: int) -> float:
        """The learning rate of global step ``step`` here: the run's schedule, warmed up again
        after a recovery with fresh moments."""
        return self.optim_cfg.lr_at(step) * self.optim_cfg.recovery_factor(step, self.recovered_at)

    def catch_up(self, step: int) -> None:
        """Take global step ``step`` with the weights as they are: the replicas that held the
        updates in between are gone (the coordinator says so). What was accumulated is dropped.
        Weights without AdamW moments (fresh, or rebuilt from the neighbouring stages) are a
        recovery: the learning rate warms up again from ``step`` (``recovery_warmup_steps``)."""
        if step > self.step:
            if not self.optimizer.state:
                self.recovered_at = step
            self.reset_accumulation()
            # older labels need no record: a backward that far from the step is refused as stale anyway
            floor = step - self.max_staleness
            self.caught_up = {s for s in self.caught_up if s >= floor} | set(range(max(self.step + 1, floor), step + 1))
            self.stats.optimizer_steps = step
            # these weights are the stage's step now: a forward run on them with its backward
            # goes into it (labelled with their old step, every such gradient was stale for good)
            self._version_steps[self.version] = step
            self._forget_unused_versions()

    def reset_accumulation(self) -> None:
        """Drop the accumulated gradients (a state replaced the stage's training, or its step
        numbers moved); they are counted as dropped."""
        for step in list(self._buckets):
            self.drop(self.take_gradients(step))
        self._taken.clear()
        self._recent_ids.clear()

    @property
    def pending_samples(self) -> int:
        """Samples accumulated in every bucket not yet stepped."""
        return sum(b.samples for b in self._buckets.values())

    # ---------------------------------------------------------------- internals
    def _as_model_types(self, inputs, targets, grad_outputs):
        """Token ids and targets as int64, hidden states and gradients in the weights' dtype
        (a peer may send fp16 values, or ids in a narrower integer type)."""
        if self.spec.is_first:
            inputs = inputs.long()
        else:
            inputs = inputs.to(self.param_dtype)
        if targets is not None:
            targets = targets.long()
        if grad_outputs is not None:
            grad_outputs = grad_outputs.to(self.param_dtype)
        return inputs, targets, grad_outputs

    def precision(self):
        """The context the stage computes in: bf16 autocast (``precision="bf16"`` on CUDA), or none."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _run(self, seed: int, inputs: torch.Tensor, targets: torch.Tensor | None, *, grad: bool):
        leaf = inputs if self.spec.is_first else inputs.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad), self._seeded(seed), self.precision():
            output = self.model(leaf, targets if self.spec.is_last else None)
        return leaf, output

    def _seeded(self, seed: int):
        """Dropout draws from a generator seeded by the request, so a recompute is exact."""
        if self.cfg.dropout == 0.0:
            return contextlib.nullcontext()
        return _fork_rng(seed, self.device)

    def _remember(self, microbatch_id: str, entry: _CachedForward) -> None:
        self._cache[microbatch_id] = entry
        self._cache.move_to_end(microbatch_id)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


@contextlib.contextmanager
def _fork_rng(seed: int, device: torch.device):
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise BadPayload(message)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


# ------------------------------------------------------------------ the weights as one flat vector
def flat_parameters(params: list[torch.Tensor]) -> torch.Tensor:
    """Every parameter, in order, as one fp32 CPU vector (a copy)."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params]) if params else torch.empty(0)


def snapshot(runtime) -> tuple[torch.Tensor, int]:
    """(flat parameters, samples processed so far); run on the compute worker."""
    return flat_parameters(runtime.params), runtime.stats.samples


def load_flat_parameters(runtime, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the runtime's parameters: a new weights version (the old one stays
    for the backwards of forwards in flight, see ``runtime.py``); run on the compute worker."""
    total = sum(p.numel() for p in runtime.params)
    assert flat.dim() == 1 and flat.numel() == total, f"expected {total} values, got shape {list(flat.shape)}"
    offset = 0
    with runtime.new_version(), torch.no_grad():
        for p in runtime.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def apply_average(runtime, snapshot_flat: torch.Tensor, averaged: torch.Tensor) -> None:
    """Load the round's average, keeping what this replica learned while the round ran:
    new = averaged + (now - snapshot). Run on the compute worker."""
    now = flat_parameters(runtime.params)
    load_flat_parameters(runtime, averaged + (now - snapshot_flat))


# ------------------------------------------------------------------ the compute thread
class ComputeWorker:
    """The one thread that runs a stage's compute, in arrival order.

    The event loop only accepts, decodes, queues and answers; everything that touches the
    stage's parameters runs here, so an optimizer step never races a backward and
    ``/health`` stays responsive while the stage computes. The queue is bounded: past
    ``max_queue`` waiting jobs a caller gets :class:`Overloaded` (503 with Retry-After), and
    a draining server refuses new work (:class:`Draining`). Both refuse new work only: the
    jobs of a step round (take the gradient, apply the step or give the gradient back) are
    the stage's own bookkeeping of work it already accepted, and run ``bounded=False``.
    """

    def __init__(self, max_queue: int, *, inject_delay_s: float = 0.0):
        self.max_queue = max_queue
        self.inject_delay_s = inject_delay_s  # fault injection: a slower device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self._pending = 0
        self.busy_s = 0.0  # wall time spent on jobs (injected delay included)
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    @property
    def queue_depth(self) -> int:
        """Jobs accepted and not finished (running one included)."""
        return self._pending

    async def run(self, fn: Callable[..., Any], *args: Any, work: float = 1.0, bounded: bool = True) -> Any:
        """Run ``fn(*args)`` on the compute thread, after the jobs queued before it. ``work``
        (in forward passes) scales the injected delay: a slow device is slow in proportion
        to the work it does. ``bounded=False``: neither a full queue nor a drain refuses
        the job (it still counts in :attr:`queue_depth`, and a drain waits for it)."""
        if bounded and self.draining:
            raise Draining("server is draining; send new work to another replica", retry_after_s=1.0)
        if bounded and self._pending >= self.max_queue:
            raise Overloaded(f"compute queue full ({self._pending} >= max_queue={self.max_queue})", retry_after_s=1.0)
        self._pending += 1
        self._idle.clear()
        queued = time.perf_counter()
        try:
            result, started = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._call, fn, args, work
            )
            QUEUED_S.set(QUEUED_S.get() + max(0.0, started - queued))
            return result
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    def _call(self, fn: Callable[..., Any], args: tuple, work: float) -> tuple[Any, float]:
        started = time.perf_counter()
        try:
            if self.inject_delay_s:
                time.sleep(self.inject_delay_s * work)
            return fn(*args), started
        finally:
            self.busy_s += time.perf_counter() - started

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new jobs and wait for the accepted ones; True if all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def close(self) -> None:
        self._executor.shutdown(wait=True)
