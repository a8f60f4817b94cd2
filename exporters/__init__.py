"""sits-trace exporters: where finished spans go.

``build_exporters(cfg)`` composes the configured ones into an ``ExporterSet``:
OTLP (gRPC or HTTP/protobuf) when a collector is configured in [export] or by
OTEL_EXPORTER_OTLP_*; Prometheus /metrics when ``prometheus_port`` is set; JSON
lines to ``jsonl_path`` (stdout by default, the embedded default when no
collector is set). See docs/export.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sits_trace.agent.config import Config
from sits_trace.agent.model import AgentStats, Span
from sits_trace.agent.sinks import BatchSink

from ._base import Exporter, ExporterStats
from ._settings import otlp_settings
from .jsonl import JsonlExporter

log = logging.getLogger(__name__)

__all__ = ["Exporter", "ExporterSet", "ExporterStats", "build_exporters"]


class _HasStats(Protocol):
    def stats(self) -> AgentStats: ...


class ExporterSet:
    """Fans each span out to every exporter; never raises into the tracing pipeline."""

    def __init__(self, exporters: Sequence[Exporter]) -> None:
        self.exporters = list(exporters)
        self.errors = 0  # exceptions an exporter raised despite its contract
        self.agent: _HasStats | None = None

    def export_span(self, span: Span) -> None:
        self.export_spans((span,))

    def export_spans(self, spans: Sequence[Span]) -> None:
        """A batch to every exporter (each takes it in one call: one lock, one queue extend)."""
        for e in self.exporters:
            try:
                e.export(spans)
            except Exception:
                self.errors += 1
                log.debug("exporter %s raised", e.name, exc_info=True)

    @property
    def sink(self) -> BatchSink:
        """The tracer's sink: a span, or a batch of them (agent/sinks.py)."""
        return BatchSink(self.export_span, self.export_spans)

    def exporter_stats(self) -> list[ExporterStats]:
        out = []
        for e in self.exporters:
            try:
                out.append(e.stats())
            except Exception:
                log.debug("exporter %s: stats failed", e.name, exc_info=True)
        return out

    def agent_stats(self) -> AgentStats:
        return self.agent.stats() if self.agent is not None else AgentStats()

    def agent_samples(self) -> list[Any]:
        """The agent's node signals as (name, labels, value); none from an agent without."""
        fn = getattr(self.agent, "metric_samples", None)
        return list(fn()) if fn is not None else []

    def attach_agent(self, agent: _HasStats) -> None:
        """Keep the agent, whose stats() (and metric_samples(), node signals) the metrics
        exporters read at scrape/collect time."""
        self.agent = agent
        for e in self.exporters:
            attach = getattr(e, "attach_agent", None)
            if attach is not None:
                attach(self.agent_stats, self.agent_samples)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        ok = True
        for e in self.exporters:
            try:
                ok = e.force_flush(timeout_s) and ok
            except Exception:
                log.debug("exporter %s: flush raised", e.name, exc_info=True)
                ok = False
        return ok

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush and stop every exporter, each bounded by timeout_s."""
        for e in self.exporters:
            try:
                e.shutdown(timeout_s)
            except Exception:
                log.debug("exporter %s: shutdown raised", e.name, exc_info=True)


def build_exporters(cfg: Config, environ: Mapping[str, str] | None = None) -> ExporterSet:
    """The exporters `cfg` asks for. Raises ConfigError for a bad [export] value."""
    env = os.environ if environ is None else environ
    e = cfg.export
    otlp = otlp_settings(e, env)
    out = ExporterSet([])
    if otlp is not None:
        from .otlp import OtlpExporter  # noqa: PLC0415 - the gRPC/OTel stack only when configured

        out.exporters.append(OtlpExporter(otlp, exporter_stats=out.exporter_stats))
    if e.prometheus_port:
        from .prometheus import ProcessUsage, PrometheusExporter  # noqa: PLC0415 - prometheus-client only when configured

        service = e.service_name or env.get("OTEL_SERVICE_NAME", "")
        out.exporters.append(PrometheusExporter(
            e.prometheus_port, e.prometheus_address, service_name=service,
            max_label_sets=e.max_label_sets, exporter_stats=out.exporter_stats,
            usage=ProcessUsage()))
    # stdout is the default only without a collector; a file path is always honoured
    if e.jsonl_path and (e.jsonl_path != "-" or otlp is None):
        out.exporters.append(JsonlExporter(e.jsonl_path, capacity=e.queue_size,
                                           batch_size=e.batch_size))
    return out
