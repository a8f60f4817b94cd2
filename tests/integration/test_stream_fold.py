"""A real uvicorn (uvloop, httptools) SSE server streams 500 tokens, one write each: the kernel
folds the body writes (bpf/stream.h) and the agent builds one span with the right chunk count
and timings from at most two response records (the head and one summary).

The server logs, per request, when its first and last events were handed to the transport;
the span's first-to-last chunk time must agree with it within 2 ms.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from sits_trace.agent.capture import events as ev
from sits_trace.agent.capture.loader import RecordedSource

from .harness import Tracer, free_port, wait_port

pytestmark = pytest.mark.bpf
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvloop")

TOKENS = 500

APP = r'''
import asyncio, json, os, time
LOG = open(os.environ["SITS_TEST_LOG"], "a", buffering=1)

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    rid = dict(scope["headers"]).get(b"x-request-id", b"").decode()
    n = int(os.environ["SITS_TEST_TOKENS"])
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    first = last = 0
    for i in range(n):
        ev = {"id": "c1", "model": "tiny", "choices": [{"delta": {"content": f" t{i}"}}]}
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + json.dumps(ev).encode() + b"\n\n"})
        last = time.monotonic_ns()
        first = first or last
        await asyncio.sleep(0.001)
    usage = {"id": "c1", "model": "tiny", "choices": [],
             "usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": n + 9}}
    await send({"type": "http.response.body", "more_body": True,
                "body": b"data: " + json.dumps(usage).encode() + b"\n\n"})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
    last = time.monotonic_ns()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    LOG.write(json.dumps({"rid": rid, "port": scope["client"][1], "first_ns": first,
                          "last_ns": last}) + "\n")
'''


def test_500_token_stream_two_records_one_span(tmp_path: Path) -> None:
    port = free_port()
    rec = tmp_path / "ring.rec"
    log = tmp_path / "server.log"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "sseapp.py").write_text(APP)
        env = {"SITS_TEST_LOG": str(log), "SITS_TEST_TOKENS": str(TOKENS), "PATH": "/usr/bin:/bin"}
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "sseapp:app", "--host", "127.0.0.1", "--port",
             str(port), "--loop", "uvloop", "--http", "httptools", "--log-level", "warning",
             "--no-access-log"], cwd=d, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            wait_port(port, timeout=20)
            tracer = Tracer("--pid", str(server.pid), "--record", str(rec))
            try:
                rid = uuid.uuid4().hex
                body = json.dumps({"model": "tiny", "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]})
                with httpx.Client(timeout=30) as c:
                    r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body,
                               headers={"x-request-id": rid, "content-type": "application/json"})
                assert r.text.count("data: ") == TOKENS + 2
                spans = tracer.by_request_id(rid, timeout=15)
            finally:
                tracer.stop()
        finally:
            server.terminate()
            server.wait(timeout=10)
    row = json.loads(log.read_text().splitlines()[0])
    assert len(spans) == 1, spans
    a = spans[0]["attributes"]
    assert a["sits.stream.chunks"] == TOKENS + 2  # tokens, usage, [DONE]
    assert a["sits.gen_ai.stream.events"] == TOKENS + 1
    assert a["gen_ai.usage.output_tokens"] == TOKENS
    assert a.get("error.type") is None
    server_ms = (row["last_ns"] - row["first_ns"]) / 1e6
    span_ms = a["sits.time_to_last_chunk_ms"] - a["sits.time_to_first_chunk_ms"]
    assert abs(span_ms - server_ms) <= 2.0, (span_ms, server_ms)

    src = RecordedSource(rec)
    records: list[bytes] = []
    while not src.exhausted:
        records += src.read(0)
    response = []
    for raw in records:
        e = ev.decode(raw) if raw[:4] in (b"\x03\x00\x00\x00", b"\x0c\x00\x00\x00") else None
        if e is None or e.pid != server.pid:
            continue
        if isinstance(e, ev.StreamEvent) or (isinstance(e, ev.DataEvent) and e.direction == 1):
            response.append(e)
    assert len(response) <= 2, [type(x).__name__ for x in response]
    summary = [x for x in response if isinstance(x, ev.StreamEvent)]
    assert len(summary) == 1 and summary[0].writes == TOKENS + 2
    assert summary[0].end is ev.StreamEnd.TERMINATOR
