"""The inference server's side of the agent's control socket.

JSON lines over a Unix stream socket: one request object a line, one reply a line.

    {"op": "get"}  ->  {"ok": true, "decisions": {...}, "version": N}
    {"op": "report", "queue_depth": N, "batch_size": N, "service": "name"}  ->  {"ok": true}
    any error      ->  {"ok": false, "error": "one line"}

The client never raises into the server: no agent, a hung agent (bounded by `timeout`) or a
bad reply all mean "no decision", and the caller's default applies. A decision is cached and
re-asked at most every `refresh_ms`; a failed ask is not retried before then either, so a
missing agent costs one failed connect per refresh, not one per request.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_SOCKET = "/run/sits-trace/control.sock"
MAX_REPLY_BYTES = 64 * 1024


class ProtocolError(Exception):
    """The agent's reply does not follow the protocol (or the agent answered ok=false)."""


@dataclass(frozen=True)
class Decisions:
    """What the agent currently asks of this server; None means "no opinion"."""

    batch_window_ms: float | None
    stream_priority: int | None
    copy_budget_bytes_per_s: float | None
    cpu_actions: tuple[dict[str, Any], ...]
    version: int


def _number(value: object, name: str, minimum: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{name} is not a number")
    if not math.isfinite(value) or value < minimum:
        raise ProtocolError(f"{name} out of range: {value}")
    return float(value)


def _priority(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("stream_priority is not an integer")
    return value


def _actions(value: object) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, dict) for a in value):
        raise ProtocolError("cpu_actions is not a list of objects")
    return tuple(value)


def parse_decisions(reply: dict[str, Any]) -> Decisions:
    """Decisions from a `get` reply; ProtocolError if any field breaks the spec."""
    d = reply.get("decisions")
    version = reply.get("version")
    if not isinstance(d, dict):
        raise ProtocolError("reply has no decisions object")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError("reply has no integer version")
    return Decisions(
        batch_window_ms=_number(d.get("batch_window_ms"), "batch_window_ms", 0.0),
        stream_priority=_priority(d.get("stream_priority")),
        copy_budget_bytes_per_s=_number(d.get("copy_budget_bytes_per_s"),
                                        "copy_budget_bytes_per_s", 1e-9),
        cpu_actions=_actions(d.get("cpu_actions")),
        version=version,
    )


def decode_reply(line: bytes) -> dict[str, Any]:
    """One reply line as an object with ok=true; ProtocolError otherwise."""
    try:
        reply = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"reply is not JSON: {e}") from None
    if not isinstance(reply, dict):
        raise ProtocolError("reply is not an object")
    if reply.get("ok") is not True:
        raise ProtocolError(f"agent error: {reply.get('error', 'ok is not true')}")
    return reply


class _Connection:
    """One Unix stream connection, asked one line at a time under a deadline."""

    def __init__(self, path: str, timeout: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = b""
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise

    def ask(self, request: dict[str, Any], timeout: float, clock: Callable[[], float]) -> bytes:
        deadline = clock() + timeout
        self._sock.settimeout(timeout)
        self._sock.sendall(json.dumps(request).encode() + b"\n")
        while b"\n" not in self._buf:
            remaining = deadline - clock()
            if remaining <= 0:
                raise TimeoutError("no reply in time")
            self._sock.settimeout(remaining)
            chunk = self._sock.recv(4096)
            if not chunk:
                raise ConnectionError("agent closed the connection")
            self._buf += chunk
            if len(self._buf) > MAX_REPLY_BYTES:
                raise ProtocolError("reply line too long")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def close(self) -> None:
        self._sock.close()


class ControlClient:
    """Asks the agent for decisions, caches them, and reports load; never raises."""

    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float = 0.2,
                 refresh_ms: float = 500.0, stale_ms: float = 5000.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.timeout = timeout
        self.refresh_s = refresh_ms / 1000.0
        self.stale_s = stale_ms / 1000.0
        self.last_error: str | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._cached: Decisions | None = None
        self._cached_at = -math.inf
        self._asked_at = -math.inf
        self._down_until = -math.inf

    def decisions(self) -> Decisions | None:
        """The agent's decisions, at most `refresh_ms` old; None when there are none."""
        with self._lock:
            now = self._clock()
            if now - self._asked_at >= self.refresh_s:
                self._asked_at = now
                self._refresh(now)
            if now - self._cached_at > self.stale_s:
                self._cached = None
            return self._cached

    def batch_window_ms(self, default: float) -> float:
        d = self.decisions()
        if d is None or d.batch_window_ms is None:
            return default
        return d.batch_window_ms

    def copy_budget_bytes_per_s(self, default: float | None) -> float | None:
        d = self.decisions()
        if d is None or d.copy_budget_bytes_per_s is None:
            return default
        return d.copy_budget_bytes_per_s

    def report(self, queue_depth: int, batch_size: int, service: str,
               arrivals: int | None = None) -> bool:
        """Tell the agent the server's load; False when it could not be told. `arrivals`:
        requests received since the server started (a running count: a lost report loses
        nothing), which lets the agent see the load before the requests finish."""
        request: dict[str, Any] = {"op": "report", "queue_depth": int(queue_depth),
                                   "batch_size": int(batch_size), "service": service}
        if arrivals is not None:
            request["arrivals"] = int(arrivals)
        with self._lock:
            return self._ask(request, self._clock()) is not None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _refresh(self, now: float) -> None:
        reply = self._ask({"op": "get"}, now)
        if reply is None:
            return
        try:
            self._cached = parse_decisions(reply)
            self._cached_at = now
        except ProtocolError as e:
            self.last_error = str(e)

    def _ask(self, request: dict[str, Any], now: float) -> dict[str, Any] | None:
        if now < self._down_until:
            return None
        try:
            if self._conn is None:
                self._conn = _Connection(self.path, self.timeout)
            return decode_reply(self._conn.ask(request, self.timeout, self._clock))
        except ProtocolError as e:
            self.last_error = str(e)
            self._drop()  # the stream may be out of step: start over on the next ask
        except (OSError, TimeoutError, ConnectionError) as e:
            self.last_error = f"{type(e).__name__}: {e}"
            self._drop()
            self._down_until = now + self.refresh_s
        return None

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
