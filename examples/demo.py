"""`make demo`: trace a local HTTP and HTTPS server with real eBPF and show the spans.

Starts examples/demo_server.py twice (plain and TLS, self-signed), runs the agent
in this process, drives requests at both with curl (keep-alive, chunked, errors,
a POST, a traceparent), then prints the spans as a table and as one JSON line.
Needs root (the setup step makes the rest).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sits_trace.agent.capture.probes import ProbeError
from sits_trace.agent.config import Config
from sits_trace.agent.daemon import Agent, format_stats_lines
from sits_trace.agent.model import Span

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int) -> None:
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"demo: server on port {port} did not start")


def start_servers(tmp: Path) -> tuple[list[subprocess.Popen[bytes]], int, int]:
    key, crt = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", key, "-out", crt],
                   check=True, capture_output=True)
    http_port, https_port = free_port(), free_port()
    server = str(HERE / "demo_server.py")
    procs = [
        subprocess.Popen([sys.executable, server, str(http_port)], stdout=subprocess.DEVNULL),
        subprocess.Popen([sys.executable, server, str(https_port), str(key), str(crt)],
                         stdout=subprocess.DEVNULL),
    ]
    wait_port(http_port)
    wait_port(https_port)
    return procs, http_port, https_port


def drive(http_port: int, https_port: int) -> None:
    for base in (f"http://127.0.0.1:{http_port}", f"https://127.0.0.1:{https_port}"):
        urls = [f"{base}/v1/models", f"{base}/chunked", f"{base}/status/404", f"{base}/status/503"]
        # one curl: four requests on one keep-alive connection
        subprocess.run(["curl", "-sk", "-o", "/dev/null", "-H", "x-request-id: demo-keepalive",
                        *urls], check=False)
        subprocess.run(["curl", "-sk", "-o", "/dev/null", "-X", "POST", "--data-binary", "x" * 4096,
                        "-H", "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                        f"{base}/v1/completions"], check=False)


def show(spans: list[Span]) -> None:
    t = Table(title=f"sits-trace demo: {len(spans)} spans traced with eBPF")
    for col in ("kind", "tls", "method", "path", "status", "ms", "ttfb ms", "trace id", "x-request-id"):
        t.add_column(col)
    for s in spans:
        a = s.attributes
        ms = (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6
        t.add_row(s.kind, "yes" if a.get("tls") else "", str(a.get("http.request.method")),
                  str(a.get("url.path")), str(a.get("http.response.status_code", "-")),
                  f"{ms:.2f}", f"{a.get('sits.ttfb_ms', 0):.2f}", s.trace_id[:16] + "…",
                  str(a.get("http.request.header.x-request-id", "")))
    Console().print(t)
    if spans:
        print("one span as `sits-trace trace --json` prints it:")
        print(json.dumps(spans[-1].to_json()))


def main() -> int:
    if os.geteuid() != 0:
        print("demo: needs root to load eBPF programs (sudo make demo)", file=sys.stderr)
        return 2
    spans: list[Span] = []
    lock = threading.Lock()

    def sink(s: Span) -> None:
        with lock:
            spans.append(s)

    with tempfile.TemporaryDirectory() as d:
        procs, http_port, https_port = start_servers(Path(d))
        server_pids = [p.pid for p in procs]
        agent = Agent(Config(), sink)
        try:
            agent.start()
        except ProbeError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 2
        stop = threading.Event()
        loop = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        loop.start()
        try:
            drive(http_port, https_port)
            time.sleep(1.0)
        finally:
            stop.set()
            loop.join(timeout=10)
            for p in procs:
                p.terminate()
    mine = [s for s in spans if s.attributes.get("process.pid") in server_pids]
    show(sorted(mine, key=lambda s: s.start_time_unix_nano))
    for line in format_stats_lines(agent.stats()):
        print(f"agent: {line}")
    return 0 if len(mine) >= 10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
