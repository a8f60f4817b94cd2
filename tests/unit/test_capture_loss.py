"""Loss that must not desynchronise (issue 10): records built byte for byte as bpf/http.c
writes them (the ctypes/struct mirror in agent/capture/events.py), fed to the Tracer.

- DATA_LOST (records of a connection lost in a full ring): the pending exchange ends as
  capture_gap, never malformed_request, and the next request on the connection is traced;
- a close event lost: the fd's next connection replaces the stale entry, and an idle entry
  whose fd is gone from /proc expires (both counted);
- requests past the capture limit of one read are counted as requests_uncaptured;
- x-request-id and traceparent survive past the 64th header.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from sits_trace.agent.capture.events import (
    _DATA_HDR,
    DATA_GAP,
    DATA_LOST,
    DATA_TAIL,
    ConnEventC,
    Kind,
    decode,
)
from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role, Span
from sits_trace.agent.tracing.http1 import ERR_BAD_REQUEST, ERR_GAP, HttpConnParser
from sits_trace.agent.tracing.pipeline import Tracer
from sits_trace.agent.tracing.procfs import ProcFS
from sits_trace.agent.tracing.spans import SpanBuilder

PID, FD = 4242, 7
IN, OUT = 0, 1


def conn_rec(kind: Kind, conn_id: int, fd: int = FD, ts: int = 1) -> bytes:
    c = ConnEventC(kind=int(kind), tgid=PID, conn_id=conn_id, ts_ns=ts, tid=PID, fd=fd,
                   listen_fd=-1, family=2, peer_port=5555, role=int(Role.SERVER),
                   local_port=8080)
    c.peer_addr[:4] = [10, 0, 0, 9]
    return bytes(c)


def data_rec(conn_id: int, direction: int, payload: bytes, length: int | None = None,
             ts: int = 1, flags: int = 0, fd: int = FD) -> bytes:
    n = len(payload) if length is None else length
    hdr = _DATA_HDR.pack(int(Kind.DATA), PID, conn_id, ts, ts + 1, 0, PID, fd, n, len(payload),
                         direction, 0, int(Role.SERVER), flags, 0)
    return hdr + payload


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def tracer(tmp_path: Path, clock: Clock | None = None) -> tuple[Tracer, list[Span]]:
    spans: list[Span] = []
    t = Tracer(src_none(), spans.append, SpanBuilder(clock_offset_ns=0),
               procfs=ProcFS(str(tmp_path)), monotonic_ns=clock or Clock())
    return t, spans


class src_none:  # a stand-in event source that never yields
    def read(self, timeout_ms: int) -> list[bytes]:
        return []

    def close(self) -> None:
        pass


def attrs(spans: list[Span]) -> list[tuple[object, ...]]:
    return [(s.attributes.get("http.request.method"), s.attributes.get("url.path"),
             s.attributes.get("http.response.status_code"), s.attributes.get("error.type"))
            for s in spans if s.kind == "SERVER"]


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CREATED = b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"


def test_decode_reads_the_lost_flag() -> None:
    ev = decode(data_rec(1, IN, b"x", flags=DATA_LOST | 3))
    assert ev.lost and not ev.gap and ev.sample_shift == 3  # type: ignore[union-attr]
    ev = decode(data_rec(1, IN, b"x", flags=DATA_GAP))
    assert ev.gap and not ev.lost  # type: ignore[union-attr]


def test_tail_records_of_a_long_body_keep_its_size_and_end(tmp_path: Path) -> None:
    """Past a request's first 64 KiB the kernel sends each read's last bytes (DATA_TAIL):
    decoded with the flag, fed as uncaptured bytes before the tail; the span has the body's
    exact size, the trailing GenAI fields, and the next request on the connection."""
    ev = decode(data_rec(1, IN, b"x", length=9, flags=DATA_TAIL))
    assert ev.tail and not ev.lost and not ev.gap  # type: ignore[union-attr]
    t, spans = tracer(tmp_path)
    size = 300_000
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % size)
    first = 65536 - len(head)
    recs = [conn_rec(Kind.CONN_OPEN, 1),
            data_rec(1, IN, head + b'{"prompt": "' + b"p" * 4000, length=65536, ts=10)]
    left, ts = size - first, 20
    end = b'", "model": "m-tail", "max_tokens": 5}'
    while left:
        n = min(left, 65536)
        left -= n
        tail = (b"p" * 512 + end)[-512:] if not left else b"p" * 512
        recs.append(data_rec(1, IN, tail, length=n, ts=ts, flags=DATA_TAIL))
        ts += 10
    recs += [data_rec(1, OUT, OK, ts=ts),
             data_rec(1, IN, b"GET /after HTTP/1.1\r\nHost: h\r\n\r\n", ts=ts + 10),
             data_rec(1, OUT, OK, ts=ts + 11)]
    t.process(recs)
    t.close_all()
    assert attrs(spans) == [("POST", "/v1/completions", 200, None), ("GET", "/after", 200, None)]
    a = spans[0].attributes
    assert a["http.request.body.size"] == size
    assert (a.get("gen_ai.request.model"), a.get("gen_ai.request.max_tokens")) == ("m-tail", 5)


def test_upload_with_lost_records_then_next_request_is_traced(tmp_path: Path) -> None:
    t, spans = tracer(tmp_path)
    size = 100 * 1024 * 1024
    recs = [conn_rec(Kind.CONN_OPEN, 1),
            data_rec(1, IN, b"POST /upload HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % size
                     + b"a" * 1000, ts=10)]
    recs += [data_rec(1, IN, b"b" * 4096, length=65536, ts=20 + i) for i in range(50)]
    # the ring overflowed: the rest of the body, the response and the next request's first
    # records are gone; the first record that got through carries DATA_LOST
    recs += [data_rec(1, IN, b"GET /after HTTP/1.1\r\nHost: h\r\nx-request-id: r1\r\n\r\n",
                      ts=900, flags=DATA_LOST),
             data_rec(1, OUT, OK, ts=901)]
    t.process(recs)
    t.close_all()
    got = attrs(spans)
    assert got == [("POST", "/upload", None, ERR_GAP), ("GET", "/after", 200, None)], got
    p = t.stats.parser
    assert (p.capture_lost, p.malformed) == (1, 0)


def test_chunked_upload_cut_by_loss_is_not_the_clients_fault(tmp_path: Path) -> None:
    t, spans = tracer(tmp_path)
    recs = [conn_rec(Kind.CONN_OPEN, 1),
            data_rec(1, IN, b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\n"
                     + b"z" * 100, ts=10),
            # resumes in the middle of a later chunk's data, then the next request
            data_rec(1, IN, b"zzzz\r\n0\r\n\r\n", ts=50, flags=DATA_LOST),
            data_rec(1, OUT, CREATED, ts=51),
            data_rec(1, IN, b"GET /next HTTP/1.1\r\n\r\n", ts=60),
            data_rec(1, OUT, OK, ts=61)]
    t.process(recs)
    t.close_all()
    got = attrs(spans)
    assert ("GET", "/next", 200, None) in got, got
    assert all(g[3] != ERR_BAD_REQUEST for g in got), got
    assert got[0] == ("POST", "/c", None, ERR_GAP)
    assert t.stats.parser.malformed == 0


def test_loss_flag_on_a_body_record_resyncs_at_the_next_request(tmp_path: Path) -> None:
    t, spans = tracer(tmp_path)
    recs = [conn_rec(Kind.CONN_OPEN, 1),
            data_rec(1, IN, b"PUT /p HTTP/1.1\r\nContent-Length: 99999\r\n\r\n", ts=10),
            data_rec(1, IN, b"GET /fake HTTP/1.1 inside a body\r\n" + b"q" * 500, ts=20,
                     flags=DATA_LOST),
            data_rec(1, IN, b"GET /real HTTP/1.1\r\n\r\n", ts=30),
            data_rec(1, OUT, OK, ts=31)]
    t.process(recs)
    t.close_all()
    assert attrs(spans) == [("PUT", "/p", None, ERR_GAP), ("GET", "/real", 200, None)]


def test_the_tracers_read_of_a_data_header_keeps_its_flags_and_refuses_what_cannot_be(
        tmp_path: Path) -> None:
    """agent/tracing/pipeline.py reads data records straight from their header
    (events.data_header), with no DataEvent: the sample shift reaches the span as
    sampling.probability, and records whose header cannot be (more captured than the record
    holds or than moved; an unknown direction, source or role) are decode errors that cost
    the connection nothing."""
    t, spans = tracer(tmp_path)
    good = data_rec(1, IN, b"GET /a HTTP/1.1\r\n\r\n", ts=10, flags=3)
    bad = [good[:-1],  # captured says one byte more than the record has
           data_rec(1, IN, b"GET /x HTTP/1.1\r\n\r\n", length=5, ts=11)]
    for field, value in ((10, 2), (11, 3), (12, 3)):  # direction, source, role
        f = list(_DATA_HDR.unpack_from(good))
        f[field] = value
        bad.append(_DATA_HDR.pack(*f) + good[_DATA_HDR.size:])
    t.process([conn_rec(Kind.CONN_OPEN, 1), good, *bad, data_rec(1, OUT, OK, ts=12, flags=3)])
    t.close_all()
    assert attrs(spans) == [("GET", "/a", 200, None)]
    assert spans[0].attributes["sampling.probability"] == 1 / 8
    assert t.stats.decode_errors == len(bad) == 5


def test_lost_close_replaced_by_the_next_connection_on_the_fd(tmp_path: Path) -> None:
    t, _ = tracer(tmp_path)
    t.process([conn_rec(Kind.CONN_OPEN, 1), conn_rec(Kind.CONN_OPEN, 2),
               conn_rec(Kind.CONN_OPEN, 3, fd=8)])
    assert (t.stats.conns_active, t.stats.conns_replaced) == (2, 1)
    t.process([conn_rec(Kind.CONN_CLOSE, 2), conn_rec(Kind.CONN_CLOSE, 3, fd=8)])
    assert t.stats.conns_active == 0


def test_idle_connection_whose_fd_is_gone_expires(tmp_path: Path) -> None:
    clock = Clock()
    fd_dir = tmp_path / str(PID) / "fd"
    fd_dir.mkdir(parents=True)
    os.symlink("socket:[777]", fd_dir / "8")  # fd 8 is still an open socket
    t, _ = tracer(tmp_path, clock)
    t.process([conn_rec(Kind.CONN_OPEN, 1), conn_rec(Kind.CONN_OPEN, 2, fd=8)])
    clock.ns = 29_000_000_000
    t.sweep(clock.ns)
    assert t.stats.conns_expired == 0
    clock.ns = 31_000_000_000
    t.sweep(clock.ns)
    assert (t.stats.conns_expired, t.stats.conns_active) == (1, 1)  # fd 7 gone, fd 8 kept
    t.process([data_rec(2, IN, b"GET / HTTP/1.1\r\n\r\n", ts=clock.ns, fd=8)])
    assert t.stats.orphan_data == 0


def run_parser(chunks: list[Chunk], max_headers: int = 64) -> tuple[list[Exchange], HttpConnParser]:
    out: list[Exchange] = []
    info = ConnInfo(conn_id=1, pid=PID, fd=FD, role=Role.SERVER)
    p = HttpConnParser(info, out.append, max_headers=max_headers)
    for c in chunks:
        p.feed(c)
    return out, p


def test_pipelined_burst_past_the_capture_limit_is_counted() -> None:
    one = b"GET /p HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: burst\r\nAccept: */*\r\n\r\n"
    burst = one * 200
    cap = 4096
    fit = cap // len(one)
    out, p = run_parser([Chunk(Direction.INGRESS, 1, 2, burst[:cap], len(burst))]
                        + [Chunk(Direction.EGRESS, 3, 4, OK, len(OK)) for _ in range(200)])
    assert len(out) == fit
    assert abs(p.stats.requests_uncaptured - (200 - fit)) <= 3, (p.stats.requests_uncaptured, fit)
    assert p.stats.orphan_responses == 200 - fit


def test_identity_headers_after_the_64th_are_kept() -> None:
    junk = b"".join(b"x-h%d: v\r\n" % i for i in range(1000))
    head = (b"GET /h HTTP/1.1\r\n" + junk + b"x-request-id: rid-1000\r\n"
            b"traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n\r\n")
    out, _ = run_parser([Chunk(Direction.INGRESS, 1, 2, head, len(head)),
                         Chunk(Direction.EGRESS, 3, 4, OK, len(OK))])
    fields = dict(out[0].request.headers)
    assert fields["x-request-id"] == "rid-1000"
    assert fields["traceparent"].startswith("00-4bf92f")
    assert len(out[0].request.headers) == 66


def test_mirror_offsets_cover_the_flags() -> None:
    # the loss flag shares `flags` with the sample shift (0x1f) and the gap (0x80)
    assert DATA_LOST & 0x1F == 0 and DATA_LOST & DATA_GAP == 0
    assert DATA_TAIL & (0x1F | DATA_GAP | DATA_LOST) == 0
    assert ctypes.sizeof(ConnEventC) > 0


def test_a_connection_with_no_http_is_muted_once_and_http_ones_never(tmp_path: Path) -> None:
    t, spans = tracer(tmp_path)
    calls: list[tuple[int, int, int]] = []

    def mute(pid: int, fd: int, conn_id: int) -> bool:
        calls.append((pid, fd, conn_id))
        return True

    t.mute = mute
    t.process([conn_rec(Kind.CONN_OPEN, 1), conn_rec(Kind.CONN_OPEN, 2, fd=FD + 1)])
    redis = b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n"
    for i in range(40):  # another protocol on connection 1, HTTP on connection 2
        t.process([data_rec(1, IN, redis, ts=10 * i), data_rec(1, OUT, b"+OK\r\n", ts=10 * i + 5),
                   data_rec(2, IN, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", fd=FD + 1, ts=10 * i),
                   data_rec(2, OUT, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", fd=FD + 1,
                            ts=10 * i + 5)])
    assert calls == [(PID, FD, 1)]  # once, at the 32nd chunk, by (pid, fd, conn_id)
    assert t.stats.conns_muted == 1
    assert len(spans) == 40 and all(s.attributes["http.response.status_code"] == 200
                                    for s in spans)
