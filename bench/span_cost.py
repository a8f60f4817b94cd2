"""Agent CPU per span, stage by stage: decode, parse, span, JSON, OTLP encode.

    .venv/bin/python bench/span_cost.py [-n 20000] [--repeat 5]

Feeds ring records built the way bpf/http.c lays them out (struct data_event: an nginx-like
keep-alive request and response, two records per exchange; a uvicorn-like SSE stream of
`--tokens` events, per-write records against the kernel's folded summary) through the
agent's own code, one stage at a time, and prints the median over `--repeat` runs of each
stage's µs per span (process CPU time). `otlp` is the shipped encoder (exporters/_otlp_traces.py:
our spans straight into the request's protobuf bytes, a request per batch of 512); `otlp_sdk`
the path before it (an SDK ReadableSpan per span, then the SDK's encoder), not counted in
total_us. `live` is `top`'s live view (analyzers/live.py), `red` the RED histograms of
/metrics and OTLP metrics (exporters/_red.py); `red_sdk` how RED reached OTLP before (an SDK
histogram record per span), not counted in total_us. The node signals (TCP, run queue) are not in here:
they read kernel maps; bench/overhead.py measures the whole agent, them included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time
from collections.abc import Callable

from sits_trace.agent.capture import events as ev
from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role, Span, StreamChunk
from sits_trace.agent.tracing.http1 import HttpConnParser
from sits_trace.agent.tracing.spans import SpanBuilder

# each request its own x-request-id, as a client or gateway sends them: an attribute value
# no two spans share (a cache of encoded attribute values must not get it for free)
REQ = (b"GET /index.html HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: wrk\r\n"
       b"Accept: */*\r\nx-request-id: %016x\r\n\r\n")
RESP = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 02 Dec 2025 10:20:00 GMT\r\n"
        b"Content-Type: text/plain\r\nContent-Length: 17\r\nConnection: keep-alive\r\n\r\n"
        b"hello from nginx\n")
_SSE_BODY = b'{"model": "tiny", "stream": true, "messages": []}'
SSE_REQ = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(_SSE_BODY), _SSE_BODY))
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
_HDR = struct.Struct("<IIQQQQIiIIBBBBI")


def data_record(conn_id: int, direction: int, t: int, payload: bytes, fd: int = 7) -> bytes:
    return _HDR.pack(3, 100, conn_id, t, t + 2000, 0, 100, fd, len(payload), len(payload),
                     direction, 0, 1, 0, 0) + payload


def nginx_records(n: int, conns: int = 50) -> list[bytes]:
    out = []
    t = 1_000_000_000
    for i in range(n):
        cid = 1 + i % conns
        out.append(data_record(cid, 0, t, REQ % i))
        out.append(data_record(cid, 1, t + 30_000, RESP))
        t += 50_000
    return out


def _event(i: int) -> bytes:
    e = b'data: {"id": "c1", "model": "tiny", "choices": [{"delta": {"content": " t%d"}}]}\n\n' % i
    return b"%x\r\n%s\r\n" % (len(e), e)


def sse_records(streams: int, tokens: int, folded: bool) -> list[bytes]:
    """Per stream: request, head, then `tokens` event writes and the terminator, or (folded)
    the one summary the kernel sends instead."""
    out = []
    t = 1_000_000_000
    for s in range(streams):
        cid = 1000 + s
        out.append(data_record(cid, 0, t, SSE_REQ))
        out.append(data_record(cid, 1, t + 1_000_000, SSE_HEAD))
        t0 = t + 2_000_000
        if folded:
            c = ev.StreamEventC(kind=12, tgid=100, conn_id=cid, first_enter_ns=t0,
                                first_exit_ns=t0 + 900, last_enter_ns=t0 + (tokens - 1) * 20_000_000,
                                last_exit_ns=t0 + (tokens - 1) * 20_000_000 + 900,
                                end_ns=t0 + tokens * 20_000_000, max_gap_ns=20_000_000,
                                writes=tokens, events=tokens, end=1, role=1, tail_last=1)
            last = _event(tokens - 1)
            c.tail1 = last
            c.tail1_len = len(last)
            out.append(bytes(c))
        else:
            for i in range(tokens):
                out.append(data_record(cid, 1, t0 + i * 20_000_000, _event(i)))
            out.append(data_record(cid, 1, t0 + tokens * 20_000_000, b"0\r\n\r\n"))
        t += 10_000
    return out


def cpu_us(fn: Callable[[], object]) -> float:
    c0 = time.process_time()
    fn()
    return (time.process_time() - c0) * 1e6


def parse_all(events: list[ev.Event]) -> list[Exchange]:
    out: list[Exchange] = []
    parsers: dict[int, HttpConnParser] = {}
    for e in events:
        p = parsers.get(e.conn_id)
        if p is None:
            info = ConnInfo(conn_id=e.conn_id, pid=100, fd=7, role=Role.SERVER, comm="nginx")
            p = parsers[e.conn_id] = HttpConnParser(info, out.append)
        if isinstance(e, ev.DataEvent):
            p.feed(Chunk(e.direction, e.ts_enter_ns, e.ts_exit_ns, e.payload, e.length))
        elif isinstance(e, ev.StreamEvent):
            p.feed_stream(StreamChunk(Direction.EGRESS, e.writes, e.events, e.first_enter_ns,
                                      e.last_exit_ns, e.max_gap_ns, e.body_bytes, e.wire_bytes,
                                      e.end_ns, True, e.tails))
    return out


def otlp_sdk_encoder() -> Callable[[list[Span]], int] | None:
    """The path the exporter took before (kept here to compare): a ReadableSpan per span,
    then the SDK's encoder."""
    try:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.status import Status, StatusCode
    except ImportError:
        return None
    res = Resource.create({"service.name": "nginx"})
    scope = InstrumentationScope("sits-trace", "0.1.0")
    kinds = {"SERVER": SpanKind.SERVER, "CLIENT": SpanKind.CLIENT}

    def readable(sp: Span) -> ReadableSpan:
        tid = int(sp.trace_id, 16)
        ctx = SpanContext(tid, int(sp.span_id, 16), False, TraceFlags(TraceFlags.SAMPLED))
        parent = SpanContext(tid, int(sp.parent_span_id, 16), True,
                             TraceFlags(TraceFlags.SAMPLED)) if sp.parent_span_id else None
        return ReadableSpan(
            name=sp.name, context=ctx, parent=parent, resource=res,
            attributes={k: v for k, v in sp.attributes.items() if not k.startswith("process.")},
            kind=kinds.get(sp.kind, SpanKind.INTERNAL),
            status=Status(StatusCode.ERROR if sp.status_code == "ERROR" else StatusCode.UNSET),
            start_time=sp.start_time_unix_nano, end_time=sp.end_time_unix_nano,
            instrumentation_scope=scope)

    def encode(spans: list[Span]) -> int:
        n = 0
        for i in range(0, len(spans), 512):  # the SDK's batch size
            n += len(encode_spans([readable(s) for s in spans[i:i + 512]]).SerializeToString())
        return n
    encode.request = lambda spans: encode_spans([readable(s) for s in spans])  # type: ignore[attr-defined]
    return encode


def otlp_encoder() -> Callable[[list[Span]], int]:
    """The shipped exporter's encoder (exporters/_otlp_traces.py): a request per batch of
    512, resources from the resolver's attributes."""
    from sits_trace.exporters._otlp_traces import encode as encode_batch

    def resource(sp: Span) -> dict[str, str | int]:
        return {"service.name": "nginx", "process.pid": int(sp.attributes.get("process.pid", 0))}

    def encode(spans: list[Span]) -> int:
        return sum(len(encode_batch(spans[i:i + 512], resource))
                   for i in range(0, len(spans), 512))
    return encode


def red_sdk_recorder() -> Callable[[list[Span]], None] | None:
    """How RED durations reached OTLP before (kept here to compare): each span recorded into
    an SDK histogram, its labels worked out per span."""
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    except ImportError:
        return None
    from sits_trace.exporters._red import (
        DURATION_BUCKETS_S,
        LABELS,
        METRIC_OF_KIND,
        LabelLimiter,
        span_labels,
    )
    names = dict(zip(LABELS, ("service.name", "http.request.method", "http.route",
                              "http.response.status_code")))
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], views=[
        View(instrument_name=m, aggregation=ExplicitBucketHistogramAggregation(
            list(DURATION_BUCKETS_S))) for m in METRIC_OF_KIND.values()])
    meter = provider.get_meter("sits-trace", "0.1.0")
    hist = {m: meter.create_histogram(m, unit="s") for m in METRIC_OF_KIND.values()}
    limiters = {m: LabelLimiter(1000) for m in METRIC_OF_KIND.values()}

    def record(spans: list[Span]) -> None:
        for span in spans:
            metric = METRIC_OF_KIND.get(span.kind)
            if metric is None:
                continue
            labels = limiters[metric].admit(span_labels(span, "nginx"))
            attrs = {names[k]: v for k, v in zip(LABELS, labels) if v != ""}
            hist[metric].record((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
                                attrs)
    return record


def batches(spans: list[Span], n: int) -> list[list[Span]]:
    return [spans[i:i + n] for i in range(0, len(spans), n)]


def stages(records: list[bytes]) -> dict[str, float]:
    """µs of CPU per span for each stage over `records`."""
    out: dict[str, float] = {}
    decoded: list[ev.Event] = []
    out["decode"] = cpu_us(lambda: decoded.extend(ev.decode(r) for r in records))
    exchanges: list[Exchange] = []
    out["parse"] = cpu_us(lambda: exchanges.extend(parse_all(decoded)))
    builder = SpanBuilder(clock_offset_ns=0)
    spans: list[Span] = []
    out["span"] = cpu_us(lambda: spans.extend(builder.build(x) for x in exchanges))
    out["json"] = cpu_us(lambda: [s.json_line() for s in spans])  # trace --json, JSONL
    enc = otlp_encoder()
    out["otlp"] = cpu_us(lambda: enc(spans))
    sdk = otlp_sdk_encoder()
    if sdk is not None:
        out["otlp_sdk"] = cpu_us(lambda: sdk(spans))
    # `run`'s other consumers of every span: top's live view (the tracer's batches), the RED
    # histograms of /metrics and OTLP metrics (the exporter's batches of 512)
    from sits_trace.analyzers.live import LiveView
    from sits_trace.exporters._red import RedAggregator
    view, red = LiveView(), RedAggregator()
    out["live"] = cpu_us(lambda: [view.add_many(b) for b in batches(spans, 64)])
    if hasattr(red, "observe_many"):
        out["red"] = cpu_us(lambda: [red.observe_many(b, lambda _s: "nginx")
                                     for b in batches(spans, 512)])
    else:  # a checkout from before batches (run with its python to compare)
        out["red"] = cpu_us(lambda: [red.observe(sp, "nginx") for sp in spans])
    red_sdk = red_sdk_recorder()
    if red_sdk is not None:
        out["red_sdk"] = cpu_us(lambda: red_sdk(spans))
    n = max(1, len(spans))
    per = {k: v / n for k, v in out.items()}
    per["spans"] = len(spans)
    per["records_per_span"] = len(records) / n
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20000, help="nginx exchanges")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    cases = {
        "nginx keep-alive (2 records/span)": nginx_records(a.n),
        f"SSE {a.tokens} tokens, a record per write": sse_records(a.streams, a.tokens, False),
        f"SSE {a.tokens} tokens, folded in the kernel": sse_records(a.streams, a.tokens, True),
    }
    report = {}
    for name, recs in cases.items():
        runs = [stages(recs) for _ in range(a.repeat)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        med["total_us"] = sum(v for k, v in med.items()
                              if k not in ("spans", "records_per_span", "otlp_sdk", "red_sdk"))
        report[name] = med
        cols = " ".join(f"{k}={v:.2f}" for k, v in med.items() if k not in ("spans",))
        print(f"{name}: {cols}  (us/span, median of {a.repeat})")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
