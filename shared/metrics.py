"""Prometheus metrics: one registry per app, a middleware for the HTTP edge, state read when scraped.

Every service answers ``GET /metrics`` in the Prometheus text format (no auth: like
``/health`` it is a plain route). Request counts, latency and body bytes per endpoint
come from :func:`metrics_middleware`; values that live in a service's own objects (queue
depth, optimizer steps, replicas per stage) are read at scrape time through
:meth:`Metrics.add_state`, so they are always current and no code path has to remember
to update them. Each app has its own :class:`~prometheus_client.CollectorRegistry`, so
several apps in one process (tests) never collide.

Names: ``swarm_http_*`` for the HTTP edge of any service, ``swarm_stage_*`` (stage
server), ``swarm_coordinator_*``, ``swarm_trainer_*``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# The classic text format (0.0.4), which every Prometheus version scrapes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UNMATCHED = "unmatched"  # endpoint label of requests no route matched (keeps label values bounded)


class _StateCollector:
    """Adapts ``collect() -> metric families`` to the registry's collector protocol."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())

    def describe(self) -> list:
        return []  # read at scrape time only; the registry does not check these names for clashes


class Metrics:
    """The metrics of one app (or one trainer): HTTP edge metrics plus any the service adds."""

    def __init__(self, service: str, **info: str):
        self.registry = CollectorRegistry()
        build = Gauge(
            "swarm_build_info", "1, labelled with what this process is", ["service", *info], registry=self.registry
        )
        build.labels(service, *info.values()).set(1)
        self.requests = self.counter(
            "swarm_http_requests",
            "HTTP requests answered, by endpoint, method and status",
            ["endpoint", "method", "status"],
        )
        self.latency = self.histogram(
            "swarm_http_request_duration_seconds", "time from request to answer, by endpoint", ["endpoint", "method"]
        )
        self.bytes_in = self.counter(
            "swarm_http_request_bytes",
            "request body bytes received (declared Content-Length), by endpoint",
            ["endpoint"],
        )
        self.bytes_out = self.counter(
            "swarm_http_response_bytes", "response body bytes sent, by endpoint", ["endpoint"]
        )

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS_S
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def add_state(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Families built by ``collect()`` on every scrape (use :func:`gauge` / :func:`counter`)."""
        self.registry.register(_StateCollector(collect))

    def observe_request(
        self, endpoint: str, method: str, status: int, seconds: float, bytes_in: int, bytes_out: int
    ) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()
        self.latency.labels(endpoint, method).observe(seconds)
        self.bytes_in.labels(endpoint).inc(bytes_in)
        self.bytes_out.labels(endpoint).inc(bytes_out)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gauge(
    name: str, doc: str, values: float | Mapping[tuple[str, ...], float], labels: Sequence[str] = ()
) -> GaugeMetricFamily:
    """A gauge family: one value, or ``{label values: value}`` for ``labels``."""
    return _family(GaugeMetricFamily(name, doc, labels=labels if labels else None), values, labels)


def counter(
    name: str, doc: str, values: float | Mapping[tuple[str, ...], float], labels: Sequence[str] = ()
) -> CounterMetricFamily:
    """A counter family (its samples are named ``<name>_total``); values as for :func:`gauge`."""
    return _family(CounterMetricFamily(name, doc, labels=labels if labels else None), values, labels)


def _family(family, values, labels: Sequence[str]):
    if not labels:
        family.add_metric([], float(values))
        return family
    for label_values, value in values.items():
        family.add_metric([str(v) for v in label_values], float(value))
    return family


WIRE_CODECS = ("fp32", "fp16", "bf16", "int8", "raw")
TENSOR_FIELDS = ("inputs", "targets", "grad_outputs", "outputs", "grad_inputs")


def tensor_bytes(msg: Mapping) -> dict[str, int]:
    """Payload bytes (data, plus int8 scales) of the wire tensors in a ``/forward`` or
    ``/backward`` message or reply, by codec; a codec no peer should send counts as 'other',
    so label values stay bounded whatever arrives."""
    out: dict[str, int] = {}
    for name in TENSOR_FIELDS:
        tensor = msg.get(name)
        if isinstance(tensor, Mapping) and isinstance(tensor.get("codec"), str):
            codec = tensor["codec"] if tensor["codec"] in WIRE_CODECS else "other"
            size = sum(
                len(tensor[k]) for k in ("data", "absmax") if isinstance(tensor.get(k), (bytes, bytearray, memoryview))
            )
            out[codec] = out.get(codec, 0) + size
    return out


def endpoint_of(request: web.Request) -> str:
    """The route's path template (``/forward``), never the raw path: label values stay bounded."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


def metrics_middleware(metrics: Metrics):
    """Counts every request by endpoint, method and status, and times it. Put it first
    (outermost), so it sees the status the error middleware answered."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        started, status, response = time.perf_counter(), 500, None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away before the answer
            raise
        finally:
            sent = 0
            if response is not None:
                sent = getattr(response, "content_length", None) or response.body_length
            metrics.observe_request(
                endpoint_of(request),
                request.method,
                status,
                time.perf_counter() - started,
                request.content_length or 0,
                sent,
            )

    return middleware


METRICS = web.AppKey("metrics", Metrics)


async def metrics_handler(request: web.Request) -> web.Response:
    """``GET /metrics``: the app's registry in the Prometheus text format."""
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


def add_metrics_route(app: web.Application, metrics: Metrics) -> None:
    """Serve ``metrics`` at ``GET /metrics`` (a plain route: never behind auth)."""
    app[METRICS] = metrics
    app.router.add_get("/metrics", metrics_handler)


class MetricsServer:
    """A small HTTP server with only ``GET /metrics``, for a process that is no server
    itself (the trainer): ``await start(host, port)`` (port 0: any free one), ``await close()``."""

    def __init__(self, metrics: Metrics):
        app = web.Application(middlewares=[metrics_middleware(metrics)])
        add_metrics_route(app, metrics)
        self._runner = web.AppRunner(app, access_log=None)
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port``; returns the URL of the endpoint."""
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host, port).start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self.url = f"http://{host}:{self._runner.addresses[0][1]}/metrics"
        return self.url

    async def close(self) -> None:
        await self._runner.cleanup()
