"""Spans as JSON lines (``Span.to_json()``), to a file or stdout.

The embedded default when no collector is configured. Writing happens on the
exporter's own thread, so a stdout pipe nobody reads never stalls tracing: the
queue fills and spans are dropped and counted instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO

from sits_trace.agent.model import Span

from ._base import ExporterStats
from ._queue import QueuedExporter, RetryPolicy

_RETRY = RetryPolicy(deadline_s=5.0)  # a file that refuses writes for 5 s loses the batch


class JsonlExporter:
    name = "jsonl"

    def __init__(self, path: str = "-", *, stream: IO[str] | None = None, capacity: int = 8192,
                 batch_size: int = 512, batch_delay_s: float = 0.2,
                 retry: RetryPolicy = _RETRY) -> None:
        """`path` "-" is stdout; `stream` (tests) replaces the file."""
        self._own = stream is None and path != "-"
        self._out: IO[str] = stream or (sys.stdout if path == "-" else
                                        open(path, "a", encoding="utf-8"))  # noqa: SIM115
        self._queue = QueuedExporter(self.name, self._write, capacity=capacity,
                                     batch_size=batch_size, batch_delay_s=batch_delay_s,
                                     retry=retry)

    def _write(self, batch: list[Span]) -> bool:
        text = "".join(s.json_line() for s in batch)
        self._out.write(text)
        self._out.flush()
        return True

    def export(self, spans: Sequence[Span]) -> None:
        self._queue.export(spans)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return self._queue.force_flush(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._queue.shutdown(timeout_s)
        if self._own:
            try:
                self._out.close()
            except OSError:
                pass

    def stats(self) -> ExporterStats:
        return self._queue.stats()
