"""The control loop's per-span input: SERVER spans' latencies per service between two ticks.

Every span the tracer emits passes through `LatencyTable.add_spans` when the control loop is
on (it is by default), so this module is compiled with the hot path (agent/native.py); the
loop itself, which runs once an interval, is not.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

from sits_trace.agent.model import Span


def p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(0.95 * len(s)) - 1))]


class LatencyTable:
    """Request latencies (ms) per service, collected between two ticks (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms: dict[str, list[float]] = {}
        self._pids: dict[str, set[int]] = {}

    def add(self, service: str, ms: float, pid: int | None = None) -> None:
        with self._lock:
            self._ms.setdefault(service, []).append(ms)
            if pid is not None:
                self._pids.setdefault(service, set()).add(pid)

    def add_spans(self, spans: list[Span]) -> None:
        """Each SERVER span's duration under its service (its executable's name, else its
        pid), and its pid: a tracer's batch under one lock."""
        with self._lock:
            ms, pids = self._ms, self._pids
            for span in spans:
                if span.kind != "SERVER":
                    continue
                attrs = span.attributes
                name = attrs.get("process.executable.name")
                pid = attrs.get("process.pid")
                service = str(name) if name is not None else str(
                    pid if pid is not None else "?")
                col = ms.get(service)
                if col is None:
                    col = ms[service] = []
                col.append((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6)
                if isinstance(pid, int):
                    s = pids.get(service)
                    if s is None:
                        s = pids[service] = set()
                    s.add(pid)

    def take(self, service: str) -> list[float]:
        with self._lock:
            return self._ms.pop(service, [])

    def busiest(self) -> str | None:
        with self._lock:
            return max(self._ms, key=lambda s: len(self._ms[s]), default=None)

    def pids(self, service: str) -> set[int]:
        with self._lock:
            return set(self._pids.get(service, ()))
