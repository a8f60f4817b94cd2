"""A tiny downstream HTTP service whose response delay changes at run time.

The traced service calls it; a `slow_dependency` fault raises its delay. Any GET answers
`200 ok` after the current delay; `GET /__delay?ms=N` sets the delay (answers at once).
Run by path (standard library only): `python bench/faults/slowdep.py --port 9100`.
`SlowDependency` starts it as a subprocess (optionally inside a netns via `popen`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import parse_qs, urlparse

SCRIPT = Path(__file__).resolve()


class _State:
    def __init__(self, delay_ms: float) -> None:
        self.delay_ms = delay_ms
        self.lock = threading.Lock()


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/__delay":
                with state.lock:
                    state.delay_ms = float(parse_qs(url.query).get("ms", ["0"])[0])
                self._answer(f"delay_ms={state.delay_ms}\n".encode())
                return
            time.sleep(state.delay_ms / 1000.0)
            self._answer(b"ok\n")

        def _answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    return Handler


def serve(host: str, port: int, delay_ms: float) -> None:
    srv = ThreadingHTTPServer((host, port), _handler(_State(delay_ms)))
    srv.daemon_threads = True
    srv.serve_forever()


class SlowDependency:
    """The dependency as a subprocess; `set_delay(ms)` changes its delay while it runs.

    `spawn` starts argv (default: subprocess.Popen); pass `Topology.popen` bound to a side
    to put it in a namespace, and then `setter_host` must be reachable from here, so keep
    the default (root netns) unless a socket factory for that netns is given."""

    def __init__(self, port: int, host: str = "127.0.0.1", delay_ms: float = 0.0,
                 spawn: Callable[[Sequence[str]], subprocess.Popen[bytes]] | None = None,
                 fetch: Callable[[str], bytes] | None = None) -> None:
        self.host, self.port, self.delay_ms = host, port, delay_ms
        argv = [sys.executable, str(SCRIPT), "--host", host, "--port", str(port),
                "--delay-ms", str(delay_ms)]
        self.proc = spawn(argv) if spawn else subprocess.Popen(argv, start_new_session=True)
        self._fetch = fetch or _urlopen
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def set_delay(self, ms: float) -> int:
        """Set the delay; returns the unix time (ns) once the service confirmed it."""
        body = self._fetch(f"{self.url}__delay?ms={ms}")
        if not body.startswith(b"delay_ms="):
            raise RuntimeError(f"slow dependency answered {body!r}")
        self.delay_ms = ms
        return time.time_ns()

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.set_delay(self.delay_ms)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"slow dependency did not start on {self.url}") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _urlopen(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        body: bytes = r.read()
        return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="HTTP service with a run-time adjustable delay")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    try:
        serve(a.host, a.port, a.delay_ms)
    except OSError as e:
        print(f"slowdep: cannot listen on {a.host}:{a.port}: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
