"""The agent's one clock conversion: Unix time minus CLOCK_MONOTONIC.

Times inside the agent are CLOCK_MONOTONIC nanoseconds (what bpf_ktime_get_ns returns);
spans, NVML samples and feature rows convert to or from Unix time with this offset, read
once at start and passed in (so tests and replays pass their own).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def realtime_offset_ns(monotonic_ns: Callable[[], int] = time.monotonic_ns,
                       time_ns: Callable[[], int] = time.time_ns, tries: int = 5) -> int:
    """Unix time minus CLOCK_MONOTONIC, from the tightest of `tries` monotonic brackets
    around a Unix reading."""
    best: tuple[int, int] | None = None
    for _ in range(tries):
        a = monotonic_ns()
        w = time_ns()
        b = monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    if best is None:
        raise ValueError("tries must be at least 1")
    return best[1]
