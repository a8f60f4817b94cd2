"""What every exporter offers the pipeline, and the counters it keeps.

An exporter takes finished spans with ``export()``; ``force_flush()`` and
``shutdown()`` are bounded by a timeout. None of them raises into the caller:
a failure is counted in ``stats()``, which the Prometheus exporter reads at
scrape time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sits_trace.agent.model import Span


@dataclass(slots=True)
class ExporterStats:
    """One exporter's counters; `dropped` is by reason (queue_full, export_failed, error)."""

    exporter: str
    exported: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    queue_depth: int = 0
    queue_capacity: int = 0
    export_errors: int = 0  # failed attempts, retried or not


class Exporter(Protocol):
    name: str

    def export(self, spans: Sequence[Span]) -> None: ...

    def force_flush(self, timeout_s: float = 5.0) -> bool: ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...

    def stats(self) -> ExporterStats: ...
