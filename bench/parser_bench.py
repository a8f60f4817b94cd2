"""Microbenchmark of the HTTP/1.1 parser: µs per request+response exchange.

    .venv/bin/python bench/parser_bench.py [-n 200000]

Cases: a curl GET and nginx's 200 response on one keep-alive connection (two
chunks per exchange), the same with a fresh parser per exchange (connection set-up
included), 16 pipelined requests in one chunk, and an SSE stream of 20 events.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role
from sits_trace.agent.tracing.http1 import HttpConnParser

REQ = (
    b"GET /index.html HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: curl/7.88.1\r\n"
    b"Accept: */*\r\n\r\n"
)
RESP = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 02 Dec 2025 10:20:00 GMT\r\n"
    b"Content-Type: text/html\r\nContent-Length: 615\r\n"
    b"Last-Modified: Tue, 13 Jun 2023 15:08:10 GMT\r\nConnection: keep-alive\r\n"
    b'ETag: "64888a1a-267"\r\nAccept-Ranges: bytes\r\n\r\n' + b"x" * 615
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Tue, 02 Dec 2025 10:20:00 GMT\r\nserver: uvicorn\r\n"
    b"cache-control: no-cache\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"token": "hello"}\r\n\r\n'
SSE_CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)


def _conn() -> ConnInfo:
    return ConnInfo(conn_id=1, pid=100, fd=7, role=Role.SERVER, comm="nginx")


def _timed(n: int, body: Callable[[int], int]) -> float:
    """µs per exchange for `body(n)`, which returns how many exchanges it made."""
    t0 = time.perf_counter_ns()
    made = body(n)
    return (time.perf_counter_ns() - t0) / 1000 / max(made, 1)


def keepalive(n: int) -> int:
    made = 0

    def sink(ex: Exchange) -> None:  # the pipeline turns each into a span and lets it go
        nonlocal made
        made += 1

    p = HttpConnParser(_conn(), sink)
    for i in range(n):
        p.feed(Chunk(Direction.INGRESS, i * 10, i * 10 + 1, REQ, len(REQ)))
        p.feed(Chunk(Direction.EGRESS, i * 10 + 5, i * 10 + 6, RESP, len(RESP)))
    return made


def per_connection(n: int) -> int:
    made = 0
    sink: Callable[[Exchange], None] = lambda ex: None
    req = Chunk(Direction.INGRESS, 1, 2, REQ, len(REQ))
    resp = Chunk(Direction.EGRESS, 3, 4, RESP, len(RESP))
    for _ in range(n):
        p = HttpConnParser(_conn(), sink)
        p.feed(req)
        p.feed(resp)
        p.close(5)
        made += 1
    return made


def pipelined(n: int) -> int:
    batch = 16
    out: list[Exchange] = []
    p = HttpConnParser(_conn(), out.append)
    reqs = Chunk(Direction.INGRESS, 1, 2, REQ * batch, len(REQ) * batch)
    resps = Chunk(Direction.EGRESS, 3, 4, RESP * batch, len(RESP) * batch)
    for _ in range(n // batch):
        p.feed(reqs)
        p.feed(resps)
        out.clear()
    return (n // batch) * batch


def sse(n: int) -> int:
    events = 20
    out: list[Exchange] = []
    p = HttpConnParser(_conn(), out.append)
    req = Chunk(Direction.INGRESS, 1, 2, REQ, len(REQ))
    head = Chunk(Direction.EGRESS, 3, 4, SSE_HEAD, len(SSE_HEAD))
    ev = Chunk(Direction.EGRESS, 5, 6, SSE_CHUNK, len(SSE_CHUNK))
    end = Chunk(Direction.EGRESS, 7, 8, b"0\r\n\r\n", 5)
    rounds = max(n // 20, 1)
    for _ in range(rounds):
        p.feed(req)
        p.feed(head)
        for _ in range(events):
            p.feed(ev)
        p.feed(end)
        out.clear()
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200_000, help="exchanges per case")
    n = ap.parse_args().n
    keepalive(1000)  # warm up
    print(f"keep-alive GET + 200 (nginx):  {_timed(n, keepalive):6.2f} µs/exchange")
    print(f"new parser per exchange:       {_timed(n, per_connection):6.2f} µs/exchange")
    print(f"16 pipelined per chunk:        {_timed(n, pipelined):6.2f} µs/exchange")
    print(f"SSE, 20 chunked events:        {_timed(n, sse):6.2f} µs/exchange")


if __name__ == "__main__":
    main()
