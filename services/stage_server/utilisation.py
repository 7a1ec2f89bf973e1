"""StageUtilisation: a stage's model FLOPs utilisation (MFU), read from its runtime's counters.

Plain logic: no networking, the clock passed in. The work that counts is the model FLOPs
(``shared.flops``) of the tokens whose gradient the stage accumulated (a forward and a
backward each), of the tokens it evaluated (a forward) and of the new positions of inference
sessions (a forward attending to the cached positions, ``sessions.py``); the runtime counts
them (``StageStats.tokens_*``). Forwards of microbatches run again, backwards of duplicates or
past the run's last step, recomputed forwards and activation checkpointing's recompute cost
time and count nothing. Two rates, each over the device's peak (``shared.peak_flops``):

- **busy**: model FLOPs over ``StageStats.compute_s``, the seconds the compute worker spent
  in the stage's forwards and backwards, sessions' included (the passes, gradient accumulation and, on a
  server stepping alone, its optimizer steps; not step rounds, state loads, the wire codec
  or waiting for work): how well the stage's compute uses the device, since the start;
- **wall**: model FLOPs per second of wall clock over the last ``window_s`` seconds: idle
  time (waiting for work, pipeline bubbles, step rounds) counts against it. The window is
  measured between this meter's reads (every heartbeat and scrape, at most one mark a
  second); until ``window_s`` has passed it runs from the meter's start.

Prometheus' ``rate(swarm_stage_model_flops_total[5m]) / swarm_stage_peak_flops`` gives the
wall MFU over any window from the counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from shared.flops import StageFlops, stage_flops
from shared.peak_flops import Peak, resolve_peak

WINDOW_S = 60.0
MARK_EVERY_S = 1.0  # the wall window's marks: at most one per this many seconds


class StageUtilisation:
    def __init__(
        self,
        flops: StageFlops,
        peak: Peak,
        stats,
        *,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``stats``: the runtime's ``StageStats`` (read, never written)."""
        assert peak.flops > 0 and window_s > 0, f"need a positive peak and window, got {peak}, {window_s}"
        self.flops, self.peak, self.stats, self.window_s, self._clock = flops, peak, stats, window_s, clock
        self._marks: deque[tuple[float, float]] = deque([(clock(), self.model_flops())])  # (time, model FLOPs)

    @classmethod
    def for_runtime(cls, runtime, peak_tflops: float = 0.0, **kwargs) -> StageUtilisation:
        """The meter of a ``StageRuntime``'s stage, its device and precision, with the peak of
        ``SWARM_PEAK_TFLOPS`` (``peak_tflops`` > 0) or found by :func:`resolve_peak` (the
        threads in use: torch's, set from ``SWARM_NUM_THREADS`` at start)."""
        peak = resolve_peak(
            runtime.device,
            "bf16" if runtime.autocast else "fp32",
            threads=torch.get_num_threads(),
            setting_tflops=peak_tflops,
        )
        return cls(stage_flops(runtime.cfg, runtime.spec, runtime.lora), peak, runtime.stats, **kwargs)

    def model_flops(self) -> float:
        """Model FLOPs of the work done here that counts, since the start."""
        s = self.stats
        return self.flops.train(s.tokens_trained, s.token_pairs_trained) + self.flops.forward(
            s.tokens_evaluated + s.tokens_inferred, s.token_pairs_evaluated + s.token_pairs_inferred
        )

    def report(self) -> dict:
        """The stage's utilisation now (JSON): counters, the peak and where it came from, busy
        and wall FLOP/s and MFU. Each call may mark the wall window."""
        now, flops = self._clock(), self.model_flops()
        wall_s, wall_flops = self._window(now, flops)
        compute_s = self.stats.compute_s
        busy = flops / compute_s if compute_s > 0 else 0.0
        wall = wall_flops / wall_s if wall_s > 0 else 0.0
        return {
            "tokens_trained": self.stats.tokens_trained,
            "tokens_evaluated": self.stats.tokens_evaluated,
            "tokens_inferred": self.stats.tokens_inferred,
            "model_flops": flops,
            "compute_s": compute_s,
            **self.peak.to_json(),
            "flops_per_s_busy": busy,
            "mfu_busy": busy / self.peak.flops,
            "flops_per_s_wall": wall,
            "mfu_wall": wall / self.peak.flops,
            "window_s": round(wall_s, 3),
        }

    def _window(self, now: float, flops: float) -> tuple[float, float]:
        """(seconds, model FLOPs) from the window's first mark to now; marks ``now``."""
        if now - self._marks[-1][0] >= MARK_EVERY_S:
            self._marks.append((now, flops))
        while len(self._marks) > 1 and self._marks[1][0] <= now - self.window_s:
            self._marks.popleft()  # the newest mark at least window_s old starts the window
        since, flops_then = self._marks[0]
        return now - since, flops - flops_then
