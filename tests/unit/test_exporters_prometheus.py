"""/metrics as Prometheus scrapes it: RED histograms, bounded labels, agent health."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sits_trace.agent.model import AgentStats
from sits_trace.exporters._base import ExporterStats
from sits_trace.exporters.prometheus import ProcessUsage, PrometheusExporter

from tests.support.otlp import sample_span as make_span

AGENT_STATS: dict[str, Any] = {
    "tracer": {"records": 900, "decode_errors": 2, "spans": 40, "spans_filtered": 1,
               "conns_opened": 12, "conns_closed": 9, "conns_active": 3,
               "parser": {"resyncs": 4, "malformed": 1}},
    "kernel_seen": {"conn_open": 12, "data": 880, "conn_close": 9},
    "kernel_lost": {"data": 7},
    "probes": [{"name": "uprobe:SSL_write", "group": "tls", "required": False, "ok": False,
                "detail": "no libssl"}],
}


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[str, list[Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    hits = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return float(hits[0])


def test_metrics_endpoint(unused_port: int) -> None:
    queue = ExporterStats("otlp-grpc", exported=30, dropped={"queue_full": 5}, queue_depth=17,
                          queue_capacity=8192, export_errors=2)
    exp = PrometheusExporter(unused_port, exporter_stats=lambda: [queue], usage=ProcessUsage())
    try:
        exp.attach_agent(lambda: AgentStats.from_json(AGENT_STATS))
        spans = [make_span(i, path=f"/v1/models/{i}") for i in range(4)]  # 250 ms each
        spans += [make_span(9, status=500, path="/v1/completions")]
        spans += [make_span(10, kind="CLIENT", exe="python3", path="/generate")]
        exp.export(spans)
        m = scrape(exp.port)
    finally:
        exp.shutdown()
    h = "http_server_request_duration_seconds"
    route = {"service_name": "uvicorn", "http_request_method": "POST",
                 "http_route": "/v1/models/{id}", "http_response_status_code": "200"}
    assert value(m, h + "_count", **route) == 4
    assert abs(value(m, h + "_sum", **route) - 1.0) < 1e-9
    assert value(m, h + "_bucket", le="0.1", **route) == 0
    assert value(m, h + "_bucket", le="0.25", **route) == 4  # le is inclusive
    assert value(m, h + "_bucket", le="+Inf", **route) == 4
    assert value(m, h + "_count", http_response_status_code="500") == 1
    assert value(m, "http_client_request_duration_seconds_count", service_name="python3",
                 http_route="/generate") == 1
    assert value(m, "sits_bpf_events_total", kind="data") == 880
    assert value(m, "sits_bpf_events_lost_total", kind="data") == 7
    assert value(m, "sits_bpf_events_lost_total", kind="conn_open") == 0  # present, so rate() works
    assert value(m, "sits_connections_active") == 3
    assert value(m, "sits_parser_resyncs_total") == 4
    assert value(m, "sits_ring_records_total") == 900
    assert value(m, "sits_probe_failed", probe="uprobe:SSL_write", required="false") == 1
    assert value(m, "sits_spans_exported_total", exporter="otlp-grpc") == 30
    assert value(m, "sits_spans_dropped_total", exporter="otlp-grpc", reason="queue_full") == 5
    assert value(m, "sits_spans_dropped_total", exporter="otlp-grpc", reason="export_failed") == 0
    assert value(m, "sits_export_queue_spans", exporter="otlp-grpc") == 17
    assert value(m, "sits_export_queue_capacity_spans", exporter="otlp-grpc") == 8192
    assert value(m, "sits_agent_cpu_seconds_total") > 0
    assert value(m, "sits_agent_resident_memory_bytes") > 10 * 2**20


def test_label_sets_are_capped_with_overflow_into_other(unused_port: int) -> None:
    exp = PrometheusExporter(unused_port, max_label_sets=10)
    try:
        # paths a template cannot fold (words, not ids): an unbounded label set without the cap
        exp.export([make_span(i, path=f"/search/term{chr(97 + i % 26)}{i // 26}x")
                    for i in range(500)])
        m = scrape(exp.port)
    finally:
        exp.shutdown()
    counts = m["http_server_request_duration_seconds_count"]
    assert len(counts) == 11
    assert value(m, "http_server_request_duration_seconds_count", http_route="_other") == 490
    assert value(m, "sits_metric_label_overflow_total",
                 metric="http_server_request_duration_seconds") == 490


def test_scrape_survives_a_broken_agent(unused_port: int) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("agent stopped")

    exp = PrometheusExporter(unused_port)
    try:
        exp.attach_agent(broken)
        exp.export([make_span(0)])
        m = scrape(exp.port)
    finally:
        exp.shutdown()
    assert "http_server_request_duration_seconds_count" in m
    assert "sits_bpf_events_total" not in m


def test_shed_spans_are_reweighted(unused_port: int) -> None:
    # spans captured as 1 in 8 (and 1 in 2) while the kernel shed load: the histogram counts
    # the requests they stand for, and the kernel's count of skipped exchanges is exported
    stats = {**AGENT_STATS, "tracer": {**AGENT_STATS["tracer"], "exchanges_shed": 9,
                                       "capture_shift": 3, "conns_muted": 2}}
    exp = PrometheusExporter(unused_port)
    try:
        exp.attach_agent(lambda: AgentStats.from_json(stats))
        spans = [make_span(i, path="/v1/completions") for i in range(3)]  # 250 ms each
        spans[0].attributes["sampling.probability"] = 0.125
        spans[1].attributes["sampling.probability"] = 0.5
        exp.export(spans)
        m = scrape(exp.port)
    finally:
        exp.shutdown()
    h = "http_server_request_duration_seconds"
    assert value(m, h + "_count", http_route="/v1/completions") == 8 + 2 + 1
    assert abs(value(m, h + "_sum", http_route="/v1/completions") - 11 * 0.25) < 1e-9
    assert value(m, h + "_bucket", le="0.25", http_route="/v1/completions") == 11
    assert value(m, "sits_exchanges_shed_total") == 9
    assert value(m, "sits_connections_muted_total") == 2
    assert value(m, "sits_capture_shift") == 3
