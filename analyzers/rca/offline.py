"""Replaying a recording through the engine, in the order the live agent would have seen it:
spans at their end time, process snapshots at theirs, windows closed as time passes."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from .engine import RcaEngine
from .recording import Recording
from .verdict import Verdict

if TYPE_CHECKING:
    import pandas as pd


def frame_of(rec: Recording) -> Callable[[], pd.DataFrame | None]:
    """The recording's feature frame as FeatureFrame.frame() would give it."""
    cache: list[pd.DataFrame] = []

    def get() -> pd.DataFrame | None:
        if not rec.frames:
            return None
        if not cache:
            import pandas as pd  # noqa: PLC0415 - only for a recording with rows

            idx = pd.to_datetime([t for t, _ in rec.frames], unit="ns", utc=True)
            df = pd.DataFrame([r for _, r in rec.frames], index=idx)
            df.columns = pd.MultiIndex.from_tuples(list(df.columns), names=["signal", "entity"])
            cache.append(df.sort_index(axis=1))
        return cache[0]

    return get


def replay(rec: Recording, engine: RcaEngine, tick_s: float = 0.25) -> list[Verdict]:
    events: list[tuple[int, int, int]] = []  # (time, kind 0 procs / 1 span, index)
    events += [(p.t_ns, 0, i) for i, p in enumerate(rec.procs)]
    events += [(s.end_time_unix_nano, 1, i) for i, s in enumerate(rec.spans)]
    if rec.spans:  # the live loop's ticks (every tick_s): windows close on time, not on spans
        first = min(s.end_time_unix_nano for s in rec.spans)
        last = max(s.end_time_unix_nano for s in rec.spans)
        events += [(t, 2, -1) for t in range(first, last, int(tick_s * 1e9))]
    heapq.heapify(events)
    out: list[Verdict] = []
    while events:
        t, kind, i = heapq.heappop(events)
        out.extend(engine.advance(t))
        if kind == 2:
            continue
        if kind == 0:
            engine.add_procs(rec.procs[i])
        else:
            engine.add(rec.spans[i])
    last = max((s.end_time_unix_nano for s in rec.spans), default=0)
    out.extend(engine.advance(last + int((engine.s.window_s + engine.s.grace_s) * 1e9) + 1))
    return out
