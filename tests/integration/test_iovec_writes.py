"""Responses written with sendmsg(2) as iovec entries, the way runtimes that gather a head
and a body into one call write them (node corks them into one writev). A response longer
than the 4 KiB captured: the first record carries its first 4 KiB, wherever the entries
split them (a first entry of 4 KiB or more captured nothing before: the head was lost and
the exchange counted malformed), and a second record its last 512 bytes when one entry holds
them all (the "usage" that ends a non-streamed completion)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable

import pytest

from .harness import Tracer, free_port, wait_port

pytestmark = pytest.mark.bpf

TOKENS = 1500


def _body() -> bytes:
    text = " ".join(f"w{i}" for i in range(TOKENS))
    return json.dumps({"id": "c1", "object": "chat.completion", "model": "m",
                       "choices": [{"index": 0, "message": {"role": "assistant",
                                                             "content": text}}],
                       "usage": {"prompt_tokens": 2, "completion_tokens": TOKENS,
                                 "total_tokens": TOKENS + 2}}).encode()


# how each response is cut into iovec entries: (head, body) -> entries
SPLITS: dict[str, Callable[[bytes, bytes], list[bytes]]] = {
    "one entry": lambda h, b: [h + b],
    "head, body": lambda h, b: [h, b],
    "four entries": lambda h, b: [h, b[:3000], b[3000:6000], b[6000:]],
    # bpf/http.c reads the entries two at a time: a head cut across a pair's two entries, and
    # odd counts (the last pair's second entry is past the array)
    "head in two, body": lambda h, b: [h[:20], h[20:], b],
    "five entries": lambda h, b: [h[:10], h[10:30], h[30:], b[:100], b[100:]],
}


def _serve(listener: socket.socket, split: Callable[[bytes, bytes], list[bytes]],
           stop: threading.Event) -> None:
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    got = conn.recv(65536)
                    if not got:
                        break
                    buf += got
                if b"\r\n\r\n" not in buf:
                    break
                head, _, buf = buf.partition(b"\r\n\r\n")
                n = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                          if x.lower().startswith(b"content-length:")), 0)
                while len(buf) < n:
                    buf += conn.recv(65536)
                buf = buf[n:]
                body = _body()
                resp = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n" % len(body))
                entries = split(resp, body)
                sent = conn.sendmsg(entries)
                assert sent == len(resp) + len(body)


@pytest.mark.parametrize("name", list(SPLITS))
def test_a_long_response_sent_as_iovec_entries(name: str) -> None:
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    stop = threading.Event()
    tracer = Tracer("--pid", str(os.getpid()))
    server = threading.Thread(target=_serve, args=(listener, SPLITS[name], stop), daemon=True)
    server.start()
    try:
        wait_port(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        rids = []
        for i in range(2):
            rid = f"iov-{name.replace(' ', '-')}-{i}-{time.time_ns()}"
            conn.request("POST", "/v1/chat/completions",
                         body=json.dumps({"model": "m", "max_tokens": TOKENS,
                                          "messages": [{"role": "user", "content": "a b"}]}),
                         headers={"content-type": "application/json", "x-request-id": rid})
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == 200 and len(data) > 4096 + 512
            rids.append((rid, len(data)))
        conn.close()
        for rid, size in rids:
            spans = tracer.by_request_id(rid, kind="SERVER")
            assert len(spans) == 1, (rid, spans)
            a = spans[0]["attributes"]
            assert a.get("http.response.status_code") == 200, a
            assert a["http.response.body.size"] == size, a
            assert a.get("gen_ai.usage.output_tokens") == TOKENS, a
            assert a.get("error.type") is None, a
    finally:
        stop.set()
        server.join(5)
        listener.close()
        err = tracer.stop()
    assert "parser_malformed=0 " in err, err[-800:]
