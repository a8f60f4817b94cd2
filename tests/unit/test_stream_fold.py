"""Streamed responses folded in the kernel (bpf/stream.h) give the spans per-write records give.

`fold` restates the kernel's rules over recorded writes (the head write goes out as is; from
the first later write that begins with a chunk-size line, writes are folded until one ends with
the chunked terminator or the next request is read). Every test feeds the same writes both ways,
through the real parser and span builder, and compares the spans' attributes.
The kernel side of the same rules runs in tests/integration/test_stream_fold.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

import pytest
from sits_trace.agent.capture import events as ev
from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role, StreamChunk
from sits_trace.agent.tracing.http1 import HttpConnParser, ParserStats
from sits_trace.agent.tracing.spans import SpanBuilder

MS = 1_000_000
T0 = 5_000 * MS
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "http"
_CHUNK_LINE = re.compile(rb"([0-9a-fA-F]{1,9})\r\n")
TERMINATOR = b"0\r\n\r\n"
IN, OUT = Direction.INGRESS, Direction.EGRESS

Record: TypeAlias = Chunk | StreamChunk


@dataclass
class _Fold:
    writes: int = 0
    events: int = 0
    first: int = 0
    last: int = 0
    gap: int = 0
    body: int = 0
    wire: int = 0
    tails: list[bytes] = field(default_factory=lambda: [b"", b""])
    head: bytes = b""
    second: int = 0

    def summary(self, complete: bool, end_ns: int = 0) -> StreamChunk:
        return StreamChunk(OUT, self.writes, self.events, self.first, self.last, self.gap,
                           self.body, self.wire, end_ns, complete,
                           (self.tails[-2], self.tails[-1]), self.head, self.second)

    def add(self, c: Chunk, term: bool, tail: int) -> None:
        if self.writes == 0:
            self.first = c.ts_enter_ns
            self.head = c.data[:ev.STREAM_HEAD]
        else:
            if self.writes == 1:
                self.second = c.ts_enter_ns
            self.gap = max(self.gap, c.ts_enter_ns - self.last)
        self.writes += 1
        self.last = c.ts_exit_ns
        self.wire += len(c.data)
        m = _CHUNK_LINE.match(c.data[:16])
        assert m is not None  # whole() said so
        self.body += int(m.group(1), 16)
        self.events += c.data[m.end():m.end() + 5] == b"data:"
        self.tails.append(c.data[:tail])


def whole(data: bytes) -> bool:
    """A write the kernel folds: the terminator alone, or one whole chunk (the terminator
    may follow it)."""
    term = data.endswith(TERMINATOR)
    if term and len(data) == 5:
        return True
    m = _CHUNK_LINE.match(data[:16])
    return m is not None and m.end() + int(m.group(1), 16) + 2 + (5 if term else 0) == len(data)


def fold(chunks: list[Chunk], tail: int = ev.STREAM_TAIL) -> list[Record]:
    """What the kernel sends for a server connection's writes (stream.h, restated)."""
    out: list[Record] = []
    agg: _Fold | None = None
    last_dir: Direction | None = None
    for c in chunks:
        first = c.direction != last_dir
        last_dir = c.direction
        if c.direction == IN or first or len(c.data) < 5:
            if agg is not None:  # a read: the next request; a head or iovec write: a flush
                out.append(agg.summary(c.direction == IN))
                agg = None
            out.append(c)
            continue
        if not whole(c.data):  # merged or split chunks: a record, after what was folded
            if agg is not None:
                if agg.writes:
                    out.append(agg.summary(False))
                agg = None
            out.append(c)
            continue
        if agg is None:
            if _CHUNK_LINE.match(c.data[:16]) is None:
                out.append(c)
                continue
            agg = _Fold()
        term = c.data.endswith(TERMINATOR)
        if not (term and len(c.data) == 5):
            agg.add(c, term, tail)
        if term:
            out.append(agg.summary(True, c.ts_exit_ns))
            agg = None
    if agg is not None:
        out.append(agg.summary(False))
    return out


def _conn() -> ConnInfo:
    return ConnInfo(conn_id=1, pid=7, fd=9, role=Role.SERVER, peer_address="127.0.0.1",
                    peer_port=5555, local_address="127.0.0.1", local_port=8000, comm="python3")


def _parse(records: list[Record], close_ns: int | None = None) -> tuple[list[Exchange], ParserStats]:
    out: list[Exchange] = []
    stats = ParserStats()
    p = HttpConnParser(_conn(), out.append, stats=stats)
    for r in records:
        if isinstance(r, StreamChunk):
            p.feed_stream(r)
        else:
            p.feed(r)
    if close_ns is not None:
        p.close(close_ns)
    return out, stats


def _attrs(exchanges: list[Exchange]) -> list[dict[str, object]]:
    b = SpanBuilder(clock_offset_ns=0, id_source=lambda n: b"\x01" * n)
    return [dict(b.build(x).attributes) | {"_error": x.error} for x in exchanges]


def _request(model: str = "llama-3-8b") -> bytes:
    body = json.dumps({"model": model, "max_tokens": 500, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}],
                       "stream_options": {"include_usage": True}}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def openai_stream(n: int, gap_ms: float = 20.0, jitter: int = 7, t: int = T0,
                  done: bool = True, terminator: str = "apart", role: bool = False,
                  merge: int = 1) -> list[Chunk]:
    """A server's writes for one streamed chat completion of `n` tokens: the request read,
    the head, (`role`: the role-only first event vLLM sends before any token), one event per
    write (`merge`: that many chunks a write, as a runtime that corks writes), the usage
    event, `data: [DONE]`, the terminator."""
    req = _request()
    out = [Chunk(IN, t, t + 2000, req, len(req))]
    t += 30 * MS
    out.append(Chunk(OUT, t, t + 1500, HEAD, len(HEAD)))
    events = [b"data: " + json.dumps({"id": "c1", "model": "llama-3-8b", "choices": [
        {"index": 0, "delta": {"content": f" tok{i}"}}]}).encode() + b"\n\n" for i in range(n)]
    if role:
        events.insert(0, b"data: " + json.dumps({"id": "c1", "model": "llama-3-8b", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}).encode() + b"\n\n")
    events.append(b"data: " + json.dumps({"id": "c1", "model": "llama-3-8b", "choices": [],
                                          "usage": {"prompt_tokens": 17, "completion_tokens": n,
                                                    "total_tokens": 17 + n}}).encode() + b"\n\n")
    if done:
        events.append(b"data: [DONE]\n\n")
    writes = [b"".join(_chunked(e) for e in events[i:i + merge])
              for i in range(0, len(events), merge)]
    for i, w in enumerate(writes):
        t += int(gap_ms * MS) + (i * 7919 % (jitter * 100_000 + 1))
        if terminator == "joined" and i == len(writes) - 1:
            w += TERMINATOR
        out.append(Chunk(OUT, t, t + 900 + i % 5, w, len(w)))
    if terminator == "apart":
        t += 50_000
        out.append(Chunk(OUT, t, t + 700, TERMINATOR, 5))
    return out


def _both(chunks: list[Chunk], close_ns: int | None = None
          ) -> tuple[list[dict[str, object]], list[dict[str, object]], list[Record]]:
    per_write, _ = _parse(list(chunks), close_ns)
    records = fold(chunks)
    folded, stats = _parse(records, close_ns)
    assert stats.stream_orphans == 0 and stats.internal_errors == 0
    return _attrs(per_write), _attrs(folded), records


def test_500_token_stream_is_one_span_from_two_response_records() -> None:
    chunks = openai_stream(500)
    old, new, records = _both(chunks)
    assert len(new) == 1 and new == old
    response_records = [r for r in records if r.direction == OUT]
    assert len(response_records) == 2  # the head, one summary
    a = new[0]
    assert a["sits.stream.chunks"] == 502  # 500 tokens, usage, [DONE]
    assert a["sits.gen_ai.stream.events"] == 501
    assert a["gen_ai.usage.output_tokens"] == 500 and a["gen_ai.usage.input_tokens"] == 17
    assert a["gen_ai.response.model"] == "llama-3-8b"
    assert a["_error"] is None


@pytest.mark.parametrize("terminator", ["apart", "joined", "none"])
@pytest.mark.parametrize("n", [1, 3, 50])
def test_same_attributes_as_per_write_records(n: int, terminator: str) -> None:
    # "none": the client closed after [DONE] (the openai SDK), the summary comes at close
    chunks = openai_stream(n, terminator=terminator)
    close = chunks[-1].ts_exit_ns + MS if terminator == "none" else None
    old, new, _ = _both(chunks, close)
    assert new == old and len(new) == 1
    assert new[0]["_error"] is None


@pytest.mark.parametrize("n", [1, 4, 50])
def test_chat_role_preamble_is_not_the_first_token(n: int) -> None:
    chunks = openai_stream(n, role=True)
    old, new, records = _both(chunks)
    assert new == old and len(new) == 1
    role_write, token_write = chunks[2], chunks[3]
    a = new[0]
    # the first chunk is the role event; the first token is the write after it
    assert a["sits.gen_ai.time_to_first_token_ms"] - a["sits.time_to_first_chunk_ms"] == \
        pytest.approx((token_write.ts_enter_ns - role_write.ts_enter_ns) / MS)
    assert a["sits.gen_ai.stream.events"] == n + 2  # role, tokens, usage
    assert len([r for r in records if r.direction == OUT]) == 2  # still head + one summary


def test_without_a_preamble_the_first_chunk_is_the_first_token() -> None:
    chunks = openai_stream(6)
    _, new, _ = _both(chunks)
    a = new[0]
    assert a["sits.gen_ai.time_to_first_token_ms"] == a["sits.time_to_first_chunk_ms"]


@pytest.mark.parametrize("merge", [2, 3])
def test_merged_events_are_records_and_counts_stay_exact(merge: int) -> None:
    # node corks a tick's writes into one: several events a write are not folded
    chunks = openai_stream(12, merge=merge, role=True)
    old, new, records = _both(chunks)
    assert new == old and len(new) == 1
    assert new[0]["sits.gen_ai.stream.events"] == 14  # role, 12 tokens, usage
    assert new[0]["gen_ai.usage.output_tokens"] == 12
    merged = [r for r in records if isinstance(r, Chunk) and r.direction == OUT
              and r.data.count(b"data:") > 1]
    # role, 12 tokens, usage, [DONE]: 15 events, `merge` a write; each merged write a record
    assert len(merged) == 15 // merge


def test_keepalive_next_request_ends_the_fold() -> None:
    first = openai_stream(20, terminator="joined")
    second = openai_stream(5, t=first[-1].ts_exit_ns + 10 * MS)
    old, new, records = _both(first + second)
    assert len(new) == 2 and new == old
    assert sum(isinstance(r, StreamChunk) for r in records) == 2


def test_long_event_keeps_usage_from_the_last_writes() -> None:
    chunks = openai_stream(30)
    big = b"data: " + json.dumps({"model": "llama-3-8b", "choices": [{"delta": {
        "content": "x" * 5000}}]}).encode() + b"\n\n"
    w = _chunked(big)
    chunks.insert(5, Chunk(OUT, chunks[4].ts_exit_ns + 10, chunks[4].ts_exit_ns + 20, w, len(w)))
    old, new, _ = _both(chunks)
    assert new == old


def test_recorded_uvicorn_sse() -> None:
    chunks: list[Chunk] = []
    raw = (FIXTURES / "uvicorn_sse.trace").read_bytes()
    pos = 0
    while pos < len(raw):
        nl = raw.index(b"\n", pos)
        tag, size, t = raw[pos:nl].split(b" ")
        data = raw[nl + 1:nl + 1 + int(size)]
        d = IN if tag == b">" else OUT
        chunks.append(Chunk(d, T0 + int(t), T0 + int(t) + 4000, data, len(data)))
        pos = nl + 2 + int(size)
    old, new, records = _both(chunks)
    assert new == old and len(new) == 1
    assert any(isinstance(r, StreamChunk) for r in records)


def test_content_length_and_single_write_responses_are_not_folded() -> None:
    req = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    resp = b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n"
    chunks = [Chunk(IN, T0, T0 + 10, req, len(req)), Chunk(OUT, T0 + 20, T0 + 30, resp, len(resp)),
              Chunk(OUT, T0 + 40, T0 + 50, b"hello world!", 12)]
    assert fold(chunks) == chunks
    old, new, _ = _both(chunks)
    assert new == old


def test_summary_without_an_open_response_is_counted_not_applied() -> None:
    _, stats = _parse([StreamChunk(OUT, 3, 3, T0, T0 + 10, 5, 30, 40, 0, True, (b"", b""))])
    assert stats.stream_orphans == 1


def test_stream_record_decodes() -> None:
    c = ev.StreamEventC(kind=12, tgid=7, conn_id=3, first_enter_ns=10, last_exit_ns=99,
                        writes=4, events=4, end=1, role=1, tail_last=0, tail0_len=3,
                        tail1_len=2, body_bytes=40, wire_bytes=60, max_gap_ns=8)
    c.tail0 = b"new"
    c.tail1 = b"ol"
    got = ev.decode(bytes(c))
    assert isinstance(got, ev.StreamEvent)
    assert got.tails == (b"ol", b"new") and got.end is ev.StreamEnd.TERMINATOR
    assert (got.writes, got.events, got.body_bytes, got.max_gap_ns) == (4, 4, 40, 8)
    assert ev._STREAM_HDR.size == ev.StreamEventC.tail0.offset
    bad = bytearray(bytes(c))
    bad[ev.StreamEventC.end.offset] = 9
    with pytest.raises(ev.DecodeError):
        ev.decode(bytes(bad))
