"""StageRuntime: one pipeline stage's weights, optimizer and gradient accumulation.

Plain logic, no networking. Every method that touches parameters is called from the
server's single compute worker, so none of them race. Backward is stateless: it gets the
stage input again and recomputes the forward, so any replica can serve it. A bounded
cache of forward graphs may skip the recompute; it is used only when the weights have
not changed since and the input is bit-identical, so the result is the same either way.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.errors import BadPayload
from shared.model import GPTConfig, StageModel, build_stage


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    samples_per_step: int = 32
    warmup_steps: int = 0  # learning rate rises linearly from lr/warmup_steps to lr
    max_grad_norm: float = 0.0  # clip the stage's gradient norm (0: off)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        return self.lr * min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else self.lr


@dataclass
class StageStats:
    forwards: int = 0
    backwards: int = 0
    samples: int = 0  # samples whose backward ran here
    optimizer_steps: int = 0
    cache_hits: int = 0
    compute_s: float = 0.0
    last_grad_norm: float = 0.0  # norm of the last step's mean gradient, before clipping
    clipped_steps: int = 0


@dataclass
class _CachedForward:
    version: int
    seed: int
    inputs: torch.Tensor  # as received, to check that the backward's input is the same
    targets: torch.Tensor | None  # likewise (last stage)
    leaf: torch.Tensor  # the graph's input (requires grad past the first stage)
    output: torch.Tensor


@dataclass(frozen=True)
class BackwardResult:
    grad_inputs: torch.Tensor | None  # None on the first stage (token ids have no gradient)
    loss: float | None  # the microbatch loss, last stage only


class StageRuntime:
    def __init__(
        self,
        cfg: GPTConfig,
        stage: int,
        num_stages: int,
        *,
        seed: int = 0,
        optim: OptimizerConfig = OptimizerConfig(),
        device: str = "cpu",
        cache_size: int = 16,
    ):
        self.cfg, self.device, self.optim_cfg = cfg, torch.device(device), optim
        self.model: StageModel = build_stage(cfg, stage, num_stages, seed).to(self.device)
        self.model.train()
        self.spec = self.model.spec
        self.params = [p for p in self.model.parameters()]
        self.param_dtype = self.params[0].dtype
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=optim.lr,
            betas=optim.betas,
        )
        self._grad_sum = [torch.zeros_like(p) for p in self.params]
        self._pending_samples = 0
        self.version = 0  # bumped by every change of the weights
        self.stats = StageStats()
        self._cache: OrderedDict[str, _CachedForward] = OrderedDict()
        self._cache_size = cache_size

    # ---------------------------------------------------------------- validation
    def validate(self, inputs: torch.Tensor, targets: torch.Tensor | None, grad_outputs: torch.Tensor | None, *, backward: bool) -> None:
        """Raise :class:`BadPayload` unless the tensors fit this stage exactly."""
        cfg = self.cfg
        if self.spec.is_first:
            _check(not inputs.is_floating_point() and inputs.dtype != torch.bool, f"stage 0 takes integer token ids, got {inputs.dtype}")
            _check(inputs.dim() == 2, f"token ids must be (batch, seq), got shape {list(inputs.shape)}")
            if inputs.numel():
                _check(int(inputs.min()) >= 0 and int(inputs.max()) < cfg.vocab_size, f"token ids must lie in [0, {cfg.vocab_size})")
        else:
            _check(inputs.is_floating_point(), f"stage {self.spec.index} takes float hidden states, got {inputs.dtype}")
            _check(inputs.dim() == 3 and inputs.shape[2] == cfg.d_model, f"hidden states must be (batch, seq, {cfg.d_model}), got {list(inputs.shape)}")
            _check(bool(torch.isfinite(inputs).all()), "hidden states contain non-finite values")
        B, T = inputs.shape[0], inputs.shape[1]
        _check(B >= 1 and 1 <= T <= cfg.block_size, f"need batch >= 1 and 1 <= seq <= {cfg.block_size}, got ({B}, {T})")
        if self.spec.is_last:
            _check(targets is not None, "the last stage needs targets")
            _check(not targets.is_floating_point() and targets.dtype != torch.bool, f"targets must be integers, got {targets.dtype}")
            _check(tuple(targets.shape) == (B, T), f"targets must have shape {[B, T]}, got {list(targets.shape)}")
            _check(int(targets.min()) >= -1 and int(targets.max()) < cfg.vocab_size, f"targets must lie in [-1, {cfg.vocab_size})")
            _check(bool((targets != -1).any()), "every target is -1 (ignored): the loss would be undefined")
        elif backward:
            _check(grad_outputs is not None, f"backward of stage {self.spec.index} needs grad_outputs")
            _check(grad_outputs.is_floating_point(), "grad_outputs must be floats")
            _check(tuple(grad_outputs.shape) == (B, T, cfg.d_model), f"grad_outputs must have shape {[B, T, cfg.d_model]}, got {list(grad_outputs.shape)}")
            _check(bool(torch.isfinite(grad_outputs).all()), "grad_outputs contain non-finite values")

    # ---------------------------------------------------------------- compute
    def forward(self, microbatch_id: str, seed: int, inputs: torch.Tensor, targets: torch.Tensor | None, *, keep_graph: bool = True) -> torch.Tensor:
        """Run the stage. Returns hidden states, or the scalar loss on the last stage.

        ``keep_graph=False`` (evaluation) never caches: no backward will follow.
        """
        self.validate(inputs, targets, None, backward=False)
        inputs, targets, _ = self._as_model_types(inputs, targets, None)
        started = time.perf_counter()
        if self._cache_size and keep_graph:
            leaf, output = self._run(seed, inputs, targets, grad=True)
            self._remember(microbatch_id, _CachedForward(self.version, seed, inputs, targets, leaf, output))
            output = output.detach()
        else:
            _, output = self._run(seed, inputs, targets, grad=False)
        self.stats.forwards += 1
        self.stats.compute_s += time.perf_counter() - started
        return output

    def backward(self, microbatch_id: str, seed: int, inputs: torch.Tensor, targets: torch.Tensor | None, grad_outputs: torch.Tensor | None) -> BackwardResult:
        """Accumulate this microbatch's parameter gradients; return the input gradient."""
        self.validate(inputs, targets, grad_outputs, backward=True)
        inputs, targets, grad_outputs = self._as_model_types(inputs, targets, grad_outputs)
        started = time.perf_counter()
        cached = self._cache.pop(microbatch_id, None)
        if cached and cached.version == self.version and cached.seed == seed and _same(cached.inputs, inputs) and _same(cached.targets, targets):
            leaf, output = cached.leaf, cached.output
            self.stats.cache_hits += 1
        else:
            leaf, output = self._run(seed, inputs, targets, grad=True)
        wrt = self.params + ([] if self.spec.is_first else [leaf])
        grads = torch.autograd.grad(output, wrt, grad_outputs=None if self.spec.is_last else grad_outputs, allow_unused=True)
        batch = inputs.shape[0]
        for acc, g in zip(self._grad_sum, grads[: len(self.params)]):
            if g is not None:
                acc.add_(g, alpha=batch)  # gradients of the microbatch mean, weighted by its samples
        self._pending_samples += batch
        self.stats.backwards += 1
        self.stats.samples += batch
        if self._pending_samples >= self.optim_cfg.samples_per_step:
            self._optimizer_step()
        self.stats.compute_s += time.perf_counter() - started
        grad_inputs = None if self.spec.is_first else grads[-1]
        loss = float(output.detach()) if self.spec.is_last else None
        return BackwardResult(grad_inputs, loss)

    def accumulated_gradients(self) -> dict[str, torch.Tensor]:
        """Mean gradient per parameter over the samples accumulated since the last step."""
        n = max(self._pending_samples, 1)
        return {name: acc / n for (name, _), acc in zip(self.model.named_parameters(), self._grad_sum)}

    def weights_changed(self) -> None:
        """Call after the weights were changed from outside (averaging, a loaded state):
        a new version, and the cached forward graphs, which hold the old weights, dropped."""
        self.version += 1
        self._cache.clear()

    def reset_accumulation(self) -> None:
        """Drop the accumulated gradients too (a state replaced the stage's training)."""
        for acc in self._grad_sum:
            acc.zero_()
        self._pending_samples = 0
        self.weights_changed()

    @property
    def pending_samples(self) -> int:
        return self._pending_samples

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

    def _run(self, seed: int, inputs: torch.Tensor, targets: torch.Tensor | None, *, grad: bool):
        leaf = inputs if self.spec.is_first else inputs.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad), self._seeded(seed):
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

    def _optimizer_step(self) -> None:
        n = self._pending_samples
        for p, acc in zip(self.params, self._grad_sum):
            p.grad = acc / n
        # Per-stage clipping: one bad microbatch (an outlier, a gradient computed against
        # weights that moved, a replica that just loaded an average) cannot throw the stage
        # far. A global norm would need every stage's norm before any step; stages step
        # asynchronously, so each clips its own.
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.max_grad_norm if self.optim_cfg.max_grad_norm > 0 else math.inf)
        self.stats.last_grad_norm = float(norm)
        if 0 < self.optim_cfg.max_grad_norm < self.stats.last_grad_norm:
            self.stats.clipped_steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim_cfg.lr_at(self.stats.optimizer_steps)
        self.optimizer.step()
        for p, acc in zip(self.params, self._grad_sum):
            p.grad = None
            acc.zero_()
        self._pending_samples = 0
        self.version += 1
        self.stats.optimizer_steps += 1
        self._cache.clear()  # cached graphs hold the old weights


@contextlib.contextmanager
def _fork_rng(seed: int, device: torch.device):
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise BadPayload(message)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
