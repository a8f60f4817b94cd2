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
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from sits_trace.agent.model import AgentStats, AttrValue, Span

from ._base import ExporterStats
from ._otlp_traces import Transport, encode, sender
from ._queue import QueuedExporter, RetryPolicy
from ._red import DURATION_BUCKETS_S, LABELS, METRIC_OF_KIND, LabelLimiter, span_labels
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


class _Metrics:
    """RED histograms + agent health over OTLP, through the SDK's MeterProvider."""

    def __init__(self, s: OtlpSettings, exporter: MetricExporter, resource: Resource,
                 exporter_stats: ExporterStatsFn) -> None:
        self.agent_stats: AgentStatsFn | None = None
        self._exporter_stats = exporter_stats
        self._limiters = {m: LabelLimiter(s.max_label_sets) for m in METRIC_OF_KIND.values()}
        self._exporter = exporter
        reader = PeriodicExportingMetricReader(
            exporter, export_interval_millis=s.metrics_interval_s * 1000,
            export_timeout_millis=s.timeout_s * 1000)
        views = [View(instrument_name=m, aggregation=ExplicitBucketHistogramAggregation(
            list(DURATION_BUCKETS_S))) for m in METRIC_OF_KIND.values()]
        self.provider = MeterProvider(metric_readers=[reader], resource=resource, views=views)
        meter = self.provider.get_meter("sits-trace", "0.1.0")
        self._hist = {m: meter.create_histogram(m, unit="s", description=f"Duration of {m}")
                      for m in METRIC_OF_KIND.values()}
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
        for span in batch:
            metric = METRIC_OF_KIND.get(span.kind)
            if metric is None:
                continue
            service = str(resources.attributes(span).get("service.name", ""))
            labels = self._limiters[metric].admit(span_labels(span, service))
            attrs = {_OTEL_ATTR[k]: v for k, v in zip(LABELS, labels) if v != ""}
            dur = max(span.end_time_unix_nano - span.start_time_unix_nano, 0) / 1e9
            # unweighted: the SDK's histograms take no weight, and recording a span shed
            # as 1 in 2**n that many times would spend the CPU shedding saved; spans carry
            # sampling.probability for backends that re-weight (Prometheus /metrics does)
            self._hist[metric].record(dur, attrs)

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
