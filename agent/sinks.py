"""Span sinks that take a batch at a time.

A span sink is a callable taking one span. The tracer parses the records of one read of the
ring together and hands their spans over at the end (`Tracer.process`); a sink that also has
an attribute `many` (a callable taking the list of those spans, in order) gets them in one
call instead of one call per span. The consumers on the agent's span path (the exporters,
`top`'s live view, the control loop's latency table, `trace --json`) each take a batch under
one lock and one function call: at ~10k spans/s, a Python call chain per span per consumer
was a measurable part of the agent's CPU (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable

from sits_trace.agent.model import Span

SpanSink = Callable[[Span], None]
SpansSink = Callable[[list[Span]], None]


class BatchSink:
    """A sink with both forms: `sink(span)` and `sink.many(spans)`."""

    __slots__ = ("_one", "many")

    def __init__(self, one: SpanSink, many: SpansSink) -> None:
        self._one = one
        self.many = many

    def __call__(self, span: Span) -> None:
        self._one(span)


def deliver(sink: SpanSink, spans: list[Span]) -> None:
    """`spans` to `sink`: in one call where it takes batches, else span by span."""
    many: SpansSink | None = getattr(sink, "many", None)
    if many is not None:
        many(spans)
        return
    for span in spans:
        sink(span)


def tee(first: SpanSink, first_many: SpansSink, then: SpanSink) -> BatchSink:
    """A sink giving each span, or batch, to `first` and then to `then`."""
    def one(span: Span) -> None:
        first(span)
        then(span)

    def many(spans: list[Span]) -> None:
        first_many(spans)
        deliver(then, spans)

    return BatchSink(one, many)
