"""Spans handed over a batch at a time (agent/sinks.py): the tracer gives a batch's spans to a
sink's `many` in one call, in order; every consumer on the agent's span path gives the same
result for a batch as for the same spans one by one; a sink that raises loses nothing else."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from sits_trace.agent.capture.events import Kind
from sits_trace.agent.config import Config, ControlConfig
from sits_trace.agent.daemon import Agent
from sits_trace.agent.model import Span
from sits_trace.agent.sinks import BatchSink, deliver, tee
from sits_trace.agent.tracing.pipeline import Tracer
from sits_trace.agent.tracing.procfs import ProcFS
from sits_trace.agent.tracing.spans import SpanBuilder
from sits_trace.analyzers.control.loop import LatencyTable
from sits_trace.analyzers.live import LiveView
from sits_trace.exporters import ExporterSet
from sits_trace.exporters._base import ExporterStats

from tests.support.otlp import sample_span

from .test_capture_loss import IN, OUT, Clock, conn_rec, data_rec, src_none

REQ = b"GET /a HTTP/1.1\r\nHost: x\r\nx-request-id: r%d\r\n\r\n"
RESP = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def records(n: int, conn_id: int = 1) -> list[bytes]:
    out = [conn_rec(Kind.CONN_OPEN, conn_id)]
    for i in range(n):
        out += [data_rec(conn_id, IN, REQ % i, ts=10 * i + 1),
                data_rec(conn_id, OUT, RESP, ts=10 * i + 5)]
    return out


class Recorder:
    """A sink with both forms, logging what it got and how."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, span: Span) -> None:
        self.calls.append(("one", [rid(span)]))

    def many(self, spans: list[Span]) -> None:
        self.calls.append(("many", [rid(s) for s in spans]))


def rid(span: Span) -> str:
    return str(span.attributes.get("http.request.header.x-request-id"))


def make_tracer(tmp_path: Path, sink: object) -> Tracer:
    return Tracer(src_none(), sink, SpanBuilder(clock_offset_ns=0),  # type: ignore[arg-type]
                  procfs=ProcFS(str(tmp_path)), monotonic_ns=Clock())


def test_a_batch_of_records_reaches_many_in_one_call_in_order(tmp_path: Path) -> None:
    rec = Recorder()
    t = make_tracer(tmp_path, rec)
    t.process(records(5))
    t.process(records(3, conn_id=2)[:3])  # one exchange done, the next one's request only
    assert rec.calls == [("many", [f"r{i}" for i in range(5)]), ("many", ["r0"])]
    assert t.stats.spans == 6


def test_a_sink_without_many_gets_each_span(tmp_path: Path) -> None:
    got: list[Span] = []
    t = make_tracer(tmp_path, got.append)
    t.process(records(4))
    assert [rid(s) for s in got] == ["r0", "r1", "r2", "r3"]


def test_spans_outside_a_batch_go_one_by_one(tmp_path: Path) -> None:
    """close_all (and sweep) emit outside process(): straight to the sink."""
    rec = Recorder()
    t = make_tracer(tmp_path, rec)
    t.process(records(2)[:4])  # r0 done, r1's request waits for its response
    t.close_all()
    assert rec.calls[0] == ("many", ["r0"])
    assert rec.calls[1:] == [("one", ["r1"])]


def test_a_raising_sink_is_counted_and_the_pipeline_goes_on(tmp_path: Path) -> None:
    got: list[str] = []

    def flaky(span: Span) -> None:
        if rid(span) == "r1":
            raise RuntimeError("a consumer's bug")
        got.append(rid(span))

    t = make_tracer(tmp_path, flaky)
    t.process(records(3))
    assert got == ["r0", "r2"] and t.stats.parser.internal_errors == 1

    def broken_many(spans: list[Span]) -> None:
        raise RuntimeError("a consumer's bug")

    t2 = make_tracer(tmp_path, BatchSink(lambda s: None, broken_many))
    t2.process(records(3))
    t2.process(records(2, conn_id=2))  # the parser was not disturbed
    assert t2.stats.spans == 5 and t2.stats.parser.internal_errors == 2
    assert t2.stats.parser.malformed == 0


def test_tee_and_deliver_keep_the_order_of_consumers_and_spans() -> None:
    log: list[tuple[str, str]] = []
    spans = [sample_span(i) for i in range(3)]
    def first_many(batch: list[Span]) -> None:
        log.extend(("first", rid(s)) for s in batch)

    sink = tee(lambda s: log.append(("first", rid(s))), first_many,
               lambda s: log.append(("then", rid(s))))
    deliver(sink, spans)  # `then` has no batch form: one by one, after `first` took the batch
    assert log == [("first", "req-0"), ("first", "req-1"), ("first", "req-2"),
                   ("then", "req-0"), ("then", "req-1"), ("then", "req-2")]
    log.clear()
    sink(spans[0])
    assert log == [("first", "req-0"), ("then", "req-0")]


def _view_numbers(view: LiveView) -> list[dict[str, object]]:
    out = view.routes(now_ns=max(s.end_time_unix_nano for s in SPANS) + 1)
    return [{k: v for k, v in r.items() if k != "slowest"} for r in out]


SPANS = ([sample_span(i, status=500 if i % 7 == 0 else 200) for i in range(40)]
         + [sample_span(i, exe="nginx", path="/b", kind="CLIENT") for i in range(5)]
         + [sample_span(i) for i in range(40, 43)])
for _s in SPANS[-3:]:  # sampled spans stand for four exchanges each
    _s.attributes["sampling.probability"] = 0.25


def test_the_live_view_counts_a_batch_as_the_same_spans_one_by_one() -> None:
    one, batch = LiveView(), LiveView()
    for s in SPANS:
        one.add(s)
    batch.add_many(SPANS[:10])
    batch.add_many(SPANS[10:])
    assert batch.spans_seen == one.spans_seen == len(SPANS)
    assert _view_numbers(batch) == _view_numbers(one)


def test_the_control_loop_takes_a_batch_as_the_same_spans_one_by_one() -> None:
    cfg = Config()
    cfg.control = ControlConfig(mode="observe", socket_path="")
    seen: list[Span] = []
    a, b = Agent(cfg, seen.append), Agent(cfg, seen.append)
    assert a.control is not None and b.control is not None
    for s in SPANS:
        a.control.loop.observe_span(s)
    deliver(b.sink, SPANS)
    assert seen == SPANS  # the agent's own sink still got every span, in order
    ta, tb = a.control.loop.latency, b.control.loop.latency
    assert isinstance(tb, LatencyTable)
    for service in ("uvicorn", "nginx"):
        assert tb.take(service) == ta.take(service)
        assert tb.pids(service) == ta.pids(service)
    assert ta.take("uvicorn") == []  # both were taken: nothing left over


class ListExporter:
    name = "list"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def export(self, spans: object) -> None:
        self.calls.append(len(spans))  # type: ignore[arg-type]

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass

    def stats(self) -> ExporterStats:
        return ExporterStats(name=self.name)


def test_exporters_take_a_batch_in_one_call_each() -> None:
    good, bad = ListExporter(), ListExporter()
    bad.export = lambda spans: 1 / 0  # type: ignore[method-assign]
    es = ExporterSet([bad, good])
    deliver(es.sink, SPANS[:7])
    es.sink(SPANS[7])
    assert good.calls == [7, 1] and es.errors == 2  # one raising exporter stops no other


def test_json_lines_of_a_batch_are_those_of_its_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    from sits_trace.agent.cli import _JsonPrinter

    def printed(feed: object) -> bytes:
        buf = io.BytesIO()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(buf))
        p = _JsonPrinter()
        feed(p)  # type: ignore[operator]
        p.flush()
        sys.stdout.flush()
        return buf.getvalue()

    many = printed(lambda p: p.many(SPANS * 7))  # more than MAX_HELD: written as it fills
    one = printed(lambda p: [p(s) for s in SPANS * 7])
    assert many == one and many.count(b"\n") == len(SPANS) * 7
