"""Processes and connections whose life does not start under the agent's eyes: a keep-alive
connection opened before the agent started, a server that forks its workers after it started,
a process that execs into a server (a Python one, and node whose OpenSSL is inside the program).
Each request is held to the server's own log, as in test_stacks_servers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator

import pytest

from .harness import Tracer
from .stacks import Call, check_spans, plan, run_concurrently, run_server

pytestmark = pytest.mark.bpf

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvloop")


def _tracer() -> Tracer:
    return Tracer("--pid", str(os.getpid()))  # this test's process tree only


@pytest.fixture(scope="module")
def tracer() -> Iterator[Tracer]:
    t = _tracer()
    yield t
    t.stop()


def _post(client: httpx.Client, base: str, c: Call) -> None:
    body = {"model": c.model, "max_tokens": c.max_tokens, "stream": c.stream,
            "messages": [{"role": "user", "content": c.prompt}]}
    with client.stream("POST", base + "/v1/chat/completions", json=body,
                       headers={"x-request-id": c.rid}) as r:
        text = b"".join(r.iter_bytes()).decode()
    assert r.status_code == 200 and text.count("data: ") == c.max_tokens + 2


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
def test_connection_opened_before_the_agent(tls: bool) -> None:
    """uvicorn on uvloop: a keep-alive connection carries a stream, then the agent starts,
    then the same connection carries more streams: they are traced, with its client port."""
    with run_server("uvicorn-uvloop-httptools", tls) as server, \
            httpx.Client(verify=False, timeout=30,
                         limits=httpx.Limits(keepalive_expiry=600)) as client:
        before = plan("pre", 1, (("httpx", True),))
        _post(client, server.base, before[0])
        port = server.logged([before[0].rid])[before[0].rid]["port"]
        tracer = _tracer()
        try:
            after = plan("post", 4, (("httpx", True),))
            for c in after:
                _post(client, server.base, c)
            rows = server.logged([c.rid for c in after])
            assert {r["port"] for r in rows.values()} == {port}, "not the same connection"
            check_spans(tracer, server, after)
        finally:
            tracer.stop()


@pytest.mark.skipif(importlib.util.find_spec("gunicorn") is None, reason="pip install gunicorn")
def test_server_that_forks_workers_after_the_agent_started(tracer: Tracer) -> None:
    """gunicorn forks two uvicorn workers that share its listening socket: every request is a
    span of the worker that served it, none of the master."""
    with run_server("gunicorn", True) as server:
        calls = plan("fork", 32)
        run_concurrently(server.base, calls)
        check_spans(tracer, server, calls)
        pids = {r["pid"] for r in server.rows()}
        assert server.proc.pid not in pids and len(pids) == 2


def _exec_through_sh(args: list[str]) -> list[str]:
    return ["/bin/sh", "-c", 'exec "$@"', "sh", *args]


@pytest.mark.parametrize("kind", ["uvicorn-asyncio-h11", "node"])
def test_process_that_execs_into_a_server(tracer: Tracer, kind: str) -> None:
    """sh execs into the server (uvicorn over HTTPS; node, whose OpenSSL the agent finds in
    the program itself once it ran exec)."""
    if kind == "node" and not shutil.which("node"):
        pytest.skip("no node")
    with run_server(kind, True, wrap=_exec_through_sh) as server:
        calls = plan(f"exec-{kind}", 16, (("httpx", True), ("openai", True), ("requests", True),
                                          ("openai", False)))
        run_concurrently(server.base, calls)
        check_spans(tracer, server, calls)
        assert {r["pid"] for r in server.rows()} == {server.proc.pid}  # the exec'd sh itself
