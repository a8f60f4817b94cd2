"""Connections of a traced process that carry no HTTP stop costing the agent (trace.mute_non_http).

One traced Python process serves HTTP/1.1 (and a WebSocket-style upgrade: 101, then binary
frames both ways on the same connection) while two of its threads ping-pong a Redis-style
protocol over a local connection, as fast as they can (both ends traced). The agent, at its
default load budget, must trace every HTTP request and the upgrade, shed nothing, and ask the
kernel to stop sending the ping-pong's and the upgraded connection's bytes: fewer records in
all than ping-pong round trips, where each round trip is four records while they are sent.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Tracer

pytestmark = pytest.mark.bpf

WORKLOAD = r'''
import socket, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/ws":  # an upgrade, then frames echoed until the client closes
            self.send_response(101); self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade"); self.end_headers(); self.wfile.flush()
            while True:
                d = self.connection.recv(4096)
                if not d: break
                self.connection.sendall(d)
            self.close_connection = True
            return
        body = b"ok\n"
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)

http = ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=http.serve_forever, daemon=True).start()
kv = socket.socket(); kv.bind(("127.0.0.1", 0)); kv.listen()
def kv_server():
    c, _ = kv.accept()
    while True:
        d = c.recv(4096)
        if not d: break
        c.sendall(b"+OK\r\n")
threading.Thread(target=kv_server, daemon=True).start()
go, ops = threading.Event(), [0]
def kv_client():
    c = socket.create_connection(kv.getsockname())
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    go.wait()
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        c.sendall(b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n"); c.recv(64); ops[0] += 1
    print("ops", ops[0], flush=True)
t = threading.Thread(target=kv_client, daemon=True); t.start()
print("port", http.server_address[1], flush=True)
sys.stdin.readline(); go.set(); t.join()
sys.stdin.readline()
'''

SECONDS = 4.0


@pytest.fixture()
def workload(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    p = subprocess.Popen([sys.executable, str(script), str(SECONDS)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


def request(port: int, rid: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(f"GET /r HTTP/1.1\r\nHost: x\r\nx-request-id: {rid}\r\n"
                  "Connection: close\r\n\r\n".encode())
        out = b""
        while d := c.recv(4096):
            out += d
        return out


def test_non_http_connections_are_muted_and_http_still_traced(
        workload: subprocess.Popen[str]) -> None:
    assert workload.stdout is not None and workload.stdin is not None
    port = int(workload.stdout.readline().split()[1])
    tracer = Tracer("--pid", str(workload.pid), "--cpu-budget", "0.1")
    try:
        workload.stdin.write("go\n")
        workload.stdin.flush()
        sent = 0
        with socket.create_connection(("127.0.0.1", port)) as ws:
            ws.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                       b"Connection: Upgrade\r\nx-request-id: upgrade-1\r\n\r\n")
            assert ws.recv(4096).startswith(b"HTTP/1.1 101")
            end = time.monotonic() + SECONDS
            while time.monotonic() < end:
                for _ in range(50):  # frames both ways on the upgraded connection
                    ws.sendall(b"\x82\x05hello")
                    ws.recv(64)
                assert request(port, f"mute-{sent}").endswith(b"ok\n")
                sent += 1
                time.sleep(0.1)
        ops = int(workload.stdout.readline().split()[1])
        spans = tracer.wait_for(lambda s: str(s["attributes"].get(
            "http.request.header.x-request-id", "")).startswith("mute-"), sent)
        upgrade = tracer.by_request_id("upgrade-1")
        stats = tracer.counters()
    finally:
        out = tracer.stop()
        workload.stdin.write("end\n")
        workload.stdin.flush()
    t = stats.get("tracer", {})
    data_records = stats.get("kernel_seen", {}).get("data", 0)
    print(f"{ops} ping-pong round trips, {sent} HTTP requests: {len(spans)} spans, "
          f"data records {data_records}, muted {t.get('conns_muted')}, "
          f"shed {t.get('exchanges_shed')}")
    assert len(spans) == sent and t.get("exchanges_shed") == 0, out
    assert len(upgrade) == 1 and upgrade[0]["attributes"]["http.response.status_code"] == 101
    # the ping-pong's two ends and the upgraded connection (the client's side of which is
    # this test, not traced)
    assert t.get("conns_muted") == 3, t
    assert ops > 2000, "the ping-pong should have run"
    assert data_records < ops, (data_records, ops)  # unmuted: 4 records a round trip
