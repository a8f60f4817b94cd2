"""Real BPF against real servers: every request sent appears exactly once, right.

One tracer (`sits-trace trace --json`, a subprocess) watches the whole module;
each test tags its requests with its own x-request-id and asserts on those spans.
"""

from __future__ import annotations

import collections
import json
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import Nginx, Tracer, curl, have, python_server, uvicorn_server

pytestmark = pytest.mark.bpf


def rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def tracer() -> Iterator[Tracer]:
    t = Tracer()
    yield t
    err = t.stop()
    # the stats line the tracer prints on stop: nothing lost at this load
    assert "lost_in_kernel=0" in err, err


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory, tracer: Tracer) -> Iterator[Nginx]:
    n = Nginx(tmp_path_factory.mktemp("nginx"))
    yield n
    n.stop()


def attrs(span: dict[str, Any]) -> dict[str, Any]:
    a: dict[str, Any] = span["attributes"]
    return a


def duration_ms(span: dict[str, Any]) -> float:
    return (span["end_time_unix_nano"] - span["start_time_unix_nano"]) / 1e6


def one_server_span(tracer: Tracer, r: str) -> dict[str, Any]:
    spans = tracer.by_request_id(r, kind="SERVER")
    assert len(spans) == 1, spans
    return spans[0]


# ---- nginx over HTTP and HTTPS (SSL_read/SSL_write) ----

@pytest.mark.parametrize("scheme", ["http", "https"])
def test_nginx_methods_statuses_and_timing(tracer: Tracer, nginx: Nginx, scheme: str) -> None:
    port = nginx.http_port if scheme == "http" else nginx.https_port
    cases = [("GET", "/", 200), ("GET", "/missing", 404), ("GET", "/fail", 503),
             ("GET", "/static.txt", 200), ("POST", "/upload", 201), ("HEAD", "/", 200)]
    ids = []
    for method, path, _ in cases:
        r = rid(f"ngx-{scheme}")
        ids.append(r)
        extra = ["-X", method] if method not in ("HEAD",) else ["-I"]
        if method == "POST":
            extra += ["--data-binary", "x" * 3000]
        curl(f"{scheme}://127.0.0.1:{port}{path}", *extra, rid=r)
    for (method, path, status), r in zip(cases, ids, strict=True):
        s = one_server_span(tracer, r)
        a = attrs(s)
        assert a["http.request.method"] == method
        assert a["url.path"] == path
        assert a["http.response.status_code"] == status
        assert a["tls"] is (scheme == "https")
        assert a["server.port"] == port
        assert a["process.executable.name"] == "nginx"
        assert a["network.protocol.version"] == "1.1"
        log = nginx.log_entries(r)
        assert len(log) == 1 and int(log[0][1]) == status
        nginx_ms = float(log[0][2]) * 1000
        # nginx's $request_time is the difference of two readings of its cached millisecond
        # clock: each truncated to the ms, so it is below the true time by up to 1 ms, and a
        # stale cache adds a little (seen once: 1.006 ms traced against "0.000"). The cache
        # is refreshed once per event-loop turn, so time the worker spent waiting for a CPU
        # inside one turn is invisible to nginx: the span's own run-queue delay says how
        # much (seen: 1.69 ms traced, "0.000" logged, 1.565 ms in the run queue)
        waited_ms = a.get("sits.cpu.runq_delay_us", 0) / 1000
        assert -0.25 <= duration_ms(s) - nginx_ms <= 1.25 + waited_ms, \
            (path, duration_ms(s), nginx_ms, waited_ms)
        assert s["status"]["code"] == ("ERROR" if status >= 500 else "UNSET")


def test_nginx_keepalive_many_requests_each_once(tracer: Tracer, nginx: Nginx) -> None:
    base = rid("ka")
    args: list[str] = []
    for i in range(20):
        args += ["--next"] if i else []
        args += ["-s", "-o", "/dev/null", "-H", f"x-request-id: {base}-{i}",
                 f"http://127.0.0.1:{nginx.http_port}/?i={i}"]
    # one curl process, one keep-alive connection (--next keeps it), 20 requests
    subprocess.run(["curl", *args], check=True)
    for i in range(20):
        spans = tracer.by_request_id(f"{base}-{i}", kind="SERVER")
        assert len(spans) == 1
        assert attrs(spans[0])["url.query"] == f"i={i}"


@pytest.mark.skipif(not have("hey"), reason="hey is not installed")
def test_load_generator_every_request_exactly_once(tracer: Tracer, nginx: Nginx) -> None:
    r = rid("hey")
    n = 2000
    subprocess.run(["hey", "-n", str(n), "-c", "8", "-H", f"x-request-id: {r}",
                    f"http://127.0.0.1:{nginx.http_port}/"], check=True, capture_output=True)
    spans = tracer.by_request_id(r, count=n, timeout=30, kind="SERVER")
    if len(spans) != n:  # say where they went: per connection, and the agent's counters
        per_conn = collections.Counter(attrs(s).get("client.port") for s in spans)
        raise AssertionError(f"{len(spans)} of {n} spans; nginx logged "
                             f"{len(nginx.log_entries(r))}; per client port {dict(per_conn)}; "
                             f"agent counters {json.dumps(tracer.counters())}")
    assert len(nginx.log_entries(r)) == n
    assert all(attrs(s)["http.response.status_code"] == 200 for s in spans)
    assert len({s["span_id"] for s in spans}) == n
    # x-request-id without traceparent: one deterministic trace id for the same request id
    assert len({s["trace_id"] for s in spans}) == 1


def test_wrk_keepalive_counts_match_nginx_log(tracer: Tracer, nginx: Nginx, tmp_path: Path) -> None:
    r = rid("wrk")
    # wrk's delay() paces each connection (1 ms between requests): a steady load, not a
    # saturation test (bench/overhead.py is that)
    script = tmp_path / "paced.lua"
    script.write_text(f'wrk.headers["x-request-id"] = "{r}"\nfunction delay() return 1 end\n')
    subprocess.run(["wrk", "-t1", "-c4", "-d2s", "-s", str(script),
                    f"http://127.0.0.1:{nginx.http_port}/"], check=True, capture_output=True)
    time.sleep(0.5)
    logged = len(nginx.log_entries(r))
    spans = tracer.by_request_id(r, count=logged, timeout=30, kind="SERVER")
    assert logged > 1000
    assert len(spans) == logged


def test_traceparent_is_kept(tracer: Tracer, nginx: Nginx) -> None:
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    r = rid("tp")
    curl(f"http://127.0.0.1:{nginx.http_port}/", "-H", f"traceparent: 00-{trace_id}-{parent}-01",
         rid=r)
    s = one_server_span(tracer, r)
    assert s["trace_id"] == trace_id
    assert s["parent_span_id"] == parent


def test_secrets_are_never_kept(tracer: Tracer, nginx: Nginx) -> None:
    r = rid("secret")
    curl(f"http://127.0.0.1:{nginx.http_port}/", "-H", "Authorization: Bearer s3cr3t-token",
         "-H", "Cookie: session=s3cr3t-cookie", rid=r)
    s = one_server_span(tracer, r)
    assert "s3cr3t" not in str(s)


def test_pipelined_requests(tracer: Tracer, nginx: Nginx) -> None:
    base = rid("pipe")
    batch = b"".join(
        f"GET /?p={i} HTTP/1.1\r\nHost: localhost\r\nx-request-id: {base}-{i}\r\n\r\n".encode()
        for i in range(5))
    with socket.create_connection(("127.0.0.1", nginx.http_port)) as s:
        s.sendall(batch)  # five requests in one write
        got = b""
        deadline = time.monotonic() + 5
        while got.count(b"HTTP/1.1 200") < 5 and time.monotonic() < deadline:
            got += s.recv(65536)
    for i in range(5):
        spans = tracer.by_request_id(f"{base}-{i}", kind="SERVER")
        assert len(spans) == 1
        assert attrs(spans[0])["url.query"] == f"p={i}"


def test_aborted_connection_then_next_request_fine(tracer: Tracer) -> None:
    with python_server() as (port, _):
        r1, r2 = rid("abort"), rid("after-abort")
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"GET /slow HTTP/1.1\r\nHost: x\r\nx-request-id: {r1}\r\n\r\n".encode())
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        # a connection cut in the middle of its headers
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /half HTTP/1.1\r\nHost: x\r\nx-req")
        curl(f"http://127.0.0.1:{port}/ok", rid=r2)
        s2 = one_server_span(tracer, r2)
        assert attrs(s2)["http.response.status_code"] == 200
        spans = tracer.by_request_id(r1, kind="SERVER")
        assert len(spans) == 1
        a = attrs(spans[0])
        # the server wrote its response to a reset socket, or never got to: either way once
        assert a.get("error.type") in ("connection_closed", None) or a.get(
            "http.response.status_code") == 200


# ---- Python servers: http.server, ssl (SSL_read_ex/SSL_write_ex), uvicorn (memory BIO) ----

def test_python_http_server_chunked_and_errors(tracer: Tracer) -> None:
    with python_server() as (port, proc):
        rs = {p: rid("py") for p in ("/chunked", "/status/418", "/status/500", "/x?y=1")}
        for path, r in rs.items():
            curl(f"http://127.0.0.1:{port}{path}", rid=r)
        r_post = rid("py-post")
        curl(f"http://127.0.0.1:{port}/up", "--data-binary", "z" * 10000, rid=r_post)
        chunked = attrs(one_server_span(tracer, rs["/chunked"]))
        assert chunked["http.response.status_code"] == 200
        assert chunked["sits.stream.chunks"] >= 3
        assert chunked["sits.time_to_last_chunk_ms"] >= chunked["sits.time_to_first_chunk_ms"] + 30
        assert attrs(one_server_span(tracer, rs["/status/418"]))["http.response.status_code"] == 418
        s500 = one_server_span(tracer, rs["/status/500"])
        assert s500["status"]["code"] == "ERROR" and attrs(s500)["error.type"] == "500"
        a = attrs(one_server_span(tracer, r_post))
        assert a["http.request.method"] == "POST" and a["http.request.body.size"] == 10000
        assert a["process.pid"] == proc.pid


def test_python_tls_server_uses_ex_variants(tracer: Tracer) -> None:
    with python_server(tls=True) as (port, proc):
        r = rid("pytls")
        out = curl(f"https://127.0.0.1:{port}/hello", rid=r)
        assert out.stdout.startswith("ok /hello")
        a = attrs(one_server_span(tracer, r))
        assert a["tls"] is True
        assert a["url.path"] == "/hello"
        assert a["process.pid"] == proc.pid
        assert a["client.address"] == "127.0.0.1"


def test_python_tls_client_spans(tracer: Tracer, nginx: Nginx) -> None:
    r = rid("client")
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    import http.client

    c = http.client.HTTPSConnection("127.0.0.1", nginx.https_port, context=ctx)
    c.request("GET", "/", headers={"x-request-id": r})
    assert c.getresponse().read() == b"hello from nginx\n"
    c.close()
    spans = tracer.by_request_id(r, count=2)
    kinds = sorted(s["kind"] for s in spans)
    assert kinds == ["CLIENT", "SERVER"], spans
    client = next(s for s in spans if s["kind"] == "CLIENT")
    assert attrs(client)["server.port"] == nginx.https_port
    assert attrs(client)["tls"] is True
    # the connection's TCP numbers on a client span too: found by its 4-tuple (the local
    # port from the kernel's open event, else /proc)
    assert attrs(client)["sits.tcp.srtt_us"] > 0, attrs(client)


def test_uvicorn_https_sse_memory_bio(tracer: Tracer) -> None:
    with uvicorn_server() as (port, _proc):
        r_sse, r_json, r_err = rid("sse"), rid("uv"), rid("uv-err")
        out = curl(f"https://127.0.0.1:{port}/sse", "-N", rid=r_sse)
        assert out.stdout.count("data: token") == 5
        curl(f"https://127.0.0.1:{port}/json", rid=r_json)
        curl(f"https://127.0.0.1:{port}/status/502", rid=r_err)
        sse = attrs(one_server_span(tracer, r_sse))
        assert sse["tls"] is True and sse["url.path"] == "/sse"
        assert sse["sits.stream.chunks"] >= 5
        # five events 50 ms apart: first chunk early, last one >= 200 ms later
        assert sse["sits.time_to_last_chunk_ms"] - sse["sits.time_to_first_chunk_ms"] >= 190
        assert attrs(one_server_span(tracer, r_json))["http.response.status_code"] == 200
        assert attrs(one_server_span(tracer, r_err))["http.response.status_code"] == 502


def test_pid_and_port_filters(tmp_path: Path) -> None:
    with python_server() as (port_a, proc_a), python_server() as (port_b, _):
        t = Tracer("--pid", str(proc_a.pid), "--port", str(port_a))
        try:
            ra, rb = rid("fa"), rid("fb")
            curl(f"http://127.0.0.1:{port_a}/", rid=ra)
            curl(f"http://127.0.0.1:{port_b}/", rid=rb)
            assert len(t.by_request_id(ra)) == 1
            time.sleep(0.5)
            assert t.by_request_id(rb, timeout=0.5) == []
        finally:
            t.stop()


# a traced process that made more threads and children, one after another, than the
# kernel's table of traced tasks holds (bpf/events.h SITS_MAX_TARGETS): each left it on exit
_MANY_TASKS = r"""
import subprocess, sys, threading
sys.stdin.readline()  # the tracer is ready
for _ in range(int(sys.argv[1])):
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
for _ in range(64):
    subprocess.run(["true"], check=True)
r = subprocess.run(["curl", "-s", "--max-time", "10", "-H", "x-request-id: " + sys.argv[3],
                    sys.argv[2]], capture_output=True)
sys.exit(r.returncode)
"""


def test_pid_filter_follows_children_after_many_threads() -> None:
    with python_server() as (port, _):
        r = rid("many")
        proc = subprocess.Popen([sys.executable, "-c", _MANY_TASKS, "20000",
                                 f"http://127.0.0.1:{port}/", r], stdin=subprocess.PIPE)
        t = Tracer("--pid", str(proc.pid))
        try:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.close()
            assert proc.wait(timeout=120) == 0
            # the curl the traced process started last: a CLIENT span (the server is not
            # in the traced tree)
            spans = t.by_request_id(r)
            assert [s["kind"] for s in spans] == ["CLIENT"], spans
        finally:
            proc.kill()
            t.stop()


def test_process_started_after_the_agent_with_tls(tracer: Tracer) -> None:
    # the module's tracer started before this server and its libssl use
    with python_server(tls=True) as (port, _):
        time.sleep(1.5)  # the exec rescans find libssl
        r = rid("late")
        curl(f"https://127.0.0.1:{port}/late", rid=r)
        assert attrs(one_server_span(tracer, r))["url.path"] == "/late"
