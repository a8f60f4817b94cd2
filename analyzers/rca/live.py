"""The thread beside a live agent: samples /proc about once a second, closes windows as they
end and hands each verdict to the callbacks (printer, exporters, recording)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from .engine import RcaEngine
from .procs import ProcSampler, ProcSnapshot
from .verdict import Verdict

VerdictSink = Callable[[Verdict], None]


class LiveRca:
    def __init__(self, engine: RcaEngine, sinks: Sequence[VerdictSink], *,
                 sampler: ProcSampler | None = None,
                 on_procs: Callable[[ProcSnapshot], None] | None = None,
                 every_s: float = 0.25, procs_every_s: float = 1.0,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.engine = engine
        self.sinks = list(sinks)
        self.sampler = sampler or ProcSampler(watch=engine.watched_pids)
        self._on_procs = on_procs
        self._every = every_s
        self._procs_every_ns = int(procs_every_s * 1e9)
        self._clock = clock_ns
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_procs = 0
        self.errors = 0

    def step(self) -> list[Verdict]:
        now = self._clock()
        if now - self._last_procs >= self._procs_every_ns:
            self._last_procs = now
            snap = self.sampler.snapshot()
            self.engine.add_procs(snap)
            if self._on_procs is not None:
                self._on_procs(snap)
        verdicts = self.engine.advance(self._clock())
        for v in verdicts:
            for sink in self.sinks:
                sink(v)
        return verdicts

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self._every):
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - the analysis must never stop the agent
                    self.errors += 1

        self.step()
        self._thread = threading.Thread(target=loop, name="sits-rca", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class RecordingLoop:
    """`sits-trace record`: once a second, a /proc snapshot and the feature frame's newest row
    into the recording (the spans go in through the agent's sink)."""

    def __init__(self, on_procs: Callable[[ProcSnapshot], None],
                 on_row: Callable[[int], None], *, sampler: ProcSampler | None = None,
                 every_s: float = 1.0) -> None:
        self._on_procs = on_procs
        self._on_row = on_row
        self.sampler = sampler or ProcSampler()
        self._every = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> None:
        snap = self.sampler.snapshot()
        self._on_procs(snap)
        self._on_row(snap.t_ns)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self._every):
                self.step()

        self.step()
        self._thread = threading.Thread(target=loop, name="sits-record", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
