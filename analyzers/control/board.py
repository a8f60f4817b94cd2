"""The decisions the control API serves and the load reports servers send, behind one lock.

`version` grows by one each time a decision changes, so a client can tell a new decision
from the one it has. Reports are kept per service and summed until the control loop takes
them once per interval (mean batch size, mean queue depth, and the requests that arrived,
from the running count a server may send).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class _ReportSums:
    n: int = 0
    batch: int = 0
    queue: int = 0
    last_unix: float = 0.0
    arrivals: int | None = None  # the server's running count, latest
    arrivals_taken: int | None = None  # ... when the loop last took the reports


@dataclass(frozen=True)
class ReportSummary:
    reports: int
    mean_batch_size: float
    mean_queue_depth: float
    arrivals: int | None = None  # requests the server received since the last take


class DecisionBoard:
    def __init__(self, wall: Callable[[], float] = time.time, max_services: int = 256) -> None:
        self._lock = threading.Lock()
        self._wall = wall
        self.max_services = max_services
        self._decisions: dict[str, Any] = {"batch_window_ms": None, "stream_priority": None,
                                           "copy_budget_bytes_per_s": None, "cpu_actions": []}
        self.version = 0
        self._reports: dict[str, _ReportSums] = {}

    def snapshot(self) -> tuple[dict[str, Any], int]:
        with self._lock:
            d = dict(self._decisions)
            d["cpu_actions"] = [dict(a) for a in d["cpu_actions"]]
            return d, self.version

    def publish(self, **changes: Any) -> bool:
        """Set decisions (batch_window_ms=..., cpu_actions=[...]); True when one changed."""
        with self._lock:
            changed = False
            for k, v in changes.items():
                if k not in self._decisions:
                    raise KeyError(k)
                if self._decisions[k] != v:
                    self._decisions[k] = v
                    changed = True
            if changed:
                self.version += 1
            return changed

    def clear(self) -> None:
        self.publish(batch_window_ms=None, stream_priority=None, copy_budget_bytes_per_s=None,
                     cpu_actions=[])

    def report(self, service: str, queue_depth: int, batch_size: int,
               arrivals: int | None = None) -> bool:
        """Add one report; False when the table of services is full (a new one is refused)."""
        with self._lock:
            sums = self._reports.get(service)
            if sums is None:
                if len(self._reports) >= self.max_services:
                    return False
                sums = self._reports[service] = _ReportSums()
            sums.n += 1
            sums.batch += batch_size
            sums.queue += queue_depth
            sums.last_unix = self._wall()
            if arrivals is not None:
                sums.arrivals = arrivals
            return True

    def take_reports(self, service: str) -> ReportSummary | None:
        """The reports of `service` since the last call (None if it sent none)."""
        with self._lock:
            sums = self._reports.get(service)
            if sums is None or sums.n == 0:
                return None
            now, before = sums.arrivals, sums.arrivals_taken
            # a count that went down is a restarted server: no figure for this interval
            arrivals = now - before if now is not None and before is not None and now >= before \
                else None
            sums.arrivals_taken = now
            out = ReportSummary(sums.n, sums.batch / sums.n, sums.queue / sums.n, arrivals)
            sums.n = sums.batch = sums.queue = 0
            return out

    def services(self) -> list[str]:
        with self._lock:
            return sorted(self._reports)
