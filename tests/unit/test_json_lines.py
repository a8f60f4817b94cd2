"""`trace --json` lines: their encoding (orjson, the standard library's where orjson refuses)
and the printer that writes a poll's lines at once."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from sits_trace.agent import cli
from sits_trace.agent.capture.events import Kind
from sits_trace.agent.tracing.pipeline import Tracer
from sits_trace.agent.tracing.procfs import ProcFS
from sits_trace.agent.tracing.spans import SpanBuilder

from tests.support.otlp import sample_span
from tests.unit.test_capture_loss import IN, OK, OUT, Clock, conn_rec, data_rec


def _strict(line: bytes) -> dict[str, object]:
    def no_constant(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    out: dict[str, object] = json.loads(line, parse_constant=no_constant)
    return out


def test_a_line_is_the_spans_json_and_one_newline() -> None:
    s = sample_span(3, text="żółw \x00 \"q\" \\ ✓")
    line = s.json_bytes()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert _strict(line) == json.loads(json.dumps(s.to_json()))
    assert s.json_line() == line.decode()


def test_values_orjson_refuses_or_json_cannot_hold_still_make_a_line() -> None:
    """An int past 64 bits goes through the standard library's encoder; an infinite float is
    null (the standard library wrote `Infinity`, which is not JSON)."""
    big = sample_span(1, huge=1 << 70)
    assert json.loads(big.json_bytes())["attributes"]["huge"] == 1 << 70
    inf = sample_span(2, ratio=float("inf"))
    assert _strict(inf.json_bytes())["attributes"]["ratio"] is None  # type: ignore[index]


class _Source:
    def __init__(self, batches: list[list[bytes]]) -> None:
        self.batches = batches

    def read(self, timeout_ms: int) -> list[bytes]:
        return self.batches.pop(0) if self.batches else []

    def close(self) -> None:
        pass


class _Stdout(io.TextIOWrapper):
    def __init__(self) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8")
        self.writes = 0
        inner = self.buffer.write

        def counted(b: bytes) -> int:  # type: ignore[override]
            self.writes += 1
            return inner(b)

        self.buffer.write = counted  # type: ignore[method-assign]

    def lines(self) -> list[bytes]:
        self.flush()
        return self.buffer.getvalue().splitlines()  # type: ignore[attr-defined]


def test_a_polls_lines_go_out_in_one_write_when_the_poll_is_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _Stdout()
    monkeypatch.setattr(sys, "stdout", out)
    get = b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n"
    first = [conn_rec(Kind.CONN_OPEN, 1)]
    for i in range(5):
        first += [data_rec(1, IN, get, ts=10 + 10 * i), data_rec(1, OUT, OK, ts=15 + 10 * i)]
    # the second poll: one more exchange, and a request whose answer never comes (the
    # tracer's stop gives it to the sink)
    second = [data_rec(1, IN, get, ts=100), data_rec(1, OUT, OK, ts=105),
              data_rec(1, IN, get, ts=110)]
    printer = cli._JsonPrinter()
    t = Tracer(_Source([first, second]), printer, SpanBuilder(clock_offset_ns=0),
               procfs=ProcFS(str(tmp_path)), monotonic_ns=Clock())
    t.poll_observers.append(printer.flush)
    t.poll(0)
    assert out.writes == 1 and len(out.lines()) == 5
    t.poll(0)
    assert out.writes == 2 and len(out.lines()) == 6
    t.poll(0)  # nothing new: nothing written
    assert out.writes == 2
    t.close_all()
    assert len(out.lines()) == 7 and out.writes == 3
    assert all(_strict(line)["attributes"]["url.path"] == "/x" for line in out.lines())  # type: ignore[index]


def test_the_printer_holds_no_more_than_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _Stdout()
    monkeypatch.setattr(sys, "stdout", out)
    printer = cli._JsonPrinter()
    for i in range(printer.MAX_HELD + 3):
        printer(sample_span(i))
    assert out.writes == 1 and len(out.lines()) == printer.MAX_HELD
    printer.flush()
    assert out.writes == 2 and len(out.lines()) == printer.MAX_HELD + 3


def test_without_orjson_the_standard_librarys_line_is_the_same_json(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU test image has no orjson: the agent still prints, the same objects."""
    from sits_trace.agent import model

    if not str(model.__file__).endswith(".py"):
        pytest.skip("the compiled model binds orjson at import; `make test` runs this again "
                    "with SITS_NATIVE=0 (agent/native.py)")
    s = sample_span(4, text="żółw", n=-3, ratio=0.5)
    with_orjson = s.json_bytes()
    monkeypatch.setattr(model, "orjson", None)
    without = s.json_bytes()
    assert without.endswith(b"\n") and json.loads(without) == json.loads(with_orjson)


def test_a_reader_that_went_away_stops_the_trace_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """`trace --json | head -3`: the write that meets the closed pipe raises nothing (it ran
    inside the tracer's poll), calls `on_closed` once (trace's stop) and later lines are
    dropped."""
    class Gone(io.TextIOWrapper):
        def __init__(self) -> None:
            super().__init__(io.BytesIO(), encoding="utf-8")
            self.tries = 0

            def write(b: bytes) -> int:
                self.tries += 1
                raise BrokenPipeError(32, "Broken pipe")

            self.buffer.write = write  # type: ignore[method-assign]

    out = Gone()
    monkeypatch.setattr(sys, "stdout", out)
    stops: list[int] = []
    printer = cli._JsonPrinter()
    printer.on_closed = lambda: stops.append(1)
    printer(sample_span(1))
    printer.flush()
    assert printer.closed and stops == [1] and out.tries == 1
    printer(sample_span(2))
    printer.flush()
    assert stops == [1] and out.tries == 1
