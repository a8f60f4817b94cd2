"""Every server an LLM node runs, each with 32 simultaneous new connections from every client
kind (the openai SDK sync and async, streamed and not; httpx, aiohttp, requests, curl): one
SERVER span per request holding the server's own record (connection, method, path, status,
chunks, first and last chunk within 1 ms, model and token counts), one CLIENT span per call
not marked as an error. wrk and hey add load with many requests per connection.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Tracer
from .stacks import Call, check_spans, plan, run_concurrently, run_server

pytestmark = pytest.mark.bpf

for _m in ("httpx", "uvloop", "httptools", "openai", "aiohttp", "requests"):
    pytest.importorskip(_m)

CONCURRENT = 32
WRK_S = 2  # seconds of wrk load


def _have_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def tracer() -> Iterator[Tracer]:
    # this test's process tree only: other work on the machine neither loads nor confuses it
    t = Tracer("--pid", str(os.getpid()))
    yield t
    t.stop()


UVICORN = [pytest.param(f"uvicorn-{loop}-{parser}", tls, id=f"uvicorn-{loop}-{parser}-"
                        f"{'https' if tls else 'http'}")
           for loop in ("uvloop", "asyncio") for parser in ("httptools", "h11")
           for tls in (True, False)]


def _skip_unless(module: str, why: str = "") -> pytest.MarkDecorator:
    return pytest.mark.skipif(not _have_module(module), reason=why or f"pip install {module}")


OTHERS = [
    pytest.param("hypercorn", True, id="hypercorn-https", marks=_skip_unless("hypercorn")),
    pytest.param("hypercorn", False, id="hypercorn-http", marks=_skip_unless("hypercorn")),
    # granian's TLS is rustls, not OpenSSL: nothing for a uprobe to see; plain HTTP only
    pytest.param("granian", False, id="granian-http", marks=[
        _skip_unless("granian"),
        pytest.mark.xfail(reason="issue 9, open: granian's Rust runtime writes after send() "
                          "returns; under load its last write lands 7-8 ms after the app's "
                          "record, past the 5 ms allowed", strict=False)]),
    pytest.param("gunicorn", True, id="gunicorn-uvicorn-workers-https",
                 marks=_skip_unless("gunicorn")),
    pytest.param("aiohttp", True, id="aiohttp-https"),
    pytest.param("aiohttp", False, id="aiohttp-http"),
    pytest.param("node", True, id="node-https",
                 marks=pytest.mark.skipif(not shutil.which("node"), reason="no node")),
    pytest.param("node", False, id="node-http",
                 marks=pytest.mark.skipif(not shutil.which("node"), reason="no node")),
]


@pytest.mark.parametrize("kind,tls", UVICORN + OTHERS)
def test_every_stream_is_one_right_span(tracer: Tracer, kind: str, tls: bool) -> None:
    with run_server(kind, tls) as server:
        calls = plan(f"{kind}-{tls}", CONCURRENT)
        run_concurrently(server.base, calls)
        check_spans(tracer, server, calls)
        if kind == "gunicorn":  # several workers share the listening socket: all traced
            assert len({r["pid"] for r in server.rows()}) >= 2, "one worker took every call"


WRK_SCRIPT = r'''
local n = 0
request = function()
  n = n + 1
  local body = '{"model":"m-wrk","max_tokens":3,"stream":true,"messages":[{"content":"a b c"}]}'
  return wrk.format("POST", "/v1/chat/completions",
    {["x-request-id"] = string.format("%s-%d-%d", TAG, id, n),
     ["content-type"] = "application/json"}, body)
end
setup = function(thread) thread:set("id", math.random(1, 1000000000)) end
'''


@pytest.mark.skipif(not shutil.which("wrk"), reason="no wrk")
@pytest.mark.parametrize("kind,tls", [
    ("uvicorn-uvloop-httptools", True),
    ("node", False)])
def test_wrk_load(tracer: Tracer, kind: str, tls: bool) -> None:
    """32 keep-alive connections for 2 s, a unique x-request-id a request (wrk's Lua)."""
    with run_server(kind, tls) as server, tempfile.TemporaryDirectory() as d:
        tag = f"wrk-{kind}"
        script = Path(d) / "ids.lua"
        script.write_text(f'TAG = "{tag}"\n' + WRK_SCRIPT)
        t_start = time.time_ns()
        subprocess.run(["wrk", "-t", "2", "-c", str(CONCURRENT), "-d", f"{WRK_S}s", "-s",
                        str(script), server.base + "/"], check=True, capture_output=True,
                       timeout=30)
        # wrk closes its connections when its time is up, streams in flight included; an
        # ASGI server's send() after the peer left returns as if written, so the server logs
        # those too. Held to the server's record: the requests whose last write ended before
        # wrk could have stopped (it starts after t_start and runs WRK_S seconds).
        cutoff = t_start + WRK_S * 1_000_000_000
        rows = [r for r in server.rows() if r["rid"].startswith(tag)]
        rids = [r["rid"] for r in rows if r["last_end_ns"] < cutoff]
        assert len(rids) >= 100, f"wrk got only {len(rids)} requests through"
        calls = [Call(rid, "wrk", True, "m-wrk", 3, "a b c") for rid in rids]
        check_spans(tracer, server, calls, client_spans=False)


@pytest.mark.skipif(not shutil.which("hey"), reason="no hey")
def test_hey_load(tracer: Tracer) -> None:
    """hey (Go's HTTP client): 256 streamed requests over 32 connections, one shared id;
    the spans must be the server's requests one for one (by client port)."""
    with run_server("aiohttp", False) as server:
        rid = "hey-" + Path(tempfile.mktemp()).name
        body = '{"model":"m-hey","max_tokens":3,"stream":true,"messages":[{"content":"a b"}]}'
        subprocess.run(["hey", "-n", "256", "-c", str(CONCURRENT), "-m", "POST",
                        "-H", f"x-request-id: {rid}", "-T", "application/json", "-d", body,
                        server.base + "/v1/chat/completions"],
                       check=True, capture_output=True, timeout=60)
        rows = [r for r in server.rows() if r["rid"] == rid]
        assert len(rows) == 256
        spans = tracer.wait_for(
            lambda s: s["kind"] == "SERVER"
            and s["attributes"].get("http.request.header.x-request-id") == rid, 256, 15)
        got = sorted((s["attributes"].get("client.port"), s["attributes"].get("sits.stream.chunks"),
                      s["attributes"].get("http.response.status_code")) for s in spans)
        want = sorted((r["port"], r["events"], 200) for r in rows)
        if got != want:  # what differs, and the agent's counters (lost, shed) to say why
            wrong = sorted(set(got) ^ set(want))[:6]
            bad = [s for s in spans if (s["attributes"].get("client.port"),
                                        s["attributes"].get("sits.stream.chunks"), 200)
                   not in set(want)][:2]
            raise AssertionError(f"spans vs server log differ at {wrong}; spans: "
                                 f"{json.dumps(bad)}; agent counters "
                                 f"{json.dumps(tracer.counters())}")
