"""Fuzz of the record decoder and the HTTP parser (hypothesis): zero escapes.

decode() may raise DecodeError and nothing else; HttpConnParser.feed() never raises and never
counts an internal error (a parser bug caught by its own guard) for any byte stream, split
anywhere, in either direction, with any captured/moved lengths. SITS_FUZZ_EXAMPLES sets the
number of inputs per test (default 500 to keep the unit suite short; 20,000 for a full run).
"""

from __future__ import annotations

import os
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sits_trace.agent.capture.events import _DATA_HDR, DATA_HDR_SIZE, DecodeError, Kind, decode
from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role
from sits_trace.agent.tracing.http1 import HttpConnParser

N = int(os.environ.get("SITS_FUZZ_EXAMPLES", "500"))
FUZZ = settings(max_examples=N, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# pieces that steer random bytes into the parser's interesting states
TOKENS = [b"GET / HTTP/1.1\r\n", b"POST /v1/chat/completions HTTP/1.1\r\n", b"HTTP/1.1 200 OK\r\n",
          b"HTTP/1.0 101 Switching\r\n", b"HTTP/1.1 100 Continue\r\n\r\n", b"Content-Length: 5\r\n",
          b"Content-Length: 99999999999999999999\r\n", b"Content-Length: -1\r\n",
          b"Transfer-Encoding: chunked\r\n", b"content-type: text/event-stream\r\n",
          b"x-request-id: r\r\n", b"\r\n", b"\r\n\r\n", b"5\r\nhello\r\n", b"0\r\n\r\n",
          b"ffffffffffffffff\r\n", b"data: [DONE]\n\n", b"\x16\x03\x01", b" folded\r\n",
          b"CONNECT h:443 HTTP/1.1\r\n", b"HEAD / HTTP/1.1\r\n", b"\x00\xff", b"\n", b"HTTP/1."]

chunk_st = st.tuples(
    st.sampled_from([Direction.INGRESS, Direction.EGRESS]),
    st.lists(st.one_of(st.sampled_from(TOKENS), st.binary(max_size=64)), max_size=12)
    .map(b"".join),
    st.integers(min_value=0, max_value=70000),  # bytes moved beyond those captured
    st.sampled_from(["feed", "feed", "feed", "gap", "lost", "idle"]),
)


@FUZZ
@given(st.sampled_from(list(Role)), st.lists(chunk_st, max_size=25))
def test_parser_never_escapes(role: Role, chunks: list[tuple[Direction, bytes, int, str]]) -> None:
    out: list[Exchange] = []
    p = HttpConnParser(ConnInfo(conn_id=1, pid=1, fd=3, role=role), out.append,
                       max_header_bytes=256, max_headers=4)
    t = 0
    for direction, data, extra, op in chunks:
        t += 10
        if op == "gap":
            p.gap()
        elif op == "lost":
            p.lost()
        elif op == "idle":
            p.flush_idle(t, 5)
        p.feed(Chunk(direction, t, t + 1, data, len(data) + extra))
    p.close(t + 100)
    assert p.stats.internal_errors == 0
    for ex in out:  # every exchange is whole enough to become a span
        assert ex.request.method and ex.request.end_ns >= 0


hdr_st = st.builds(
    lambda kind, tgid, conn, t0, t1, ssl, tid, fd, length, captured, d, s, r, f, rq: _DATA_HDR.pack(
        kind, tgid, conn, t0, t1, ssl, tid, fd, length, captured, d, s, r, f, rq),
    st.sampled_from([int(k) for k in Kind] + [0, 7, 8, 12, 255, 2**32 - 1]),
    st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1),
    st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**32 - 1), st.integers(0, 70000),
    st.integers(0, 255), st.integers(0, 255), st.integers(0, 255), st.integers(0, 255),
    st.integers(0, 2**32 - 1),
)


@FUZZ
@given(st.one_of(st.binary(max_size=200),
                 st.tuples(st.sampled_from([int(k) for k in Kind]), st.binary(max_size=200))
                 .map(lambda x: x[0].to_bytes(4, "little") + x[1]),
                 st.tuples(hdr_st, st.binary(max_size=300)).map(lambda x: x[0] + x[1])))
def test_decoder_raises_only_decode_error(raw: bytes) -> None:
    try:
        ev = decode(raw)
    except DecodeError:
        return
    payload = getattr(ev, "payload", None)
    if payload is not None:  # a data record: the payload lies inside the record
        assert len(raw) >= DATA_HDR_SIZE + len(payload)
        assert len(payload) <= ev.length  # type: ignore[union-attr]


def test_fuzz_header_mirror_is_the_decoders() -> None:
    assert _DATA_HDR.size == DATA_HDR_SIZE and struct.calcsize("<I") == 4
