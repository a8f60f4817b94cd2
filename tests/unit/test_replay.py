"""Recorded ring-buffer records (real captures, `sits-trace trace --record`) decoded
and assembled into spans without a kernel.

The fixtures were recorded on the development VM with the agent filtering on the
server's pid: python_http_keepalive (examples/demo_server.py, one curl with three
keep-alive requests, then a POST), python_tls_ex (the same server over TLS:
SSL_read_ex/SSL_write_ex), uvicorn_tls_sse (uvicorn over TLS, a memory BIO: an
SSE stream of five events 50 ms apart, then a 404), nginx_https (nginx 1.22,
SSL_read/SSL_write), nginx_pipelined (three pipelined requests in one write).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sits_trace.agent.capture.events import DATA_HDR_SIZE, DataEvent, decode
from sits_trace.agent.capture.loader import RecordedSource
from sits_trace.agent.model import Span
from sits_trace.agent.tracing.pipeline import Tracer
from sits_trace.agent.tracing.procfs import ProcFS
from sits_trace.agent.tracing.spans import SpanBuilder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "events"


def replay(name: str, tmp_path: Path) -> tuple[list[Span], Tracer]:
    src = RecordedSource(FIXTURES / name, batch=7)
    spans: list[Span] = []
    # an empty fake /proc: nothing of the recording machine leaks in
    tracer = Tracer(src, spans.append, SpanBuilder(clock_offset_ns=0),
                    procfs=ProcFS(str(tmp_path)), monotonic_ns=lambda: 0)
    while not src.exhausted:
        tracer.poll(0)
    tracer.close_all()
    return [s for s in spans if s.kind == "SERVER"], tracer


def a(span: Span, key: str) -> Any:
    return span.attributes.get(key)


def test_python_keepalive(tmp_path: Path) -> None:
    spans, tracer = replay("python_http_keepalive.rec", tmp_path)
    got = [(a(s, "http.request.method"), a(s, "url.path"), a(s, "http.response.status_code"))
           for s in spans]
    assert got == [("GET", "/v1/models", 200), ("GET", "/chunked", 200), ("GET", "/status/503", 503),
                   ("POST", "/up", 200)]
    models, chunked, failed, post = spans
    assert a(models, "http.request.header.x-request-id") == "fx-1"
    assert models.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert models.parent_span_id == "00f067aa0ba902b7"
    assert a(chunked, "sits.stream.chunks") >= 3
    assert failed.status_code == "ERROR"
    assert a(post, "http.request.body.size") == (Path(__file__).parents[2] / "README.md").stat().st_size \
        or a(post, "http.request.body.size") > 1000
    assert a(models, "tls") is False
    assert tracer.stats.parser.resyncs == 0 and tracer.stats.decode_errors == 0


def test_python_tls_ex(tmp_path: Path) -> None:
    spans, tracer = replay("python_tls_ex.rec", tmp_path)
    assert [(a(s, "url.path"), a(s, "tls")) for s in spans] == [("/secure", True), ("/chunked", True)]
    assert tracer.stats.parser.resyncs == 0


def test_uvicorn_sse_memory_bio(tmp_path: Path) -> None:
    spans, _ = replay("uvicorn_tls_sse.rec", tmp_path)
    assert [(a(s, "url.path"), a(s, "http.response.status_code")) for s in spans] == [
        ("/sse", 200), ("/status/404", 404)]
    sse = spans[0]
    assert a(sse, "tls") is True
    assert a(sse, "sits.stream.chunks") >= 5
    assert a(sse, "sits.time_to_last_chunk_ms") - a(sse, "sits.time_to_first_chunk_ms") >= 190


def test_nginx_https_redacts_secrets(tmp_path: Path) -> None:
    spans, _ = replay("nginx_https.rec", tmp_path)
    assert [(a(s, "url.path"), a(s, "http.response.status_code")) for s in spans] == [
        ("/", 200), ("/missing", 404)]
    assert "s3cr3t" not in repr(spans)
    assert all(a(s, "tls") is True for s in spans)


def test_nginx_pipelined(tmp_path: Path) -> None:
    spans, _ = replay("nginx_pipelined.rec", tmp_path)
    assert [a(s, "url.query") for s in spans] == ["p=1", "p=2", "p=3"]
    assert all(a(s, "http.response.status_code") == 200 for s in spans)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.rec")))
def test_records_decode(name: str) -> None:
    src = RecordedSource(FIXTURES / name, batch=10_000)
    for raw in src.read(0):
        ev = decode(raw)
        if isinstance(ev, DataEvent):
            assert len(ev.payload) <= ev.length
            assert len(raw) == DATA_HDR_SIZE + len(ev.payload)
            assert ev.ts_exit_ns >= ev.ts_enter_ns


def test_truncated_and_garbage_records_are_counted(tmp_path: Path) -> None:
    src = RecordedSource(FIXTURES / "python_http_keepalive.rec", batch=10_000)
    recs = src.read(0)
    bad = [r[:10] for r in recs[:5]] + [b"\xff" * 80, b""]
    spans: list[Span] = []
    tracer = Tracer(RecordedSource(FIXTURES / "python_http_keepalive.rec"), spans.append,
                    SpanBuilder(clock_offset_ns=0), procfs=ProcFS(str(tmp_path)),
                    monotonic_ns=lambda: 0)
    tracer.process(bad + recs)
    tracer.close_all()
    assert tracer.stats.decode_errors == len(bad)
    assert len([s for s in spans if s.kind == "SERVER"]) == 4
