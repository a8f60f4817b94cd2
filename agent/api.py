"""The daemon's local read-only API: JSON lines over a Unix socket (not a TCP port).

A client writes one JSON object a line, e.g. `{"op": "snapshot"}`, and reads one JSON object a
line back: the op's result, or `{"error": "..."}`. Ops are plain callables handed in by the
composition root, so a control socket can sit beside this one later with its own ops. The socket
is made mode 0600 in a directory of mode 0750: only its owner (root, or the service's user) and
that directory's group may talk to it.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Op = Callable[[], Any]
MAX_REQUEST = 4096  # bytes in one request line


class ApiError(RuntimeError):
    """The API cannot be reached or answered badly; the message says which."""


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    ops: Mapping[str, Op] = {}


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_REQUEST + 1)
            if not line:
                return
            reply = answer(self.server.ops, line)
            try:
                self.wfile.write(json.dumps(reply, separators=(",", ":"), default=str).encode()
                                 + b"\n")
                self.wfile.flush()
            except OSError:
                return


def answer(ops: Mapping[str, Op], line: bytes) -> Any:
    """The reply to one request line."""
    if len(line) > MAX_REQUEST:
        return {"error": f"request longer than {MAX_REQUEST} bytes"}
    try:
        req = json.loads(line)
    except ValueError:
        return {"error": "not JSON; send e.g. {\"op\": \"snapshot\"}"}
    op = req.get("op") if isinstance(req, dict) else None
    fn = ops.get(op) if isinstance(op, str) else None
    if fn is None:
        return {"error": f"unknown op {op!r} (allowed: {', '.join(sorted(ops))})"}
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a failing op answers, never kills the server
        return {"error": f"{op}: {type(exc).__name__}: {exc}"}


class ApiServer:
    """Serves `ops` on the Unix socket at `path` from a background thread."""

    def __init__(self, path: str | Path, ops: Mapping[str, Op]) -> None:
        self.path = Path(path)
        self.ops = dict(ops)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve. Raises ApiError (in use by a live daemon, or not creatable)."""
        _claim(self.path)
        old = os.umask(0o177)
        try:
            server = _Server(str(self.path), _Handler)
        except OSError as exc:
            raise ApiError(f"api socket {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        server.ops = self.ops
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="sits-api", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        try:
            self.path.unlink()
        except OSError:
            pass


def _claim(path: Path) -> None:
    """Make the socket's directory (0750), and remove a stale socket no daemon answers on."""
    try:
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        raise ApiError(f"api socket directory {path.parent}: {exc.strerror}") from None
    if not path.exists() and not path.is_symlink():
        return
    try:
        query(path, "ping", timeout_s=1.0)
    except ApiError:
        path.unlink(missing_ok=True)
        return
    raise ApiError(f"api socket {path}: another sits-trace daemon is serving it")


def query(path: str | Path, op: str, timeout_s: float = 5.0) -> Any:
    """One request to the API at `path`. Raises ApiError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
            s.sendall(json.dumps({"op": op}).encode() + b"\n")
            data = _read_line(s)
        except OSError as exc:
            raise ApiError(f"api socket {path}: {exc.strerror or exc}") from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise ApiError(f"api socket {path}: the answer is not JSON") from None
    if isinstance(reply, dict) and "error" in reply and len(reply) == 1:
        raise ApiError(f"api socket {path}: {reply['error']}")
    return reply


def _read_line(s: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)
