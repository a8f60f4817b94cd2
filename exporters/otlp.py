"""OTLP traces and metrics (gRPC or HTTP/protobuf).

Spans: each batch is encoded straight into one OTLP request (``_otlp_traces``: our spans
into opentelemetry-proto's messages, no SDK span object per span) and sent by our own
sender from our bounded queue and worker thread (``_queue.QueuedExporter``): a collector
that is down or slow fills the queue and costs dropped spans, never a stalled tracing
thread; a refused batch is retried with jittered backoff until the retry deadline. Spans
of one process share one resource (service.name, host.name, process.pid, container.id),
so a request groups them per process.

Metrics: RED duration histograms of the exported spans and the agent's health,
through the SDK's MeterProvider and a periodic OTLP metric exporter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from sits_trace.agent.model import AgentStats, AttrValue, Span

from ._base import ExporterStats
from ._otlp_traces import Transport, encode, sender
from ._queue import QueuedExporter, RetryPolicy
from ._red import LABELS, METRIC_OF_KIND, HistogramData, LabelSet, RedAggregator
from ._resource import ResourceResolver
from ._settings import OtlpSettings

log = logging.getLogger(__name__)

AgentStatsFn = Callable[[], AgentStats]
ExporterStatsFn = Callable[[], Sequence[ExporterStats]]
# Prometheus-style labels (_red.LABELS) -> OTel attribute names
_OTEL_ATTR = dict(zip(LABELS, ("service.name", "http.request.method", "http.route",
                               "http.response.status_code")))


def metric_exporter(s: OtlpSettings) -> MetricExporter:
    if s.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # noqa: PLC0415 - the protocol asked for only
            OTLPMetricExporter as GrpcMetricExporter,
        )

        return GrpcMetricExporter(endpoint=s.metrics_endpoint, headers=s.headers or None,
                                  timeout=s.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # noqa: PLC0415 - the protocol asked for only
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter(endpoint=s.metrics_endpoint, headers=s.headers or None,
                              timeout=s.timeout_s)


class _Resources:
    """A span's resource attributes (service, process, host, container)."""

    def __init__(self, resolver: ResourceResolver) -> None:
        self.attributes: Callable[[Span], Mapping[str, AttrValue]] = resolver.attributes


class _RedOnExport(MetricExporter):
    """The SDK's OTLP metric exporter, with the RED histograms added to each export: they are
    aggregated by our RedAggregator (the one Prometheus /metrics uses), not recorded span by
    span into SDK histograms, which cost 13-21 µs a span, as much as tracing it
    (docs/performance.md). Cumulative, or delta where the exporter prefers delta for
    histograms (OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE); counts re-weighted by
    sampling.probability as /metrics does."""

    def __init__(self, inner: MetricExporter, red: RedAggregator, scope: InstrumentationScope,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        temporality = dict(getattr(inner, "_preferred_temporality", None) or {})
        super().__init__(preferred_temporality=temporality,
                         preferred_aggregation=getattr(inner, "_preferred_aggregation", None))
        self.inner = inner
        self._red = red
        self._scope = scope
        self._clock = clock_ns
        self._start = self._last_ns = clock_ns()
        self._delta = temporality.get(SdkHistogram) == AggregationTemporality.DELTA
        self._last: dict[tuple[str, LabelSet], HistogramData] = {}

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        try:
            metrics_data = self._with_red(metrics_data)
        except Exception:  # the agent's own metrics still go
            log.debug("otlp metrics: RED histograms left out", exc_info=True)
        return self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

    def _with_red(self, data: MetricsData) -> MetricsData:
        now = self._clock()
        red = [m for m in (self._metric(name, now) for name in METRIC_OF_KIND.values())
               if m is not None]
        self._last_ns = now
        if not red or not data.resource_metrics:
            return data
        first = data.resource_metrics[0]
        scopes = list(first.scope_metrics)
        for i, sm in enumerate(scopes):
            if sm.scope.name == self._scope.name:
                scopes[i] = ScopeMetrics(sm.scope, [*sm.metrics, *red], sm.schema_url)
                break
        else:
            scopes.append(ScopeMetrics(self._scope, red, ""))
        return MetricsData([ResourceMetrics(first.resource, scopes, first.schema_url),
                            *data.resource_metrics[1:]])

    def _metric(self, name: str, now: int) -> Metric | None:
        points = []
        bounds = list(self._red.buckets)
        for labels, h in self._red.snapshot(name).items():
            attrs = {_OTEL_ATTR[k]: v for k, v in zip(LABELS, labels) if v != ""}
            if not self._delta:
                points.append(HistogramDataPoint(attrs, self._start, now, h.count, h.sum,
                                                 h.buckets, bounds, h.min, h.max))
                continue
            prev = self._last.get((name, labels))
            self._last[(name, labels)] = h
            if prev is None:  # the first interval holds everything so far
                points.append(HistogramDataPoint(attrs, self._last_ns, now, h.count, h.sum,
                                                 h.buckets, bounds, h.min, h.max))
                continue
            if h.count == prev.count:
                continue  # nothing new in this interval: no point, as the SDK does
            # a later interval's min and max are not known from two cumulative snapshots:
            # left out (they are optional in OTLP)
            points.append(HistogramDataPoint(
                attrs, self._last_ns, now, h.count - prev.count, h.sum - prev.sum,
                [a - b for a, b in zip(h.buckets, prev.buckets)], bounds,
                None, None))  # type: ignore[arg-type]
        if not points:
            return None
        temporality = (AggregationTemporality.DELTA if self._delta
                       else AggregationTemporality.CUMULATIVE)
        return Metric(name, f"Duration of {name}", "s", Histogram(points, temporality))

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class _Metrics:
    """RED histograms + agent health over OTLP, through the SDK's MeterProvider."""

    def __init__(self, s: OtlpSettings, exporter: MetricExporter, resource: Resource,
                 exporter_stats: ExporterStatsFn) -> None:
        self.agent_stats: AgentStatsFn | None = None
        self._exporter_stats = exporter_stats
        self.red = RedAggregator(s.max_label_sets)
        self._exporter = _RedOnExport(exporter, self.red,
                                      InstrumentationScope("sits-trace", "0.1.0"))
        reader = PeriodicExportingMetricReader(
            self._exporter, export_interval_millis=s.metrics_interval_s * 1000,
            export_timeout_millis=s.timeout_s * 1000)
        self.provider = MeterProvider(metric_readers=[reader], resource=resource)
        meter = self.provider.get_meter("sits-trace", "0.1.0")
        meter.create_observable_counter("sits.bpf.events", [self._kernel("kernel_seen")],
                                        unit="{event}")
        meter.create_observable_counter("sits.bpf.events.lost", [self._kernel("kernel_lost")],
                                        unit="{event}")
        meter.create_observable_gauge("sits.connections.active", [self._active],
                                      unit="{connection}")
        meter.create_observable_counter("sits.spans.exported", [self._exported], unit="{span}")
        meter.create_observable_counter("sits.spans.dropped", [self._dropped], unit="{span}")
        meter.create_observable_gauge("sits.export.queue", [self._depth], unit="{span}")

    def record(self, batch: Iterable[Span], resources: _Resources) -> None:
        """A batch into the RED histograms (the exporter thread, once per batch sent)."""
        attributes = resources.attributes
        self.red.observe_many(batch, lambda span: str(attributes(span).get("service.name", "")))

    def _stats(self) -> AgentStats:
        return self.agent_stats() if self.agent_stats is not None else AgentStats()

    def _kernel(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def cb(_opts: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {"kind": k}) for k, v in (getattr(self._stats(), key) or {}).items()]
        return cb

    def _active(self, _opts: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._stats().count("conns_active"))]

    def _exported(self, _opts: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.exported, {"exporter": s.exporter}) for s in self._exporter_stats()]

    def _dropped(self, _opts: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"exporter": s.exporter, "reason": r})
                for s in self._exporter_stats() for r, n in s.dropped.items()]

    def _depth(self, _opts: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.queue_depth, {"exporter": s.exporter})
                for s in self._exporter_stats()]

    def shutdown(self, timeout_s: float) -> None:
        """The provider's last export, cut short after timeout_s (the SDK retries for longer)."""
        def last_export() -> None:
            try:
                self.provider.shutdown(timeout_millis=timeout_s * 1000)
            except Exception:
                log.debug("otlp metrics: shutdown failed", exc_info=True)

        t = threading.Thread(target=last_export, name="sits-otlp-metrics-stop", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            try:
                self._exporter.shutdown(timeout_millis=0)  # ends the SDK's retry wait
            except Exception:
                log.debug("otlp metrics: exporter shutdown failed", exc_info=True)
            t.join(1.0)


class OtlpExporter:
    """Spans to an OTLP collector, behind a bounded queue on the exporter's own thread."""

    def __init__(self, settings: OtlpSettings, *, metrics: MetricExporter | None = None,
                 proc_root: str = "/proc",
                 hostname: str | None = None, exporter_stats: ExporterStatsFn | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.name = f"otlp-{'grpc' if settings.protocol == 'grpc' else 'http'}"
        self.settings = settings
        self._resources = _Resources(ResourceResolver(
            service_name=settings.service_name, extra=settings.resource_attributes,
            proc_root=proc_root, hostname=hostname))
        self._sender = sender(settings.protocol, Transport(
            settings.traces_endpoint, settings.headers, settings.timeout_s, settings.gzip,
            settings.certificate, settings.client_key, settings.client_certificate))
        self._metrics: _Metrics | None = None
        if settings.metrics:
            agent = Resource({"service.name": "sits-trace",
                              "host.name": hostname or _hostname(), **settings.resource_attributes})
            self._metrics = _Metrics(settings, metrics or metric_exporter(settings), agent,
                                     exporter_stats or (lambda: [self.stats()]))
        self._queue = QueuedExporter(
            self.name, self._send, capacity=settings.queue_size, batch_size=settings.batch_size,
            batch_delay_s=settings.batch_delay_s,
            retry=retry or RetryPolicy(deadline_s=settings.retry_deadline_s),
            interrupt=self._sender.close, on_batch=self._record)

    def _record(self, batch: list[Span]) -> None:
        if self._metrics is not None:
            self._metrics.record(batch, self._resources)

    def _send(self, batch: list[Span]) -> bool:
        return self._sender.send(encode(batch, self._resources.attributes))

    def attach_agent(self, stats: AgentStatsFn, samples: Callable[[], Any] | None = None) -> None:
        """`samples` (the agent's node signals) are exported by Prometheus only, for now."""
        if self._metrics is not None:
            self._metrics.agent_stats = stats

    def export(self, spans: Sequence[Span]) -> None:
        self._queue.export(spans)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        ok = self._queue.force_flush(timeout_s)
        if self._metrics is not None:
            try:
                ok = self._metrics.provider.force_flush(int(timeout_s * 1000)) and ok
            except Exception:
                log.debug("otlp metrics: flush failed", exc_info=True)
                ok = False
        return ok

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush spans, then metrics; bounded by timeout_s (plus 1 s for the metrics' last try)."""
        deadline = time.monotonic() + timeout_s
        self._queue.shutdown(timeout_s)
        if self._metrics is not None:
            self._metrics.shutdown(max(deadline - time.monotonic(), 1.0))

    def stats(self) -> ExporterStats:
        return self._queue.stats()


def _hostname() -> str:
    import socket  # noqa: PLC0415 - once, for the default host name

    return socket.gethostname()
