"""The stage server's metrics beyond the HTTP edge (see ``shared.metrics``).

Read at scrape time from the objects that hold them: the runtime's counters (forwards,
backwards, samples, optimizer steps), the compute worker's queue and busy time, the
averager's rounds, the stage's model FLOPs utilisation (``utilisation.py``). Counted as
they pass: tensor payload bytes by direction and codec.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiohttp import web

from services.stage_server.utilisation import StageUtilisation
from shared.metrics import Metrics, counter, gauge, tensor_bytes


class StageMetrics:
    """Registers the stage's state collector on ``metrics``; counts tensor bytes as they pass."""

    def __init__(self, metrics: Metrics, runtime, worker, averager, utilisation: StageUtilisation | None = None):
        """``utilisation``: the stage's MFU meter (None: one with the peak found for the runtime's device)."""
        self.runtime, self.worker, self.averager = runtime, worker, averager
        self.utilisation = utilisation or StageUtilisation.for_runtime(runtime)
        self.tensor_bytes = metrics.counter(
            "swarm_stage_tensor_bytes",
            "tensor payload bytes of /forward and /backward, by direction and wire codec",
            ["direction", "codec"],
        )
        # wire bytes per sample of the activation that crosses this stage's boundary (the
        # forward's outputs; the last stage: its inputs), as last seen on a training forward;
        # heartbeats report it so that the coordinator's placement knows the pipeline traffic
        self.activation_bytes_per_sample = 0.0
        metrics.add_state(self.collect)

    def note_activation(self, tensor: Mapping | None, samples: int) -> None:
        """Record the wire size per sample of an activation (an encoded tensor) of ``samples`` samples."""
        if tensor is not None and samples > 0:
            self.activation_bytes_per_sample = sum(tensor_bytes({"outputs": tensor}).values()) / samples

    def count_tensors(self, direction: str, msg: Mapping) -> None:
        """Count the wire tensors of a request (``direction="in"``) or reply (``"out"``)."""
        for codec, size in tensor_bytes(msg).items():
            self.tensor_bytes.labels(direction, codec).inc(size)

    def collect(self) -> Iterable:
        stats, worker, averager = self.runtime.stats, self.worker, self.averager
        yield counter("swarm_stage_forwards", "forward passes run (evaluation included)", stats.forwards)
        yield counter("swarm_stage_backwards", "backward passes run", stats.backwards)
        yield counter("swarm_stage_samples", "samples whose backward ran here (rate() = samples/s)", stats.samples)
        yield counter(
            "swarm_stage_optimizer_steps",
            "global steps taken (every replica of a stage: the same)",
            stats.optimizer_steps,
        )
        yield gauge(
            "swarm_stage_global_step", "the stage's global step: its weights' version in steps", stats.optimizer_steps
        )
        yield gauge(
            "swarm_stage_effective_batch",
            "samples that went into the last step's all-reduced gradient (all replicas)",
            stats.last_effective_batch,
        )
        yield counter(
            "swarm_stage_samples_dropped",
            "accumulated samples that reached no step (a round this replica missed, a resync)",
            stats.samples_dropped,
        )
        yield counter(
            "swarm_stage_duplicate_backwards",
            "backwards of a microbatch already accumulated: answered, not accumulated",
            stats.duplicate_backwards,
        )
        yield counter(
            "swarm_stage_stale_backwards",
            "backwards refused (409): their forward's weights not kept, or more than SWARM_MAX_STALENESS steps old",
            stats.stale_backwards,
        )
        yield counter(
            "swarm_stage_stale_gradients",
            "backwards accumulated into a later step than that of the weights they ran on (at most "
            "SWARM_MAX_STALENESS later)",
            stats.stale_gradients,
        )
        yield counter(
            "swarm_stage_backward_cache_hits", "backwards that reused a cached forward graph", stats.cache_hits
        )
        yield counter(
            "swarm_stage_backward_recomputes",
            "backwards that recomputed their forward on its weights version (its graph not cached here)",
            stats.recomputes,
        )
        yield counter(
            "swarm_stage_other_weights_backwards",
            "backwards computed on other weights than their forward's (0 by construction: a check)",
            stats.other_weights_backwards,
        )
        yield gauge(
            "swarm_stage_weight_versions_kept",
            "weights versions held for backwards in flight, the current one included (at most SWARM_MAX_STALENESS + 1)",
            self.runtime.versions_kept,
        )
        yield gauge(
            "swarm_stage_weight_versions_kept_bytes",
            "bytes of the older weights versions held for backwards in flight",
            self.runtime.kept_bytes(),
        )
        yield counter("swarm_stage_compute_seconds", "seconds of forward and backward compute", stats.compute_s)
        yield counter("swarm_stage_busy_seconds", "seconds the compute worker spent on jobs", worker.busy_s)
        yield gauge(
            "swarm_stage_queue_depth", "jobs accepted by the compute worker and not finished", worker.queue_depth
        )
        yield gauge(
            "swarm_stage_throughput_samples_per_second",
            "samples per busy second: what the heartbeat reports",
            stats.samples / worker.busy_s if worker.busy_s else 0.0,
        )
        yield gauge(
            "swarm_stage_activation_bytes_per_sample",
            "wire bytes per sample of the activation crossing this stage's boundary (last training forward)",
            self.activation_bytes_per_sample,
        )
        yield from self.collect_utilisation()
        yield gauge("swarm_stage_weights_version", "bumped by every change of the weights", self.runtime.version)
        yield gauge("swarm_stage_draining", "1 while the server drains before it stops", float(worker.draining))
        failed = max(0, averager.rounds_started - averager.rounds_completed - int(averager.running))
        yield counter(
            "swarm_stage_averaging_bytes_sent",
            "bytes this server sent in averaging and step rounds (parts and reductions), counted as each round ends",
            averager.bytes_sent,
        )
        yield counter(
            "swarm_stage_averaging_rounds",
            "averaging rounds this server took part in, by outcome",
            {("completed",): averager.rounds_completed, ("failed",): failed},
            ["outcome"],
        )

    def collect_utilisation(self) -> Iterable:
        """Model FLOPs, the peak (labelled with its source), achieved FLOP/s and MFU (busy, wall)."""
        u = self.utilisation.report()
        yield counter(
            "swarm_stage_tokens",
            "tokens whose work counts as model FLOPs: trained (gradient accumulated here), evaluated, or inferred "
            "(new positions of inference sessions)",
            {
                ("trained",): u["tokens_trained"],
                ("evaluated",): u["tokens_evaluated"],
                ("inferred",): u["tokens_inferred"],
            },
            ["kind"],
        )
        yield counter(
            "swarm_stage_model_flops",
            "model FLOPs of the stage's layers for those tokens (forward + backward trained, forward evaluated; "
            "re-runs and recomputes not counted); rate() / swarm_stage_peak_flops = MFU over any window",
            u["model_flops"],
        )
        yield gauge(
            "swarm_stage_peak_flops",
            "peak FLOP/s of the device for the stage's precision and threads, and where it came from: setting "
            "(SWARM_PEAK_TFLOPS), table (a known GPU's dense datasheet figure) or probe (a measured matmul)",
            {(u["peak_source"], u["peak_device"]): u["peak_flops"]},
            ["source", "device"],
        )
        yield gauge(
            "swarm_stage_achieved_flops",
            "model FLOP/s achieved: over the forward and backward compute seconds (busy, since the start) or over the "
            "wall clock of the last minute (wall)",
            {("busy",): u["flops_per_s_busy"], ("wall",): u["flops_per_s_wall"]},
            ["basis"],
        )
        yield gauge(
            "swarm_stage_mfu",
            "model FLOPs utilisation: swarm_stage_achieved_flops over swarm_stage_peak_flops (busy, wall)",
            {("busy",): u["mfu_busy"], ("wall",): u["mfu_wall"]},
            ["basis"],
        )


STAGE_METRICS = web.AppKey("stage_metrics", StageMetrics)
