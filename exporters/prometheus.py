"""A /metrics endpoint (prometheus-client) whose values are read at scrape time.

RED metrics of the traced services (``http_server_request_duration_seconds``,
``http_client_request_duration_seconds``) are aggregated as spans arrive; the
agent's own health (BPF events seen/lost, connections, parser resyncs, spans
exported/dropped and queue depth per exporter, CPU and RSS) is read from
``agent.stats()``, the exporters' ``stats()`` and the process at each scrape.
Node signals come from ``agent.metric_samples()`` at each scrape, under the names the
agent's feature frame gives them (``analyzers/features.py, exporters/node_metrics.py``: DCGM field names for GPU state,
``sits_<signal>`` for the rest); a name ending in ``_total`` is a counter, the rest gauges.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    Exemplar,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sits_trace.agent.model import AgentStats, Span

from . import _genai
from ._base import ExporterStats
from ._red import LABELS, HistogramData, RedAggregator

log = logging.getLogger(__name__)

AgentStatsFn = Callable[[], AgentStats]
# (name, labels, value) triples: agent.model.MetricSample or anything shaped like it
NodeSamples = Callable[[], Iterable[tuple[str, dict[str, str], float]]]
ExporterStatsFn = Callable[[], Sequence[ExporterStats]]
DROP_REASONS = ("queue_full", "export_failed")

_PROM_NAME = {"http.server.request.duration": "http_server_request_duration_seconds",
              "http.client.request.duration": "http_client_request_duration_seconds"}
_TRACER_COUNTERS = (  # AgentStats.count() key -> metric, help
    ("records", "sits_ring_records", "Records read from the BPF ring buffer."),
    ("decode_errors", "sits_decode_errors", "Ring records that could not be decoded."),
    ("spans", "sits_spans", "Spans assembled by the tracer."),
    ("spans_filtered", "sits_spans_filtered", "Spans left out by the port filter."),
    ("conns_opened", "sits_connections_opened", "Connections seen opening."),
    ("conns_closed", "sits_connections_closed", "Connections seen closing."),
    ("exchanges_shed", "sits_exchanges_shed",
     "HTTP exchanges the kernel counted but did not capture while the agent shed load "
     "(trace.cpu_budget); RED histograms re-weight the captured ones."),
    ("conns_muted", "sits_connections_muted",
     "Connections found to carry no HTTP whose bytes the kernel no longer sends "
     "(trace.mute_non_http)."),
)


class ProcessUsage:
    """CPU seconds and resident bytes of a process (psutil; /proc/<pid>/stat without it)."""

    def __init__(self, pid: int | None = None) -> None:
        import psutil  # noqa: PLC0415 - psutil only when /metrics is on

        self._proc = psutil.Process(pid)

    def cpu_seconds(self) -> float:
        t = self._proc.cpu_times()
        return float(t.user + t.system)

    def rss_bytes(self) -> int:
        return int(self._proc.memory_info().rss)


class SitsCollector(Collector):
    """Everything on /metrics, computed when Prometheus scrapes."""

    def __init__(self, red: RedAggregator, exporter_stats: ExporterStatsFn,
                 usage: ProcessUsage | None = None) -> None:
        self.red = red
        self.genai = _genai.GenAiAggregator()
        self.exporter_stats = exporter_stats
        self.agent_stats: AgentStatsFn | None = None
        self.node_samples: NodeSamples | None = None
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        for fn in (self._red, self._genai, self._agent, self._node, self._exporters, self._process):
            try:
                yield from fn()
            except Exception:
                log.warning("metrics: %s failed", fn.__name__, exc_info=True)

    def _red(self) -> Iterator[Metric]:
        bounds = [str(b) for b in self.red.buckets] + ["+Inf"]
        overflow = CounterMetricFamily("sits_metric_label_overflow",
                                       "Observations whose route was folded into _other.",
                                       labels=["metric"])
        for otel_name, prom_name in _PROM_NAME.items():
            fam = HistogramMetricFamily(prom_name, f"Duration of HTTP {otel_name.split('.')[1]}"
                                        " requests (OTel semconv " + otel_name + ").",
                                        labels=list(LABELS), unit="seconds")
            for labels, h in sorted(self.red.snapshot(otel_name).items()):
                fam.add_metric(list(labels), _cumulative(bounds, h), h.sum)
            yield fam
            overflow.add_metric([prom_name], self.red.overflowed(otel_name))
        yield overflow

    def _genai(self) -> Iterator[Metric]:
        for otel_name, (_, buckets) in _genai.METRICS.items():
            bounds = [str(b) for b in buckets] + ["+Inf"]
            fam = HistogramMetricFamily(otel_name.replace(".", "_") + "_seconds",
                                        f"OTel GenAI semconv {otel_name}, from streamed responses"
                                        " on the node.", labels=list(_genai.LABELS),
                                        unit="seconds")
            for labels, h in sorted(self.genai.snapshot(otel_name).items()):
                fam.add_metric(list(labels), _cumulative(bounds, h), h.sum)
            yield fam

    def _agent(self) -> Iterator[Metric]:
        stats = self.agent_stats() if self.agent_stats is not None else AgentStats()
        yield from _kernel_metrics(stats)
        active = GaugeMetricFamily("sits_connections_active", "Connections the tracer follows now.")
        active.add_metric([], float(stats.count("conns_active")))
        yield active
        yield GaugeMetricFamily("sits_capture_shift",
                                "Load shedding: the kernel captures one exchange in 2^shift.",
                                value=float(stats.count("capture_shift")))
        for key, name, doc in _TRACER_COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(stats.count(key)))
        yield CounterMetricFamily("sits_parser_resyncs", "HTTP parser resynchronisations.",
                                  value=float(stats.parser_count("resyncs")))
        yield CounterMetricFamily("sits_parser_malformed", "Malformed HTTP messages seen.",
                                  value=float(stats.parser_count("malformed")))
        yield CounterMetricFamily("sits_parser_internal_errors",
                                  "Exceptions caught in the HTTP parser (the connection then "
                                  "resyncs) or in a span consumer: a bug in the agent.",
                                  value=float(stats.parser_count("internal_errors")))
        failed = GaugeMetricFamily("sits_probe_failed", "1 for each probe that did not attach.",
                                   labels=["probe", "group", "required"])
        for p in stats.probes or []:
            failed.add_metric([str(p.get("name", "")), str(p.get("group", "")),
                               str(bool(p.get("required"))).lower()], 1.0)
        yield failed

    def _node(self) -> Iterator[Metric]:
        if self.node_samples is None:
            return
        yield from node_families(self.node_samples())

    def _exporters(self) -> Iterator[Metric]:
        exported = CounterMetricFamily("sits_spans_exported", "Spans an exporter delivered.",
                                       labels=["exporter"])
        dropped = CounterMetricFamily("sits_spans_dropped", "Spans an exporter gave up on.",
                                      labels=["exporter", "reason"])
        errors = CounterMetricFamily("sits_export_errors", "Failed export attempts.",
                                     labels=["exporter"])
        depth = GaugeMetricFamily("sits_export_queue_spans", "Spans waiting in an exporter's queue.",
                                  labels=["exporter"])
        cap = GaugeMetricFamily("sits_export_queue_capacity_spans",
                                "Spans an exporter's queue holds at most.", labels=["exporter"])
        for s in self.exporter_stats():
            exported.add_metric([s.exporter], float(s.exported))
            for reason in sorted(set(DROP_REASONS) | set(s.dropped)):
                dropped.add_metric([s.exporter, reason], float(s.dropped.get(reason, 0)))
            errors.add_metric([s.exporter], float(s.export_errors))
            depth.add_metric([s.exporter], float(s.queue_depth))
            cap.add_metric([s.exporter], float(s.queue_capacity))
        yield from (exported, dropped, errors, depth, cap)

    def _process(self) -> Iterator[Metric]:
        if self.usage is None:
            return
        yield CounterMetricFamily("sits_agent_cpu_seconds", "CPU time of the agent (user+system).",
                                  value=self.usage.cpu_seconds(), unit="seconds")
        yield GaugeMetricFamily("sits_agent_resident_memory_bytes", "Resident memory of the agent.",
                                value=float(self.usage.rss_bytes()))


METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_NODE_HELP = {
    "DCGM_FI_": "GPU state over the last second (NVML; DCGM's field name and unit).",
    "sits_gpu_": "GPU signal over the last second (NVML), no DCGM equivalent.",
    "sits_cuda_": "CUDA driver calls counted by the libcuda uprobes (bpf/cuda.c).",
    "sits_tcp_": "TCP signal from the tcp: and sock: tracepoints (bpf/tcp.c).",
    "sits_cpu_runq_": "Run-queue wait of a traced process's threads (bpf/sched.c).",
}


def _node_help(name: str) -> str:
    for prefix, doc in _NODE_HELP.items():
        if name.startswith(prefix):
            return doc
    return "Node signal of the agent's feature frame."


def node_families(samples: Iterable[tuple[str, dict[str, str], float]]) -> list[Metric]:
    """Samples grouped into metric families: `_total` names as counters, others as gauges.
    A name Prometheus would refuse is skipped (it would spoil the whole scrape)."""
    fams: dict[str, Metric] = {}
    for name, labels, value in samples:
        if not METRIC_NAME_RE.match(name):
            continue
        counter = name.endswith("_total")
        base = name[: -len("_total")] if counter else name
        fam = fams.get(base)
        if fam is None:
            fam = fams[base] = Metric(base, _node_help(name), "counter" if counter else "gauge")
        fam.add_sample(name, dict(labels), float(value))
    return list(fams.values())


def _cumulative(bounds: list[str], h: HistogramData) -> list[Any]:
    """Prometheus buckets, each with the last trace seen in it as an exemplar (OpenMetrics)."""
    out: list[Any] = []
    acc = 0
    for bound, n, ex in zip(bounds, h.buckets, h.exemplars):
        acc += n
        if ex is None:
            out.append((bound, float(acc)))
        else:
            out.append((bound, float(acc), Exemplar({"trace_id": ex[0]}, ex[1], ex[2])))
    return out


def _kernel_metrics(stats: AgentStats) -> Iterator[Metric]:
    seen = stats.kernel_seen or {}
    lost = stats.kernel_lost or {}
    kinds = sorted(set(seen) | set(lost))
    fam_seen = CounterMetricFamily("sits_bpf_events", "Events the BPF programs saw, by kind.",
                                   labels=["kind"])
    fam_lost = CounterMetricFamily("sits_bpf_events_lost",
                                   "Events lost in the kernel (ring buffer full), by kind.",
                                   labels=["kind"])
    for k in kinds:  # both for every kind, so a rate() of lost is 0 rather than absent
        fam_seen.add_metric([k], float(seen.get(k, 0)))
        fam_lost.add_metric([k], float(lost.get(k, 0)))
    yield fam_seen
    yield fam_lost


class PrometheusExporter:
    """Spans in, /metrics out. `port` 0 serves nothing (the collector can still be read)."""

    name = "prometheus"

    def __init__(self, port: int = 0, address: str = "127.0.0.1", *, service_name: str = "",
                 max_label_sets: int = 1000, exporter_stats: ExporterStatsFn = lambda: (),
                 usage: ProcessUsage | None = None) -> None:
        self._service = service_name
        self.red = RedAggregator(max_label_sets)
        self._observed = 0
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SitsCollector(self.red, exporter_stats, usage)
        self.registry.register(self.collector)
        self._server: Any = None
        if port:
            self._server, _thread = start_http_server(port, address, registry=self.registry)

    @property
    def port(self) -> int:
        return int(self._server.server_port) if self._server is not None else 0

    def attach_agent(self, stats: AgentStatsFn, samples: NodeSamples | None = None) -> None:
        self.collector.agent_stats = stats
        self.collector.node_samples = samples

    def _service_of(self, s: Span) -> str:
        return self._service or str(s.attributes.get("process.executable.name", "")) \
            or "unknown_service"

    def export(self, spans: Sequence[Span]) -> None:
        self.red.observe_many(spans, self._service_of)  # the batch under one lock
        for s in spans:
            if s.attributes.get("gen_ai.operation.name") is not None:
                try:
                    self.collector.genai.observe(s, self._service_of(s))
                except Exception:
                    log.debug("prometheus: span skipped", exc_info=True)
        with self._lock:
            self._observed += len(spans)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def stats(self) -> ExporterStats:
        with self._lock:
            return ExporterStats(self.name, exported=self._observed)
