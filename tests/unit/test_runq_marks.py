"""A span's run-queue delay (sits.cpu.runq_*): the HTTP parser keeps the serving thread's
counter (Chunk.runq_us) at each exchange's first and last read or write, and the thread
switches between them (Exchange.runq_*); SchedSignals.annotate turns them into attributes.
Real HTTP bytes through the parser, the counters as bpf/http.c would copy them."""

from __future__ import annotations

from sits_trace.agent.capture.bpfmaps import DictMaps
from sits_trace.agent.model import (
    Chunk,
    ConnInfo,
    Direction,
    Exchange,
    Role,
    Span,
    StreamChunk,
)
from sits_trace.agent.signals.sched import SchedSignals
from sits_trace.agent.tracing.http1 import HttpConnParser

IN, OUT = Direction.INGRESS, Direction.EGRESS
REQ = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
RESP = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Conn:
    def __init__(self) -> None:
        self.out: list[Exchange] = []
        self.parser = HttpConnParser(ConnInfo(conn_id=9, pid=1, fd=3, role=Role.SERVER),
                                     self.out.append)
        self.sig = SchedSignals(DictMaps({}))

    def io(self, ts: int, d: Direction, data: bytes, runq: int, tid: int = 7) -> None:
        self.parser.feed(Chunk(d, ts - 10, ts, data, len(data), False, tid, runq))

    def attrs(self, i: int = -1) -> tuple[object, object, object]:
        span = Span("0" * 32, "0" * 16, None, "GET /", "SERVER", 0, 0)
        self.sig.annotate(self.out[i], span)
        a = span.attributes
        return (a.get("sits.cpu.runq_delay_us"), a.get("sits.cpu.runq_threads"),
                a.get("sits.cpu.runq_delay_exact"))


def test_each_exchange_on_a_keep_alive_connection_gets_its_own_waits() -> None:
    c = Conn()
    c.io(100, IN, REQ, 5)
    c.io(200, OUT, RESP[:20], 45)  # the head in two writes: the last one ends the span
    c.io(300, OUT, RESP[20:], 50)
    c.io(1000, IN, REQ, 70)
    c.io(1300, OUT, RESP, 400)
    assert len(c.out) == 2
    assert c.attrs(0) == (45, 1, True)  # 5 -> 50, not counting what came after
    assert c.attrs(1) == (330, 1, True)


def test_a_body_read_after_the_first_write_keeps_one_threads_window() -> None:
    c = Conn()
    c.io(3000, IN, b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nab", 200)
    c.io(3100, OUT, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nxy", 210)
    c.io(3150, IN, b"cd", 230)
    c.io(3300, OUT, b"zw", 260)
    assert c.attrs() == (60, 1, True)


def test_two_threads_sum_each_ones_waits_between_its_own_reads_and_writes() -> None:
    c = Conn()
    c.io(2000, IN, REQ, 10, tid=7)
    c.io(2100, OUT, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", 100, tid=8)
    c.io(2200, OUT, b"ab", 15, tid=7)
    c.io(2300, OUT, b"cd", 130, tid=8)
    # thread 7: 10 -> 15; thread 8: 100 -> 130; a lower bound
    assert c.attrs() == (5 + 30, 2, False)
    c.io(3000, IN, REQ, 131, tid=8)  # the next exchange: thread 8 alone again
    c.io(3100, OUT, RESP, 140, tid=8)
    assert c.attrs() == (9, 1, True)


def test_a_head_in_several_reads_counts_from_the_first() -> None:
    c = Conn()
    c.io(100, IN, REQ[:5], 3)
    c.io(150, IN, REQ[5:], 8)
    c.io(300, OUT, RESP, 20)
    assert c.out[0].request.start_ns == 100
    assert c.attrs() == (17, 1, True)


def test_a_counter_that_steps_back_adds_nothing_and_wraps_modulo_2_32() -> None:
    c = Conn()
    c.io(100, IN, REQ, 50)
    c.io(200, OUT, RESP, 40)  # the thread's counter restarted (a reused tid)
    assert c.attrs() == (0, 1, True)
    c.io(300, IN, REQ, (1 << 32) - 3)
    c.io(400, OUT, RESP, 4)  # the 32-bit microsecond counter wrapped
    assert c.attrs() == (7, 1, True)


def test_a_response_ended_by_a_kernel_summary_is_a_lower_bound() -> None:
    """Folded body writes (bpf/stream.h) carry no counter: the span's last byte is not a
    read or write the parser saw, so the value stops at the head's write."""
    c = Conn()
    c.io(100, IN, b"GET /s HTTP/1.1\r\n\r\n", 1)
    c.io(200, OUT, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", 6)
    c.parser.feed_stream(StreamChunk(OUT, 3, 0, 300, 500, 50, 9, 30, 600, True,
                                     (b"3\r\nabc\r\n", b"0\r\n\r\n")))
    assert c.out[0].response is not None and c.out[0].response.end_ns == 600
    assert c.attrs() == (5, 1, False)


def test_chunks_without_a_thread_give_no_attributes() -> None:
    """Records with no thread (a recording made before Chunk.tid, a summary): nothing is
    invented."""
    c = Conn()
    c.io(100, IN, REQ, 0, tid=0)
    c.io(200, OUT, RESP, 0, tid=0)
    assert c.attrs() == (None, None, None)


def test_switches_are_bounded_and_an_exchange_past_them_is_inexact() -> None:
    """A thread pool's connection switches thread at every read and write: the parser keeps
    the switches of the exchanges in flight only (none between requests), at most 256; an
    exchange longer than what is kept is a lower bound."""
    c = Conn()
    u = 0
    for k in range(400):  # 800 switches, one exchange each time
        c.io(10_000 + 100 * k, IN, REQ, u, tid=7)
        c.io(10_050 + 100 * k, OUT, RESP, 1000 + u, tid=8)
        u += 2
        assert c.attrs() == (0, 2, False)  # each thread did one read or write: nothing timed
        assert c.out[-1].runq_switches is not None and len(c.out[-1].runq_switches) <= 2
        assert c.parser._swlog == []  # nothing in flight: nothing kept
    c.io(100_000, IN, b"POST / HTTP/1.1\r\nContent-Length: 600\r\n\r\n", u, tid=7)
    for k in range(300):  # the request body read by two threads in turn: 600 switches
        c.io(100_001 + k, IN, b"xx", u + 1 + k, tid=8 if k % 2 == 0 else 7)
    assert len(c.parser._swlog) <= 256
    c.io(101_000, OUT, RESP, u + 1000, tid=7)
    threads = c.attrs()[1]
    assert c.out[-1].runq_ends is False and threads == 2


def test_pipelined_exchanges_keep_the_switches_they_span() -> None:
    """Two requests in one read, answered by two threads: the second exchange's window
    (from the shared read to its own response) still holds the switch, since it was in
    flight when the first was emitted."""
    c = Conn()
    c.io(100, IN, REQ + REQ, 10, tid=7)
    c.io(200, OUT, RESP, 20, tid=8)
    assert len(c.out) == 1 and c.parser._swlog != []
    c.io(300, OUT, RESP, 26, tid=8)
    assert len(c.out) == 2 and c.parser._swlog == []
    assert c.attrs(0) == (0, 2, False)
    assert c.attrs(1) == (6, 2, False)  # thread 7: 10 -> 10; thread 8: 20 -> 26
