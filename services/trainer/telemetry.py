"""The trainer's metrics, its metrics endpoint, and its progress reports to the coordinator.

The trainer is a client, not a server: with ``SWARM_METRICS_PORT`` set it serves
``GET /metrics`` on that port while it trains (Prometheus scrapes it like any service).
Metrics: hops by stage, kind and outcome with their latency, tensor bytes sent and
received by codec, microbatches completed and failed, tokens, and the latest step with
its loss and tokens/s.

With a coordinator, the step records also go to it (``POST /progress``), those of the
last ``REPORT_EVERY_S`` in one report, for the dashboard's loss and throughput charts.
Reports are best effort: a slow or absent coordinator never slows training (a failed
report is logged and its records are sent with the next one; at most
``MAX_PENDING_RECORDS`` wait, the oldest are dropped).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping

import aiohttp

from shared import package_version
from shared.errors import RemoteError
from shared.http import post_json
from shared.metrics import Metrics, MetricsServer, tensor_bytes

REPORT_EVERY_S = 1.0
REPORT_TIMEOUT_S = 2.0
MAX_PENDING_RECORDS = 256  # the coordinator takes at most this many per report
HOP_OUTCOMES = frozenset(
    {
        "ok",
        "timeout",
        "unreachable",
        "overloaded",
        "draining",
        "wrong_stage",
        "bad_payload",
        "bad_reply",
        "no_replica",
        "stale_forward",
    }
)


class TrainerTelemetry:
    def __init__(self, *, run_id: str, trainer_id: str, log=None):
        self.run_id, self.trainer_id, self.log = run_id, trainer_id, log
        self.metrics = m = Metrics("trainer", run_id=run_id, trainer=trainer_id, version=package_version())
        self.hops = m.counter(
            "swarm_trainer_hops",
            "hops (one stage's /forward or /backward) by stage, kind and outcome",
            ["stage", "kind", "outcome"],
        )
        self.hop_latency = m.histogram(
            "swarm_trainer_hop_duration_seconds", "time of a hop that succeeded, by stage and kind", ["stage", "kind"]
        )
        self.bytes = m.counter(
            "swarm_trainer_tensor_bytes",
            "tensor payload bytes sent to and received from stage servers, by codec",
            ["direction", "codec"],
        )
        self.microbatches = m.counter(
            "swarm_trainer_microbatches",
            "training microbatches by outcome (rerun: run again from the start after a stale backward)",
            ["outcome"],
        )
        self.tokens = m.counter("swarm_trainer_tokens", "tokens of the microbatches that completed")
        self.step = m.gauge(
            "swarm_trainer_step", "the swarm's global step as this trainer saw it last (stage 0's step)"
        )
        self.loss = m.gauge("swarm_trainer_loss", "mean loss of this trainer's microbatches of the latest global step")
        self.tokens_per_s = m.gauge("swarm_trainer_tokens_per_second", "tokens per second since training started")
        for outcome in ("completed", "failed", "rerun"):
            self.microbatches.labels(outcome)  # present (at 0) from the first scrape
        self.latest: dict | None = None  # the latest step record
        self._pending: deque[dict] = deque(maxlen=MAX_PENDING_RECORDS)  # step records not reported yet
        self._server: MetricsServer | None = None
        self._reporter: asyncio.Task | None = None
        self.report_failures = 0

    # ------------------------------------------------------------ what the trainer observes
    def hop(
        self, stage: int, kind: str, seconds: float, outcome: str, sent: Mapping, reply: Mapping | None = None
    ) -> None:
        """One hop: ``sent`` is the request message, ``reply`` the decoded answer (if any)."""
        self.hops.labels(str(stage), kind, outcome if outcome in HOP_OUTCOMES else "error").inc()
        if outcome == "ok":
            self.hop_latency.labels(str(stage), kind).observe(seconds)
        for direction, msg in (("sent", sent), ("received", reply or {})):
            for codec, size in tensor_bytes(msg).items():
                self.bytes.labels(direction, codec).inc(size)

    def microbatch_done(self, tokens: int) -> None:
        self.microbatches.labels("completed").inc()
        self.tokens.inc(tokens)

    def microbatch_failed(self) -> None:
        self.microbatches.labels("failed").inc()

    def microbatch_rerun(self) -> None:
        self.microbatches.labels("rerun").inc()

    def step_done(self, record: dict) -> None:
        """A step's record ``{step, loss, tokens_per_s, elapsed_s}`` (the trainer's ``on_step``)."""
        self.step.set(record["step"])
        self.loss.set(float("nan") if record["loss"] is None else record["loss"])
        self.tokens_per_s.set(record["tokens_per_s"])
        self.latest = record
        self._pending.append(record)

    # ------------------------------------------------------------ serving and reporting
    async def start(self, session: aiohttp.ClientSession, *, coordinator: str, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` (port 0: not at all) and report progress to
        ``coordinator`` (empty: no reports) until :meth:`stop`."""
        if port:
            server = MetricsServer(self.metrics)
            try:
                url = await server.start(host, port)
            except OSError as exc:
                raise ValueError(
                    f"cannot serve metrics on {host}:{port} (SWARM_METRICS_HOST, SWARM_METRICS_PORT): {exc}"
                ) from None
            self._server = server
            if self.log:
                self.log.info("metrics.serving", url=url)
        if coordinator:
            self._session, self._coordinator = session, coordinator
            self._reporter = asyncio.create_task(self._report_loop(), name="progress-reports")

    async def stop(self) -> None:
        """Send the last progress report (bounded by its timeout), then stop serving."""
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)
            self._reporter = None
            await self.report(self._session, self._coordinator)
        if self._server is not None:
            await self._server.close()
            self._server = None

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            await self.report(self._session, self._coordinator)

    async def report(self, session: aiohttp.ClientSession, coordinator: str) -> bool:
        """Send the step records not reported yet; False if there were none or it failed."""
        records = list(self._pending)
        if not records:
            return False
        body = {"run_id": self.run_id, "trainer_id": self.trainer_id, "records": records}
        try:
            await post_json(session, coordinator + "/progress", body, timeout_s=REPORT_TIMEOUT_S)
        except RemoteError as exc:
            self.report_failures += 1
            if self.log and (self.report_failures in (1, 10) or self.report_failures % 100 == 0):
                self.log.warning(
                    "progress.report_failed", coordinator=coordinator, error=str(exc), failures=self.report_failures
                )
            return False
        sent = {id(r) for r in records}  # steps that completed meanwhile stay pending
        while self._pending and id(self._pending[0]) in sent:
            self._pending.popleft()
        return True
