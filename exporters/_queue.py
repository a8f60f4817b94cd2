"""A bounded queue and a worker thread between the tracing thread and a slow sink.

The tracing thread only appends to a deque under a lock (it never waits on the
sink); when the queue is full the span is dropped and counted. The worker takes
batches (full, or older than the batch delay) and hands each to ``send``; a batch
``send`` refuses is retried with jittered exponential backoff until its deadline,
then dropped and counted. Memory is bounded by ``capacity`` plus one batch.
Modelled on opentelemetry-python's ``sdk/trace/export`` BatchSpanProcessor.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sits_trace.agent.model import Span

from ._base import ExporterStats

log = logging.getLogger(__name__)

# returns True when the sink took the batch; False (or raising) asks for a retry
SendBatch = Callable[[list[Span]], bool]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    initial_s: float = 0.5
    max_s: float = 5.0
    deadline_s: float = 30.0
    jitter: float = 0.2  # each delay is scaled by a factor in [1 - jitter, 1 + jitter]

    def delays(self, rng: random.Random) -> Iterator[float]:
        """Backoff delays without end; the caller stops at the deadline."""
        d = self.initial_s
        while True:
            yield d * rng.uniform(1 - self.jitter, 1 + self.jitter)
            d = min(d * 2, self.max_s)


class QueuedExporter:
    """An exporter whose `send` runs on its own thread behind a bounded queue."""

    def __init__(self, name: str, send: SendBatch, *, capacity: int = 8192,
                 batch_size: int = 512, batch_delay_s: float = 1.0,
                 retry: RetryPolicy = RetryPolicy(),
                 monotonic: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None,
                 interrupt: Callable[[], None] | None = None,
                 on_batch: Callable[[list[Span]], None] | None = None) -> None:
        self.name = name
        self._send = send
        self._on_batch = on_batch  # runs once per batch on the worker, before the first send
        self._interrupt = interrupt  # cuts a send in progress short on shutdown
        self._capacity = capacity
        self._batch_size = batch_size
        self._delay = batch_delay_s
        self._retry = retry
        self._now = monotonic
        self._rng = rng or random.Random()
        self._q: deque[Span] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._stop = threading.Event()  # set on shutdown: ends retries and the worker
        self._flush_wanted = 0
        self._in_flight = 0
        self._stats = ExporterStats(exporter=name, queue_capacity=capacity)
        self._thread = threading.Thread(target=self._run, name=f"sits-export-{name}", daemon=True)
        self._thread.start()

    # ---- the tracing thread's side ----

    def export(self, spans: Sequence[Span]) -> None:
        with self._cond:
            if self._stop.is_set():
                self._count_drop("shutdown", len(spans))
                return
            room = self._capacity - len(self._q)
            self._q.extend(spans[:max(room, 0)])
            if len(spans) > room:
                self._count_drop("queue_full", len(spans) - max(room, 0))
            if len(self._q) >= self._batch_size:
                self._cond.notify()

    def _count_drop(self, reason: str, n: int) -> None:
        self._stats.dropped[reason] = self._stats.dropped.get(reason, 0) + n

    def stats(self) -> ExporterStats:
        with self._cond:
            s = self._stats
            return ExporterStats(s.exporter, s.exported, dict(s.dropped), len(self._q),
                                 s.queue_capacity, s.export_errors)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Send what is queued now; True if it all left (sent or given up) in time."""
        deadline = self._now() + timeout_s
        with self._cond:
            self._flush_wanted += 1
            self._cond.notify()
            while self._q or self._in_flight:
                left = deadline - self._now()
                if left <= 0 or not self._thread.is_alive():
                    self._flush_wanted -= 1
                    return False
                self._cond.wait(min(left, 0.05))
            self._flush_wanted -= 1
            return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush for up to timeout_s, then stop the worker; what is left is dropped."""
        if self._stop.is_set():
            return
        self.force_flush(timeout_s)
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        if self._interrupt is not None:
            _quietly(self.name, self._interrupt)
        self._thread.join(max(timeout_s, 0.1))
        with self._cond:
            if self._q:
                self._count_drop("shutdown", len(self._q))
                self._q.clear()

    # ---- the worker ----

    def _take(self) -> list[Span]:
        with self._cond:
            deadline = self._now() + self._delay
            while len(self._q) < self._batch_size and not (self._flush_wanted and self._q) \
                    and not self._stop.is_set():
                left = deadline - self._now()
                if left <= 0:
                    break
                self._cond.wait(left)
            n = min(len(self._q), self._batch_size)
            batch = [self._q.popleft() for _ in range(n)]
            self._in_flight = n
            return batch

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._take()
            if batch:
                self._deliver(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()

    def _deliver(self, batch: list[Span]) -> None:
        if self._on_batch is not None:
            _quietly(self.name, lambda: self._on_batch(batch) if self._on_batch else None)
        deadline = self._now() + self._retry.deadline_s
        delays = self._retry.delays(self._rng)
        while True:
            if self._try_send(batch):
                with self._cond:
                    self._stats.exported += len(batch)
                return
            wait = next(delays)
            if self._stop.is_set() or self._now() + wait > deadline:
                with self._cond:
                    self._count_drop("export_failed", len(batch))
                return
            self._stop.wait(wait)

    def _try_send(self, batch: list[Span]) -> bool:
        try:
            ok = self._send(batch)
        except Exception:
            log.warning("exporter %s: send failed", self.name, exc_info=True)
            ok = False
        if not ok:
            with self._cond:
                self._stats.export_errors += 1
        return ok


def _quietly(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        log.debug("exporter %s: close failed", name, exc_info=True)
