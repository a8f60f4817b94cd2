"""Paced bulk copies: a token bucket in bytes, its rate changeable while a copy runs.

A bulk host-to-device copy (weights, a KV-cache swap) competes with latency-critical copies for
the PCIe link. `CopyPacer.copy` splits it into chunks and waits before each chunk until the
bucket holds its bytes. The bucket holds at most one chunk, so no burst exceeds a chunk. A budget
of None means "no budget": chunks are copied back to back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SLEEP_S = 0.05  # a budget change takes effect within this long, even mid-wait
_SLACK_BYTES = 1e-3

CopyRange = Callable[[int, int], None]  # (offset, length) -> copies that byte range


@dataclass
class PaceStats:
    bytes: int = 0
    chunks: int = 0
    slept_s: float = 0.0


def _check_budget(budget: float | None) -> float | None:
    if budget is not None and not budget > 0:
        raise ValueError(f"copy budget must be > 0 bytes/s or None, not {budget}")
    return budget


class CopyPacer:
    """Copies byte ranges in chunks, staying within `budget_bytes_per_s` over time."""

    def __init__(self, budget_bytes_per_s: float | None, chunk_bytes: int,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._budget = _check_budget(budget_bytes_per_s)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(chunk_bytes)
        self._filled_at = clock()

    @property
    def budget_bytes_per_s(self) -> float | None:
        return self._budget

    def set_budget(self, budget_bytes_per_s: float | None) -> None:
        """Change the rate; the next chunk (or a wait in progress) follows it."""
        with self._lock:
            self._refill()
            self._budget = _check_budget(budget_bytes_per_s)

    def copy(self, total_bytes: int, copy_range: CopyRange,
             stop: threading.Event | None = None) -> PaceStats:
        """Copy [0, total_bytes) through `copy_range`, chunk by chunk; stops early on `stop`."""
        stats = PaceStats()
        offset = 0
        while offset < total_bytes:
            n = min(self.chunk_bytes, total_bytes - offset)
            stats.slept_s += self._wait_for(n, stop)
            if stop is not None and stop.is_set():
                break
            copy_range(offset, n)
            offset += n
            stats.bytes += n
            stats.chunks += 1
        return stats

    def _refill(self) -> None:
        now = self._clock()
        if self._budget is None:
            self._tokens = float(self.chunk_bytes)
        else:
            gained = (now - self._filled_at) * self._budget
            self._tokens = min(float(self.chunk_bytes), self._tokens + gained)
        self._filled_at = now

    def _take(self, n: int) -> float:
        """Take n bytes if the bucket has them (0.0), else the seconds still to wait."""
        with self._lock:
            self._refill()
            if self._budget is None:
                return 0.0
            if self._tokens >= n - _SLACK_BYTES:  # float rounding must not wait forever
                self._tokens -= n
                return 0.0
            return (n - self._tokens) / self._budget

    def _wait_for(self, n: int, stop: threading.Event | None) -> float:
        slept = 0.0
        while (wait := self._take(n)) > 0:
            if stop is not None and stop.is_set():
                break
            step = min(wait, MAX_SLEEP_S)
            self._sleep(step)
            slept += step
        return slept
