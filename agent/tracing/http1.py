"""Incremental HTTP/1.x parser for one traced connection: chunks in, exchanges out.

Each direction of the connection is a `_Half` with a small state machine (head,
Content-Length body, chunked body, close-delimited body, resync). Requests are
paired FIFO with responses, so keep-alive and pipelining come for free. Body bytes
are only counted, never buffered: the only bytes kept between chunks are an
incomplete header block, an incomplete chunk-size or trailer line, or the tail of
a line while resyncing, all bounded by `max_header_bytes`.

Hot path (a whole header block in one chunk): one `bytes.find`, one decode, one
split, one loop over header lines. `feed` never raises: malformed input is
counted in `ParserStats` and the half resyncs on the next plausible start line.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from sits_trace.agent.model import (
    Chunk,
    ConnInfo,
    Exchange,
    RequestHead,
    ResponseHead,
    Role,
    StreamChunk,
)

REDACTED = "[redacted]"
REDACTED_HEADERS = frozenset({"authorization", "cookie", "set-cookie", "proxy-authorization"})
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"}
)
_KNOWN_METHODS_B = frozenset(m.encode() for m in KNOWN_METHODS)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # only for methods outside KNOWN_METHODS
_TLS_RECORD_TYPES = frozenset({0x14, 0x15, 0x16, 0x17})  # change_cipher_spec .. application_data
_HEX = b"0123456789abcdefABCDEF"
_MAX_CHUNK_LINE = 4096

# exchange errors
ERR_CLOSED = "connection_closed"
ERR_INCOMPLETE = "response_incomplete"
ERR_IDLE = "idle_timeout"
ERR_GAP = "capture_gap"  # the rest of the exchange was not captured (shed, or lost by the agent)
ERR_BAD_REQUEST = "malformed_request"
ERR_BAD_RESPONSE = "malformed_response"

# what a half carries
_ANY, _REQ, _RESP = 0, 1, 2

# half states
_HEAD = 0  # waiting for a start line and headers (h.buf: the incomplete block)
_LENGTH = 1  # Content-Length body (h.remaining: bytes left)
_CHUNK_SIZE = 2  # chunked: waiting for a chunk-size line (h.buf: incomplete line)
_CHUNK_DATA = 3  # chunked: inside chunk data (h.remaining: bytes left)
_CHUNK_CR = 4  # chunked: expecting the CRLF after chunk data
_CHUNK_LF = 5  # chunked: CR seen, expecting LF
_TRAILER = 6  # chunked: trailer fields until an empty line (h.buf: incomplete line)
_CLOSE = 7  # response body delimited by connection close
_LOST = 8  # chunked framing lost in uncaptured bytes: count until the message visibly ends
_RESYNC = 9  # dropping bytes until a plausible start line (h.buf: tail of the last line)
_IGNORE = 10  # not HTTP any more (after 101 Switching Protocols or CONNECT)
_TLS = 11  # began with TLS-looking bytes: skipped, unless a chunk begins with a start line
# a connection is `opaque` (no HTTP to find: the agent tells the kernel to stop sending it)
# once both halves are _IGNORE, or when, with no exchange ever, this many chunks left a half
# resyncing (another protocol: a cache, a database, gRPC) or in TLS (a library not probed);
# TLS waits longer: a handshake's records come before a probed library's plaintext
_OPAQUE_AFTER = 32
_OPAQUE_TLS_AFTER = 64
# thread switches a connection remembers while exchanges are in flight (HttpConnParser._switch;
# none once they are all emitted); an exchange whose first switch was dropped is inexact
_SWITCHES_KEPT = 256
# headers kept whatever the header count (trace and request identity)
IDENTITY_HEADERS = frozenset({"x-request-id", "traceparent", "tracestate", "x-correlation-id",
                              "x-b3-traceid", "b3", "x-amzn-trace-id", "request-id"})


@dataclass(slots=True)
class ParserStats:
    resyncs: int = 0  # times a half found a start line again after malformed input
    malformed: int = 0  # malformed heads, lengths, chunk sizes, cut header blocks
    exchanges: int = 0  # exchanges emitted
    dropped_bytes: int = 0  # bytes skipped while resyncing
    gaps: int = 0  # times the kernel skipped exchanges (load shedding) and the parser restarted
    uncaptured_bytes: int = 0  # bytes that moved but were not captured (Chunk.length - data)
    orphan_responses: int = 0  # responses with no pending request (dropped)
    tls_streams: int = 0  # connection halves skipped because they began with TLS records
    tls_false_alarms: int = 0  # such halves that later began a chunk with an HTTP start line
    capture_lost: int = 0  # times records of a connection were lost (ring full): resynced
    requests_uncaptured: int = 0  # requests (estimated) that began past the capture limit
    stream_summaries: int = 0  # kernel summaries of folded body writes applied
    stream_orphans: int = 0  # summaries with no response body open to apply them to
    internal_errors: int = 0  # parser bugs or emit callbacks that raised (never propagated)


class _Pending:
    """A request waiting for its end, its response, or both."""

    __slots__ = ("error", "req_done", "request", "resp_done", "response", "rq_sw0", "rq_sw1",
                 "rq_t0", "rq_t1", "rq_ts1", "rq_u0", "rq_u1")

    def __init__(self, request: RequestHead) -> None:
        self.request = request
        self.response: ResponseHead | None = None
        self.req_done = False
        self.resp_done = False
        self.error: str | None = None
        # the run-queue marks (HttpConnParser._mtid, _mu, _msw, _mts) at the request's first
        # byte and at the response's end: the thread, its counter, the connection's thread
        # switches so far, and (the end's) the read or write's exit time
        self.rq_t0 = 0
        self.rq_u0 = 0
        self.rq_sw0 = 0
        self.rq_t1 = 0
        self.rq_u1 = 0
        self.rq_sw1 = 0
        self.rq_ts1 = 0


class _Half:
    """Parse state of one direction of the connection."""

    __slots__ = (
        "body_feed",
        "buf",
        "feeds",
        "fresh",
        "head_enter",
        "head_exit",
        "head_sw",
        "head_tid",
        "head_u",
        "kind",
        "line_checked",
        "msgs",
        "pending",
        "remaining",
        "req",
        "resp",
        "sol",
        "state",
        "tap",
    )

    def __init__(self, kind: int) -> None:
        self.kind = kind
        self.state = _HEAD
        self.buf = b""
        self.remaining = 0
        self.head_enter = 0  # ts of the chunk where the buffered bytes began
        self.head_exit = 0
        self.head_tid = 0  # the run-queue marks of the chunk where the buffered bytes began
        self.head_u = 0
        self.head_sw = 0
        self.line_checked = False  # the buffered head's first line was checked
        self.sol = False  # while resyncing: buf begins at a line start
        self.fresh = True  # nothing seen yet (TLS check pending)
        self.tap = False  # keep a bounded head/tail of this message's body (model routes)
        self.req: RequestHead | None = None  # request whose body is being read
        self.resp: ResponseHead | None = None  # response whose body is being read
        self.pending: _Pending | None = None
        self.feeds = 0  # chunks fed, to count body chunks once per chunk
        self.body_feed = 0
        self.msgs = 0  # requests that began in the current chunk (estimates those past the capture)

    def clear_message(self) -> None:
        self.state = _HEAD
        self.req = None
        self.resp = None
        self.pending = None
        self.body_feed = 0


class HttpConnParser:
    """Turns the chunks of one connection into `Exchange`s, passed to `emit` in order.

    With `Role.UNKNOWN` the direction of requests is learnt from the first start line;
    the exchanges then carry a copy of `conn` with the learnt role.
    """

    __slots__ = (
        "_awaiting",
        "_conn",
        "_emit",
        "_emitted",
        "_halves",
        "_in",
        "_junk",
        "_last_ns",
        "_max_header_bytes",
        "_max_headers",
        "_msw",
        "_mtid",
        "_mts",
        "_mu",
        "_off",
        "_order",
        "_out",
        "_swbase",
        "_swlog",
        "conn",
        "opaque",
        "stats",
    )

    def __init__(
        self,
        conn: ConnInfo,
        emit: Callable[[Exchange], None],
        *,
        max_header_bytes: int = 16384,
        max_headers: int = 64,
        stats: ParserStats | None = None,
    ) -> None:
        self.conn = conn
        self.stats = stats if stats is not None else ParserStats()
        self._conn = conn
        self._emit = emit
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers
        in_kind, out_kind = _kinds(conn.role)
        self._in = _Half(in_kind)  # INGRESS
        self._out = _Half(out_kind)  # EGRESS
        self._halves = (self._in, self._out)
        self._order: deque[_Pending] = deque()  # emission order
        self._awaiting: deque[_Pending] = deque()  # requests with no response head yet
        self._last_ns: int = conn.opened_ns
        self._off = False  # closed, or TLS ciphertext
        self._emitted = 0  # exchanges emitted
        self._junk = 0  # chunks that left a half resyncing, ignored or in TLS
        self.opaque = False  # no HTTP to find here (see _OPAQUE_AFTER)
        # run-queue marks of the last read or write seen (Chunk.tid, .runq_us, its exit) and
        # the thread switches between reads and writes of the connection: their count, and
        # the last of them (_swlog[i] is switch number _swbase + i; see Exchange.runq_*)
        self._mtid = 0
        self._mu = 0
        self._mts = 0
        self._msw = 0
        self._swlog: list[tuple[int, int, int, int]] = []
        self._swbase = 0

    # ---- public ----

    def feed(self, chunk: Chunk) -> None:
        """Parse one read or write. Never raises."""
        if self._off:
            return
        try:
            h = self._halves[chunk.direction]
            data = chunk.data
            self._last_ns = chunk.ts_exit_ns
            tid = chunk.tid
            if tid:
                if tid != self._mtid:
                    if self._mtid:
                        self._switch(tid, chunk.runq_us)
                    self._mtid = tid
                self._mu = chunk.runq_us
                self._mts = chunk.ts_exit_ns
            if h.fresh and data and self._is_tls(h, data):
                self._lost_chunk(_TLS)
                return
            end = len(data)
            pos = 0
            h.feeds += 1
            h.msgs = 0
            if chunk.tail and chunk.length > end:
                # a long request body's later read: what came before its captured last bytes
                self._uncaptured(h, chunk.length - end, chunk)
            while pos < end:
                st = h.state
                if st == _HEAD:
                    if h.buf:
                        pos = self._head_slow(h, data, pos, chunk)
                        continue
                    # fast path: the whole header block is in this chunk
                    e = data.find(b"\r\n\r\n", pos)
                    if 0 <= e - pos <= self._max_header_bytes:
                        kind = h.kind
                        if kind == _REQ:
                            ok = self._request(h, data[pos:e], chunk.ts_exit_ns, chunk)
                        elif kind == _RESP:
                            ok = self._response(h, data[pos:e], chunk.ts_enter_ns, chunk)
                        else:
                            ok = self._message(h, data[pos:e], chunk.ts_enter_ns,
                                               chunk.ts_exit_ns, chunk)
                        if ok:
                            pos = e + 4
                            continue
                    pos = self._head(h, data, pos, chunk, e)
                elif st == _LENGTH or st == _CHUNK_DATA:
                    take = min(end - pos, h.remaining)
                    pos += take
                    h.remaining -= take
                    self._body(h, take, chunk, data[pos - take:pos])
                    if not h.remaining:
                        if st == _LENGTH:
                            self._complete(h, chunk)
                        else:
                            h.state = _CHUNK_CR
                else:
                    pos = self._other_state(h, st, data, pos, chunk)
            if chunk.length > end and not chunk.tail:
                self._uncaptured(h, chunk.length - end, chunk)
            st = h.state
            if st == _RESYNC or st == _TLS or st == _IGNORE:
                self._lost_chunk(st)
        except Exception:  # noqa: BLE001 - a parser bug must not stop the pipeline
            self.stats.internal_errors += 1
            self._recover()

    def _lost_chunk(self, st: int) -> None:
        """A chunk left a half with nothing to parse: is the connection `opaque`?"""
        self._junk += 1
        if st == _IGNORE:
            self.opaque = self._in.state == _IGNORE and self._out.state == _IGNORE
        elif not self._emitted:
            self.opaque = self._junk >= (_OPAQUE_TLS_AFTER if st == _TLS else _OPAQUE_AFTER)

    def feed_stream(self, s: StreamChunk) -> None:
        """Body writes the kernel folded into one summary (bpf/stream.h): counted exactly
        as `feed` would have counted them one by one. Never raises."""
        if self._off:
            return
        try:
            h = self._halves[s.direction]
            r = h.resp
            if r is None or h.state in (_HEAD, _RESYNC, _IGNORE):
                self.stats.stream_orphans += 1
                return
            self.stats.stream_summaries += 1
            self._last_ns = max(s.last_exit_ns, s.end_ns)
            if s.writes:
                self._stream_body(h, r, s)
            if s.complete:
                end = s.end_ns or s.last_exit_ns
                self._complete(h, Chunk(s.direction, end, end, b"", 0))
            elif h.state == _LENGTH:
                h.remaining = max(0, h.remaining - s.wire_bytes)
                if not h.remaining:
                    self._complete(h, Chunk(s.direction, s.last_exit_ns, s.last_exit_ns, b"", 0))
        except Exception:  # noqa: BLE001 - a parser bug must not stop the pipeline
            self.stats.internal_errors += 1
            self._recover()

    def _stream_body(self, h: _Half, r: ResponseHead, s: StreamChunk) -> None:
        h.feeds += s.writes
        h.body_feed = h.feeds
        if r.sse and r.first_token_ns is None:
            if not is_preamble(_unframe(s.head)):
                r.first_token_ns = s.first_enter_ns
            elif s.second_enter_ns:
                r.first_token_ns = s.second_enter_ns
        if r.first_body_ns is None:
            r.first_body_ns = s.first_enter_ns
        elif r.last_body_ns is not None:
            r.max_gap_ns = max(r.max_gap_ns, s.first_enter_ns - r.last_body_ns)
        r.max_gap_ns = max(r.max_gap_ns, s.max_gap_ns)
        r.body_chunks += s.writes
        r.body_bytes += s.body_bytes
        r.last_body_ns = r.end_ns = s.last_exit_ns
        if r.sse:
            r.sse_events += s.events
        if r.sse or h.tap:
            data = b"".join(_unframe(t) for t in s.tails)
            if b"data: [DONE]" in data:
                r.sse_done = True
            r.body_tail = (r.body_tail + data)[-TAP_BYTES:]

    def close(self, ts_ns: int) -> None:
        """The connection closed at `ts_ns`: complete or fail everything pending."""
        if self._off and not self._order:
            return
        self._off = True
        self._last_ns = max(self._last_ns, ts_ns)
        self._finish(ERR_CLOSED)

    def gap(self) -> None:
        """The kernel skipped whole exchanges on this connection (load shedding) before the
        next chunk, which starts an exchange. Whatever is pending ended in the skipped
        bytes: complete it where it stands and begin both halves afresh."""
        if self._off:
            return
        self.stats.gaps += 1
        self._finish(ERR_GAP, cut=ERR_GAP)  # a response in flight went on in skipped bytes

    def lost(self) -> None:
        """Records of this connection were lost (the agent's ring was full) before the next
        chunk, which may begin anywhere in a message. What is pending ended unseen
        (capture_gap, never the client's fault) and both halves resync at the next start
        line; a chunk boundary may begin one."""
        if self._off:
            return
        self.stats.capture_lost += 1
        # a response in flight went on in the lost records: capture_gap too, not
        # response_incomplete (that blames the server; CI: a node stream under load)
        self._finish(ERR_GAP, cut=ERR_GAP)
        for h in self._halves:
            if h.state not in (_IGNORE, _TLS):
                h.state = _RESYNC
                h.buf = b""
                h.sol = True

    @property
    def last_ns(self) -> int:
        """Time of the last chunk (or the connection's opening)."""
        return self._last_ns

    def flush_idle(self, now_ns: int, idle_ns: int) -> None:
        """After `idle_ns` without bytes, complete a close-delimited response and give up
        on whatever else is pending (requests without response: error "idle_timeout")."""
        if now_ns - self._last_ns < idle_ns or self._off:
            return
        if not self._order and not any(
            h.buf or h.state not in (_HEAD, _IGNORE, _TLS) for h in self._halves
        ):
            return
        self._finish(ERR_IDLE)
        self._last_ns = now_ns

    # ---- chunk loop ----

    def _other_state(self, h: _Half, st: int, data: bytes, pos: int, chunk: Chunk) -> int:
        if st == _CHUNK_SIZE:
            return self._chunk_size(h, data, pos, chunk)
        if st == _CHUNK_CR or st == _CHUNK_LF:
            return self._chunk_crlf(h, data, pos, chunk)
        if st == _TRAILER:
            return self._trailer(h, data, pos, chunk)
        if st == _CLOSE:
            self._body(h, len(data) - pos, chunk, data[pos:])
            return len(data)
        if st == _LOST:
            return self._lost(h, data, pos, chunk)
        if st == _RESYNC:
            return self._resync(h, data, pos, chunk)
        if st == _TLS:
            return self._tls(h, data, pos)
        return len(data)  # _IGNORE

    def _is_tls(self, h: _Half, data: bytes) -> bool:
        probe = h.buf + data[:2] if h.buf else data[:2]
        if len(probe) < 2 and probe[0] in _TLS_RECORD_TYPES:
            return False  # one byte that could open a record: decide on the next chunk
        h.fresh = False
        if probe[0] in _TLS_RECORD_TYPES and probe[1] == 0x03:
            # TLS-looking: skip this half's bytes, but a plaintext client that merely began
            # with 16 03 is parsed again from its next chunk that begins with a start line
            if all(x.state != _TLS for x in self._halves):
                self.stats.tls_streams += 1  # once a connection
            h.buf = b""
            h.state = _TLS
            return True
        return False

    def _tls(self, h: _Half, data: bytes, pos: int) -> int:
        if pos == 0 and _could_start(data[:8]) and \
                _find_start(data[: self._max_header_bytes + 4], h.kind, True, 0) == 0:
            self.stats.tls_false_alarms += 1
            h.state = _HEAD
            return 0
        return len(data)

    # ---- heads ----

    def _head(self, h: _Half, data: bytes, pos: int, chunk: Chunk, e: int) -> int:
        """The fast path did not take this head: blank lines, a bad head, or a head
        that continues in later chunks."""
        if data[pos] in (10, 13):  # empty lines before a message are allowed
            return _skip_blank(data, pos)
        if 0 <= e - pos <= self._max_header_bytes:
            return self._bad_head(h, b"", pos)
        h.head_enter = chunk.ts_enter_ns
        h.head_exit = chunk.ts_exit_ns
        self._head_marks(h)
        h.line_checked = False
        return self._head_slow(h, data, pos, chunk)

    def _head_slow(self, h: _Half, data: bytes, pos: int, chunk: Chunk) -> int:
        """The header block spans chunks: accumulate it (bounded) in h.buf."""
        old = h.buf
        k = len(old)
        limit = self._max_header_bytes + 4
        joined = old + data[pos : pos + limit - k]
        if not h.line_checked:
            nl = joined.find(b"\n")
            if nl >= 0:
                if not _plausible_line(joined[:nl], h.kind):
                    return self._bad_head(h, old, pos)
                h.line_checked = True
        e = joined.find(b"\r\n\r\n", max(0, k - 3))
        if e >= 0:
            h.buf = b""
            if self._message(h, joined[:e], h.head_enter, h.head_exit, chunk):
                return pos + e + 4 - k
            return self._bad_head(h, old, pos)
        if len(joined) >= limit:  # oversize header block
            return self._bad_head(h, old, pos)
        h.buf = joined
        return len(data)

    def _bad_head(self, h: _Half, old: bytes, pos: int) -> int:
        """A head that does not parse: resync from its second byte."""
        self.stats.malformed += 1
        h.state = _RESYNC
        h.sol = False
        if old:
            h.buf = old[1:]
            self.stats.dropped_bytes += 1
            return pos
        h.buf = b""
        self.stats.dropped_bytes += 1
        return pos + 1

    def _message(self, h: _Half, block: bytes, t_enter: int, t_exit: int, chunk: Chunk,
                 cut: bool = False) -> bool:
        """Parse a header block (without its final CRLFCRLF); False if it is not one."""
        kind = h.kind
        if kind == _REQ or (kind == _ANY and not block.startswith(b"HTTP/")):
            return self._request(h, block, t_exit, chunk, cut)
        return self._response(h, block, t_enter, chunk, cut)

    def _request(self, h: _Half, block: bytes, t_exit: int, chunk: Chunk,
                 cut: bool = False) -> bool:
        lines = block.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return False
        method, target, version = parts
        if method not in KNOWN_METHODS and _TOKEN.fullmatch(method) is None:
            return False
        if len(version) != 8 or not version.startswith("HTTP/1.") or not target:
            return False
        if h.kind == _ANY:
            self._decide(h, _REQ)
        fields, d = _fields(lines, self._max_headers)
        h.msgs += 1
        req = RequestHead(method, target, version[5:], fields, t_exit, chunk.ts_exit_ns)
        p = _Pending(req)
        if t_exit == self._mts:  # the head began in the read or write just seen
            p.rq_t0, p.rq_u0, p.rq_sw0 = self._mtid, self._mu, self._msw
        elif t_exit == h.head_exit:  # in an earlier one
            p.rq_t0, p.rq_u0, p.rq_sw0 = h.head_tid, h.head_u, h.head_sw
        self._order.append(p)
        self._awaiting.append(p)
        if cut:
            p.req_done = True
            return True
        if "transfer-encoding" in d:
            if _is_chunked(d["transfer-encoding"]):
                return self._start_body(h, _CHUNK_SIZE, 0, req, p)
            return self._bad_request(h, p)
        cl = d.get("content-length")
        if cl is not None:
            n = _content_length(cl)
            if n > 0:
                return self._start_body(h, _LENGTH, n, req, p)
            if n < 0:
                return self._bad_request(h, p)
        p.req_done = True
        return True

    def _response(self, h: _Half, block: bytes, t_enter: int, chunk: Chunk,
                  cut: bool = False) -> bool:
        lines = block.decode("latin-1").split("\r\n")
        first = lines[0]
        code = first[9:12]
        if (  # "HTTP/1.x NNN[ reason]"; latin-1 text, so isdecimal() means ASCII digits
            first[:7] != "HTTP/1." or first[8:9] != " " or len(code) != 3
            or not code.isdecimal() or first[12:13] not in ("", " ")
            or not first[7].isdecimal() or code[0] == "0"
        ):
            return False
        status = int(code)
        if h.kind == _ANY:
            self._decide(h, _RESP)
        if status < 200 and status != 101:
            return True  # 100 Continue, 103 Early Hints...: the final response follows
        fields, d = _fields(lines, self._max_headers)
        resp = ResponseHead(status, first[5:8], fields, t_enter, chunk.ts_exit_ns)
        p = self._awaiting.popleft() if self._awaiting else None
        if p is None:
            self.stats.orphan_responses += 1
            method = "GET"
        else:
            p.response = resp
            method = p.request.method
            h.tap = is_model_route(p.request.target)
        h.resp = resp
        h.pending = p
        h.body_feed = 0
        if cut:
            return self._fail_response(h, chunk, ERR_INCOMPLETE)
        if method == "HEAD" or status == 204 or status == 304 or status == 101:
            return self._response_nobody(h, status, method, chunk)
        if method == "CONNECT" and status < 300:
            return self._response_nobody(h, status, method, chunk)
        ctype = d.get("content-type")
        if ctype is not None and ctype[:17].lower() == "text/event-stream":
            resp.streamed = True
            resp.sse = True
        cl = d.get("content-length")
        if cl is not None and "transfer-encoding" not in d:
            n = _content_length(cl)
            if n > 0:
                h.state = _LENGTH
                h.remaining = n
            elif n == 0:
                self._complete(h, chunk)
            else:
                self._fail_response(h, chunk, ERR_BAD_RESPONSE)
            return True
        resp.streamed = True
        te = d.get("transfer-encoding")
        h.state = _CHUNK_SIZE if te is not None and _is_chunked(te) else _CLOSE
        return True

    def _response_nobody(self, h: _Half, status: int, method: str, chunk: Chunk) -> bool:
        self._complete(h, chunk)
        if status == 101 or method == "CONNECT":  # now another protocol, or a tunnel
            for half in self._halves:
                half.state = _IGNORE
        return True

    def _start_body(self, h: _Half, state: int, n: int, req: RequestHead, p: _Pending) -> bool:
        h.state = state
        h.remaining = n
        h.req = req
        h.pending = p
        h.tap = is_model_route(req.target)
        return True

    def _bad_request(self, h: _Half, p: _Pending) -> bool:
        """Unusable framing: keep the request for pairing, then resync."""
        self.stats.malformed += 1
        p.req_done = True
        p.error = ERR_BAD_REQUEST
        h.clear_message()
        h.state = _RESYNC
        h.sol = True
        return True

    def _fail_response(self, h: _Half, chunk: Chunk, error: str) -> bool:
        """Complete the current response with `error`, then resync the half."""
        if error == ERR_BAD_RESPONSE:
            self.stats.malformed += 1
        self._end_with(h, chunk, error)
        h.state = _RESYNC
        h.sol = True
        return True

    def _end_with(self, h: _Half, chunk: Chunk, error: str) -> None:
        p = h.pending
        if p is not None and p.error is None:
            p.error = error
        self._complete(h, chunk)

    def _decide(self, h: _Half, kind: int) -> None:
        """Role.UNKNOWN: the first start line tells which direction carries requests."""
        other = self._out if h is self._in else self._in
        h.kind = kind
        other.kind = _RESP if kind == _REQ else _REQ
        role = Role.SERVER if (h is self._in) == (kind == _REQ) else Role.CLIENT
        self._conn = dataclasses.replace(self.conn, role=role)

    # ---- bodies ----

    def _body(self, h: _Half, n: int, chunk: Chunk, data: bytes = b"") -> None:
        """`n` body bytes moved; `data` is the captured part of them (may be shorter)."""
        r = h.resp
        if r is not None:
            r.body_bytes += n
            r.end_ns = chunk.ts_exit_ns
            if h.body_feed != h.feeds:
                h.body_feed = h.feeds
                r.body_chunks += 1
                if r.sse and r.first_token_ns is None and not is_preamble(data):
                    r.first_token_ns = chunk.ts_enter_ns
                if r.first_body_ns is None:
                    r.first_body_ns = chunk.ts_enter_ns
                elif r.last_body_ns is not None:
                    r.max_gap_ns = max(r.max_gap_ns, chunk.ts_enter_ns - r.last_body_ns)
            r.last_body_ns = chunk.ts_exit_ns
            if data and (r.sse or h.tap):
                _tap_response(r, data, h.tap)
            return
        q = h.req
        if q is not None:
            q.body_bytes += n
            q.end_ns = chunk.ts_exit_ns
            if data and h.tap:
                _tap_request(q, data)
            elif n and h.tap:
                q.body_tail = b""  # bytes not seen: the tail starts again after them

    def _chunk_size(self, h: _Half, data: bytes, pos: int, chunk: Chunk) -> int:
        nl = data.find(b"\n", pos)
        if nl < 0:
            h.buf += data[pos:]
            if len(h.buf) > _MAX_CHUNK_LINE:
                h.buf = b""
                return self._bad_chunk(h, chunk, len(data))
            return len(data)
        old = h.buf
        line = old + data[pos:nl] if old else data[pos:nl]
        size = _chunk_len(line)
        h.buf = b""
        if size < 0:
            return self._bad_chunk(h, chunk, pos, old, True)
        if size:
            h.state = _CHUNK_DATA
            h.remaining = size
        else:
            h.state = _TRAILER
            h.remaining = 0
        return nl + 1

    def _chunk_crlf(self, h: _Half, data: bytes, pos: int, chunk: Chunk) -> int:
        c = data[pos]
        if c == 10:
            h.state = _CHUNK_SIZE
            return pos + 1
        if c == 13 and h.state == _CHUNK_CR:
            h.state = _CHUNK_LF
            return pos + 1
        return self._bad_chunk(h, chunk, pos)

    def _trailer(self, h: _Half, data: bytes, pos: int, chunk: Chunk) -> int:
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                h.buf += data[pos:]
                if len(h.buf) + h.remaining > self._max_header_bytes:
                    h.buf = b""
                    return self._bad_chunk(h, chunk, len(data))
                return len(data)
            old = h.buf
            line = old + data[pos:nl] if old else data[pos:nl]
            h.buf = b""
            pos = nl + 1
            if not line or line == b"\r":
                self._complete(h, chunk)
                return pos
            h.remaining += len(line)  # trailer fields are not kept, only bounded
            if h.remaining > self._max_header_bytes:
                return self._bad_chunk(h, chunk, pos, b"", True)

    def _bad_chunk(self, h: _Half, chunk: Chunk, pos: int, keep: bytes = b"",
                   sol: bool = False) -> int:
        """Bad chunked framing: end the message with an error and resync at `pos`
        (with `keep`, the start of the bad line, which may be the next start line)."""
        self.stats.malformed += 1
        self._end_with(h, chunk, ERR_BAD_RESPONSE if h.resp is not None else ERR_BAD_REQUEST)
        h.state = _RESYNC
        h.buf = keep
        h.sol = sol
        return pos

    def _lost(self, h: _Half, data: bytes, pos: int, chunk: Chunk) -> int:
        """Chunked framing was lost in uncaptured bytes. Count what follows as body
        until a write visibly ends the body or starts the next message."""
        if pos == 0 and _find_start(data[: self._max_header_bytes], h.kind, True, 0) == 0:
            self._end_lost(h, chunk)
            return 0
        self._body(h, len(data) - pos, chunk, data[pos:])
        if data.endswith(b"0\r\n\r\n"):
            self._complete(h, chunk)
        return len(data)

    def _end_lost(self, h: _Half, chunk: Chunk) -> None:
        p = h.pending
        if h.resp is not None:
            if p is not None and p.error is None:
                p.error = ERR_INCOMPLETE
            end = h.resp.end_ns
            self._complete(h, chunk)
            if p is not None and p.response is not None:
                p.response.end_ns = end
        else:
            if p is not None:
                p.req_done = True
            h.clear_message()
            self._emit_ready()

    def _uncaptured(self, h: _Half, extra: int, chunk: Chunk) -> None:
        """Bytes that moved without being captured: body bytes where a body is open."""
        self.stats.uncaptured_bytes += extra
        st = h.state
        if st == _LENGTH or st == _CHUNK_DATA:
            take = min(extra, h.remaining)
            h.remaining -= take
            extra -= take
            self._body(h, take, chunk)
            if h.remaining:
                return
            if st == _LENGTH:
                self._complete(h, chunk)
                if extra:
                    self._lose_sync(h, extra)
            else:
                self._after_chunk_data(h, extra, chunk)
        elif st == _CLOSE or st == _LOST:
            self._body(h, extra, chunk)
        elif st == _RESYNC:
            self.stats.dropped_bytes += extra
            h.buf = b""
            h.sol = False
        elif st == _HEAD:
            self._count_uncaptured_requests(h, len(chunk.data), extra)
            if h.buf:
                self._cut_head(h, chunk)
            else:
                self._lose_sync(h, extra)
        elif st == _TRAILER and extra <= 2 and not h.buf:
            self._complete(h, chunk)
        elif st != _IGNORE and st != _TLS:  # chunk-size line, CRLF or trailer not captured
            h.buf = b""
            h.state = _LOST

    def _count_uncaptured_requests(self, h: _Half, captured: int, extra: int) -> None:
        """Requests that began in bytes past the capture limit of one read (a pipelined burst)
        are not traced: count them, estimated from the requests that fit in the captured part
        (at least one when a request began there, none for the rest of a cut head)."""
        if h.kind == _RESP:
            return
        if h.msgs:
            self.stats.requests_uncaptured += max(1, round(extra * h.msgs / max(captured, 1)))
        elif not h.buf:
            self.stats.requests_uncaptured += 1

    def _after_chunk_data(self, h: _Half, extra: int, chunk: Chunk) -> None:
        if extra == 0:
            h.state = _CHUNK_CR
        elif extra == 1:
            h.state = _CHUNK_LF
        elif extra == 2:
            h.state = _CHUNK_SIZE
        else:  # more chunks inside the uncaptured bytes: their sizes are unknown
            h.state = _LOST
            self._body(h, extra - 2, chunk)

    def _lose_sync(self, h: _Half, extra: int) -> None:
        """A message began inside uncaptured bytes: it cannot be parsed."""
        self.stats.malformed += 1
        self.stats.dropped_bytes += extra
        h.state = _RESYNC
        h.buf = b""
        h.sol = False

    def _cut_head(self, h: _Half, chunk: Chunk) -> None:
        """The capture limit cut a header block: keep what pairs, resync the rest."""
        self.stats.malformed += 1
        block = h.buf
        h.buf = b""
        last = block.rfind(b"\r\n")
        if last > 0:
            self._message(h, block[:last], h.head_enter, h.head_exit, chunk, cut=True)
        if h.state != _IGNORE:
            h.clear_message()
            h.state = _RESYNC
            h.sol = False

    # ---- resync ----

    def _resync(self, h: _Half, data: bytes, pos: int, chunk: Chunk) -> int:
        old = h.buf
        k = len(old)
        region = old + data[pos:] if old else data[pos:]
        boundary = k if pos == 0 else -1  # a chunk boundary may start a message
        idx = _find_start(region, h.kind, h.sol, boundary)
        if idx >= 0:
            self.stats.resyncs += 1
            self.stats.dropped_bytes += idx
            h.state = _HEAD
            h.line_checked = True
            if idx < k:
                h.buf = old[idx:]
                return pos
            h.buf = b""
            return pos + idx - k
        self._keep_tail(h, region, boundary, chunk)
        return len(data)

    def _keep_tail(self, h: _Half, region: bytes, boundary: int, chunk: Chunk) -> None:
        """Keep the bytes from the last line start on when they could begin a start
        line that continues in the next chunk; drop the rest."""
        k = len(h.buf)
        end = len(region)
        start = end
        nl = region.rfind(b"\n") + 1
        if nl or h.sol:
            start = nl
        if boundary >= nl and (start == end or not _could_start(region[start : start + 8])):
            start = boundary
        if end - start > self._max_header_bytes or not _could_start(region[start : start + 8]):
            start = end
        self.stats.dropped_bytes += start
        h.buf = region[start:]
        h.sol = bool(h.buf)
        if start >= k:
            h.head_enter = chunk.ts_enter_ns
            h.head_exit = chunk.ts_exit_ns
            self._head_marks(h)

    # ---- completion ----

    def _complete(self, h: _Half, chunk: Chunk) -> None:
        p = h.pending
        r = h.resp
        if r is not None:
            r.end_ns = chunk.ts_exit_ns
            if p is not None:
                p.resp_done = True
                p.rq_t1, p.rq_u1, p.rq_sw1, p.rq_ts1 = self._mtid, self._mu, self._msw, self._mts
        else:
            q = h.req
            if q is not None:
                q.end_ns = chunk.ts_exit_ns
            if p is not None:
                p.req_done = True
        h.state = _HEAD
        h.req = h.resp = h.pending = None
        h.body_feed = 0
        h.tap = False
        if p is not None and p.req_done and p.resp_done:
            self._emit_ready()

    def _emit_ready(self) -> None:
        order = self._order
        while order:
            p = order[0]
            if not (p.req_done and p.resp_done):
                return
            order.popleft()
            self.stats.exchanges += 1
            self._emitted += 1
            try:
                self._emit(self._exchange(p))
            except Exception:  # noqa: BLE001 - the consumer's bug must not corrupt our state
                self.stats.internal_errors += 1
        log = self._swlog
        if log:  # no exchange in flight: no one needs the switches so far (a thread pool's
            self._swbase += len(log)  # connections keep none between requests)
            log.clear()

    def _exchange(self, p: _Pending) -> Exchange:
        ex = Exchange(self._conn, p.request, p.response, p.error)
        t0 = p.rq_t0
        if not t0:
            return ex  # the request's first read or write was not seen (or not with a thread)
        r = p.response
        if p.rq_t1 and r is not None:  # the response ended at a read or write seen
            t1, u1, sw1, ts1 = p.rq_t1, p.rq_u1, p.rq_sw1, p.rq_ts1
        elif self._mts <= (r.end_ns if r is not None else p.request.end_ns):
            t1, u1, sw1, ts1 = self._mtid, self._mu, self._msw, self._mts  # the last one seen
        else:
            t1, u1, sw1, ts1 = t0, p.rq_u0, p.rq_sw0, 0  # no later mark inside the exchange
        ex.runq_tid0 = t0
        ex.runq0 = p.rq_u0
        ex.runq_tid1 = t1
        ex.runq1 = u1
        ex.runq_ends = r is not None and ts1 == r.end_ns
        sw0 = p.rq_sw0
        if sw1 != sw0:
            base = self._swbase
            ex.runq_switches = self._swlog[max(sw0 - base, 0):max(sw1 - base, 0)]
            if sw0 < base:  # switches forgotten: not all of the threads are known
                ex.runq_ends = False
        return ex

    def _switch(self, tid: int, runq_us: int) -> None:
        """The connection's reads and writes went from thread _mtid to `tid`."""
        log = self._swlog
        log.append((self._mtid, self._mu, tid, runq_us))
        self._msw += 1
        if len(log) > _SWITCHES_KEPT:
            drop = len(log) // 2
            del log[:drop]
            self._swbase += drop

    def _head_marks(self, h: _Half) -> None:
        """The buffered head began in the chunk being fed: keep its marks (none when that
        chunk had no thread: the marks are an older chunk's)."""
        if self._mts == h.head_exit:
            h.head_tid, h.head_u, h.head_sw = self._mtid, self._mu, self._msw
        else:
            h.head_tid = 0

    def _abandon(self, h: _Half, cut: str = ERR_INCOMPLETE) -> None:
        """Stop the half's current message where it stands; a response stopped before its
        end gets the error `cut`."""
        p = h.pending
        if h.resp is not None:
            if p is not None:
                # a client that stops reading after an OpenAI-style `data: [DONE]` (the
                # openai SDK closes before the chunked terminator) got the whole stream
                if h.state != _CLOSE and p.error is None and not h.resp.sse_done:
                    p.error = cut
                p.resp_done = True
        elif p is not None:
            p.req_done = True
        if h.buf:
            self.stats.dropped_bytes += len(h.buf)
            h.buf = b""
        st = h.state
        h.clear_message()
        if st == _IGNORE or st == _TLS:
            h.state = st

    def _recover(self) -> None:
        try:
            for h in self._halves:
                self._abandon(h)
                if h.state not in (_IGNORE, _TLS):
                    h.state = _RESYNC
            self._emit_ready()
        except Exception:  # noqa: BLE001 - never raise into the pipeline
            self.stats.internal_errors += 1

    def _finish(self, error: str, cut: str = ERR_INCOMPLETE) -> None:
        try:
            for h in self._halves:
                self._abandon(h, cut)
            for p in self._order:
                p.req_done = True
                p.resp_done = True
                if p.response is None and p.error is None:
                    p.error = error
            self._awaiting.clear()
            self._emit_ready()
        except Exception:  # noqa: BLE001 - never raise into the pipeline
            self.stats.internal_errors += 1


# ---- helpers (pure) ----


# header lines seen before, as parsed: most lines repeat from message to message (Host,
# User-Agent, Server, Content-Type...), so a message's fields are mostly one dict lookup per
# line done in C. Lines that may carry a credential, and per-request identity, are never
# kept (the parser holds those only while their message is parsed); the cache empties
# itself when full.
_FIELD_CACHE: dict[str, tuple[str, str]] = {}
_FIELD_CACHE_MAX = 4096
_FIELD_CACHE_LINE = 256
_UNCACHED_NAMES = REDACTED_HEADERS | IDENTITY_HEADERS
_SECRET_WORDS = ("auth", "key", "token", "secret", "cookie", "session", "passw", "signature",
                 "credential")


def _field(line: str) -> tuple[str, str] | None:
    """(lower-cased name, stripped value) of a header line, None without a colon."""
    name, sep, value = line.partition(":")
    if not sep:
        return None
    name = name.lower()
    f = (name, value.strip())
    if len(line) <= _FIELD_CACHE_LINE and name not in _UNCACHED_NAMES \
            and not any(w in name for w in _SECRET_WORDS):
        if len(_FIELD_CACHE) >= _FIELD_CACHE_MAX:
            _FIELD_CACHE.clear()
        _FIELD_CACHE[line] = f
    return f


def _fields(lines: list[str], max_headers: int) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Header fields after the start line (names lower-cased, values stripped, secrets
    redacted), cut to max_headers, and a lookup dict over all of them."""
    fields: list[tuple[str, str]] = []
    d: dict[str, str] = {}
    cache = _FIELD_CACHE
    for i in range(1, len(lines)):  # one pass: cached lines are a dict lookup each
        line = lines[i]
        f = cache.get(line)
        if f is None:
            f = _field(line)
            if f is None:  # a line without a colon: obs-fold or junk
                fields = _fields_slow(lines)
                d = dict(fields)
                break
        fields.append(f)
        d[f[0]] = f[1]
    if not REDACTED_HEADERS.isdisjoint(d):
        fields = [(k, REDACTED) if k in REDACTED_HEADERS else (k, v) for k, v in fields]
    n = len(fields)
    if len(d) != n:
        _check_duplicate_length(fields, d)
    if n > max_headers:
        keep = [f for f in islice(fields, max_headers, None) if f[0] in IDENTITY_HEADERS]
        del fields[max_headers:]
        fields.extend(keep)
    return fields, d


def _fields_slow(lines: list[str]) -> list[tuple[str, str]]:
    """Fields where some lines have no colon: join obsolete line folding (a line that
    starts with whitespace continues the previous value), drop other such lines."""
    fields: list[tuple[str, str]] = []
    for line in islice(lines, 1, None):
        if line[:1] in (" ", "\t") and fields:
            name, value = fields[-1]
            fields[-1] = (name, f"{value} {line.strip()}".strip())
            continue
        name, sep, value = line.partition(":")
        if sep:
            fields.append((name.lower(), value.strip()))
    return fields


def _kinds(role: Role) -> tuple[int, int]:
    if role == Role.SERVER:
        return _REQ, _RESP
    if role == Role.CLIENT:
        return _RESP, _REQ
    return _ANY, _ANY


def _skip_blank(data: bytes, pos: int) -> int:
    end = len(data)
    while pos < end and data[pos] in (10, 13):
        pos += 1
    return pos


def _status_line(first: str) -> int:
    """Status code of "HTTP/1.x NNN reason", or -1 (`first` is latin-1 text, so
    isdecimal() means ASCII digits)."""
    code = first[9:12]
    if (
        first[:7] != "HTTP/1." or first[8:9] != " " or not code.isdecimal() or len(code) != 3
        or not first[7].isdecimal() or first[12:13] not in ("", " ") or code[0] == "0"
    ):
        return -1
    return int(code)


def _request_line_ok(first: str) -> bool:
    parts = first.split(" ")
    if len(parts) != 3:
        return False
    method, target, version = parts
    if method not in KNOWN_METHODS and _TOKEN.fullmatch(method) is None:
        return False
    return bool(target) and len(version) == 8 and version.startswith("HTTP/1.")


def _plausible_line(line: bytes, kind: int) -> bool:
    """Could `line` (without its LF) be the start line of a message of `kind`?"""
    first = line.decode("latin-1").rstrip("\r")
    if kind != _REQ and _status_line(first) >= 0:
        return True
    return kind != _RESP and _request_line_ok(first)


def _content_length(value: str) -> int:
    """Content-Length as an int, -1 when invalid (identical comma-separated copies allowed)."""
    if value.isdecimal() and value.isascii() and len(value) <= 18:
        return int(value)
    if "," in value:
        copies = {v.strip() for v in value.split(",")}
        if len(copies) == 1:
            return _content_length(copies.pop())
    return -1


def _check_duplicate_length(fields: list[tuple[str, str]], d: dict[str, str]) -> None:
    """Repeated Content-Length fields must agree; mark the length invalid otherwise."""
    lengths = {v for k, v in fields if k == "content-length"}
    if len(lengths) > 1:
        d["content-length"] = "invalid"


def _is_chunked(te: str) -> bool:
    return te.rpartition(",")[2].strip().lower() == "chunked"


def _chunk_len(line: bytes) -> int:
    """Size from a chunk-size line (extensions allowed), -1 when invalid."""
    size = line.partition(b";")[0].strip()
    if not size or len(size) > 15 or size.strip(_HEX):
        return -1
    return int(size, 16)


def _find_start(region: bytes, kind: int, sol: bool, boundary: int) -> int:
    """Offset of the first plausible start line in `region`, or -1.

    A start line must begin at a line start: after an LF, at offset 0 when `sol`, or at
    `boundary` (where a new chunk began). Requests need a known method and a complete
    line; responses need "HTTP/1.x NNN" and one more byte.
    """
    i = region.find(b"HTTP/1.")
    while i >= 0:
        at_line_start = i == boundary or (i == 0 and sol) or (i > 0 and region[i - 1] == 10)
        if kind != _REQ and at_line_start and _status_at(region, i):
            return i
        if kind != _RESP:
            ls = region.rfind(b"\n", 0, i) + 1
            if (ls > 0 or sol or ls == boundary) and _request_at(region, ls, i):
                return ls
            if ls < boundary < i and _request_at(region, boundary, i):
                return boundary
        i = region.find(b"HTTP/1.", i + 1)
    return -1


_START_PREFIXES = tuple(m.encode() + b" " for m in sorted(KNOWN_METHODS)) + (b"HTTP/1.",)


def _could_start(seg: bytes) -> bool:
    """Could a start line begin with `seg` (its first bytes, maybe fewer)?"""
    for prefix in _START_PREFIXES:
        n = min(len(prefix), len(seg))
        if n and seg[:n] == prefix[:n]:
            return True
    return False


def _status_at(region: bytes, i: int) -> bool:
    s = region[i : i + 13]
    return (
        len(s) == 13 and 48 <= s[7] <= 57 and s[8] == 32 and s[9:12].isdigit()
        and s[12] in (32, 13)
    )


def _request_at(region: bytes, start: int, i: int) -> bool:
    """Is region[start:] "METHOD SP target SP HTTP/1.x CRLF" with HTTP/1. at i?"""
    tail = region[i + 7 : i + 10]
    if len(tail) != 3 or not 48 <= tail[0] <= 57 or tail[1:] != b"\r\n":
        return False
    line = region[start:i]
    if not line.endswith(b" "):
        return False
    parts = line[:-1].split(b" ")
    return len(parts) == 2 and parts[0] in _KNOWN_METHODS_B and bool(parts[1])


# ---- bounded body taps: what GenAI attributes need, never the text itself ----

TAP_BYTES = 2048  # head and tail kept per message of a model-serving route
# paths whose bodies carry model, token counts and usage (OpenAI-compatible servers: vLLM,
# SGLang, TGI's /v1, llama.cpp; Ollama's /api/generate and /api/chat; TGI's /generate)
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/generate",
                "/api/chat", "/generate", "/generate_stream", "/v1/responses")


def is_model_route(target: str) -> bool:
    q = target.find("?")  # not split(): a list and a string per call, twice a span
    return (target if q < 0 else target[:q]).endswith(MODEL_ROUTES)


# an OpenAI-style chat stream's first event, sent before any token: the assistant's role
# and no text (vLLM, SGLang, the openai reference). Not a token: time to first token skips it.
_ROLE_ONLY = re.compile(
    rb'"delta"\s*:\s*\{\s*(?:"role"\s*:\s*"[a-z]{1,20}"\s*'
    rb'(?:,\s*"content"\s*:\s*(?:""|null)\s*)?)?\}')
_TEXT = re.compile(rb'"(?:content|text|reasoning_content)"\s*:\s*"[^"]')


def is_preamble(event: bytes) -> bool:
    """An SSE write that carries no output yet: a role-only (or empty) chat delta."""
    return _ROLE_ONLY.search(event) is not None and _TEXT.search(event) is None


def _unframe(write: bytes) -> bytes:
    """The chunk data of a captured write that began with a chunk-size line (framing and
    a trailing terminator dropped); other writes as they are."""
    nl = write.find(b"\r\n", 0, 18)
    size = _chunk_len(write[:nl]) if nl > 0 else -1
    if size < 0:
        return write
    return write[nl + 2:nl + 2 + size]


def _tap_request(q: RequestHead, data: bytes) -> None:
    if len(q.body_head) < TAP_BYTES:
        q.body_head += data[: TAP_BYTES - len(q.body_head)]
    q.body_tail = (q.body_tail + data)[-TAP_BYTES:]


def _tap_response(r: ResponseHead, data: bytes, keep: bool) -> None:
    if r.sse:
        # `data:` lines; one split across two writes is counted in the second (carry)
        seen = r.body_tail[-6:] + data
        r.sse_events += seen.count(b"\ndata:") + (1 if seen.startswith(b"data:") else 0) \
            - r.body_tail[-6:].count(b"\ndata:")
        if b"data: [DONE]" in seen:
            r.sse_done = True
    if keep or r.sse:
        r.body_tail = (r.body_tail + data)[-TAP_BYTES:]

