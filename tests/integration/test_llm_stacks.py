"""The stacks LLM servers run: uvicorn on uvloop or asyncio, over HTTP and HTTPS, streaming
Server-Sent Events to many concurrent clients; the OpenAI SDK as a client.

Each server logs its own view of every request (x-request-id, client port, events sent), and
every request must come out as exactly one SERVER span carrying that view: the right connection,
status, and chunk count. The uvloop + TLS case is the race of issue 9: uvloop defers the first
SSL_read after the handshake, so a thread's last recv can belong to another client's handshake.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .harness import Tracer, free_port, make_cert, wait_port

pytestmark = pytest.mark.bpf

httpx = pytest.importorskip("httpx")
uvloop = pytest.importorskip("uvloop")

EVENTS = 12

# An OpenAI-shaped streaming app: each SSE event a separate write, like a token stream.
SSE_APP = r'''
import asyncio, json, os, time

LOG = open(os.environ["SITS_TEST_LOG"], "a", buffering=1)

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = dict(scope["headers"])
    rid = headers.get(b"x-request-id", b"").decode()
    n = int(os.environ.get("SITS_TEST_EVENTS", "12"))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    t0 = time.time_ns()
    for i in range(n):
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + json.dumps({"i": i}).encode() + b"\n\n"})
        await asyncio.sleep(0.004)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    LOG.write(json.dumps({"rid": rid, "port": scope["client"][1], "path": scope["path"],
                          "events": n + 1, "first_ns": t0, "end_ns": time.time_ns()}) + "\n")
'''


@contextmanager
def uvicorn_app(loop: str, tls: bool, http: str = "httptools"
                ) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "sseapp.py").write_text(SSE_APP)
        log = Path(d) / "server.log"
        args = [sys.executable, "-m", "uvicorn", "sseapp:app", "--host", "127.0.0.1",
                "--port", str(port), "--loop", loop, "--http", http, "--log-level", "warning",
                "--no-access-log"]
        if tls:
            key, crt = make_cert(Path(d))
            args += ["--ssl-keyfile", str(key), "--ssl-certfile", str(crt)]
        env = {"SITS_TEST_LOG": str(log), "SITS_TEST_EVENTS": str(EVENTS),
               "PATH": "/usr/bin:/bin"}
        proc = subprocess.Popen(args, cwd=d, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            wait_port(port, timeout=20)
            yield f"{'https' if tls else 'http'}://127.0.0.1:{port}", proc, log
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def server_log(log: Path, want: int, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        if len(rows) >= want:
            return {r["rid"]: r for r in rows}
        time.sleep(0.05)
    raise AssertionError(f"server logged {len(rows)} of {want} requests")


def fresh_connection_streams(base: str, rids: list[str]) -> None:
    """Every request on its own new connection (a TLS handshake each), all at once."""
    barrier = threading.Barrier(len(rids))
    errors: list[BaseException] = []

    def one(rid: str) -> None:
        try:
            with httpx.Client(verify=False, timeout=20) as c:
                barrier.wait(timeout=10)
                with c.stream("POST", base + "/v1/chat/completions",
                              headers={"x-request-id": rid}, json={"stream": True}) as r:
                    body = b"".join(r.iter_bytes())
            assert body.count(b"data: ") == EVENTS + 1, body[-200:]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]


@pytest.fixture(scope="module")
def tracer() -> Iterator[Tracer]:
    t = Tracer()
    yield t
    t.stop()


def check_spans(tracer: Tracer, pid: int, logged: dict[str, dict[str, Any]]) -> None:
    bad = []
    for rid, row in logged.items():
        spans = [s for s in tracer.by_request_id(rid, timeout=10, kind="SERVER")
                 if s["attributes"].get("process.pid") == pid]
        if len(spans) != 1:
            bad.append((rid, f"{len(spans)} server spans"))
            continue
        a = spans[0]["attributes"]
        got = (a.get("client.port"), a.get("http.response.status_code"),
               a.get("sits.stream.chunks"), a.get("error.type"))
        want = (row["port"], 200, row["events"], None)
        if got != want:
            bad.append((rid, f"got {got} want {want}"))
    assert not bad, f"{len(bad)} of {len(logged)} wrong: {bad[:5]}"


@pytest.mark.parametrize("loop,tls", [("uvloop", True), ("asyncio", True), ("uvloop", False)])
def test_concurrent_new_streams(tracer: Tracer, loop: str, tls: bool) -> None:
    """24 clients each open a new connection at once and stream 13 SSE events."""
    with uvicorn_app(loop, tls) as (base, proc, log):
        rids = [f"{loop}-{tls}-{uuid.uuid4().hex[:10]}" for _ in range(24)]
        fresh_connection_streams(base, rids)
        logged = server_log(log, len(rids))
        check_spans(tracer, proc.pid, {r: logged[r] for r in rids})
