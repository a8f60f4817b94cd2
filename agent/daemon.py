"""The agent: kernel programs + ring reader + tracer + library watcher, driven in one loop.

`sits-trace trace` and `sits-trace run` both drive an Agent; they differ in where
spans go and how long it runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import STATS_PATH, Config
from .events import Kind
from .gpusignals import GpuSignalConfig, GpuSignals, cuda_options
from .loader import EventSource, Kernel, LoadOptions, RingSource, load
from .pipeline import Rescans, SpanSink, Tracer
from .probes import TLS_UPROBES, mapped_libraries
from .procfs import ProcFS
from .spans import SpanBuilder

def clock_offset_ns() -> int:
    """Unix time minus CLOCK_MONOTONIC (the clock bpf_ktime_get_ns reads)."""
    best = None
    for _ in range(5):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    assert best is not None
    return best[1]


class Agent:
    def __init__(self, cfg: Config, sink: SpanSink, *, procfs: ProcFS | None = None,
                 source_factory: Callable[[Kernel], EventSource] | None = None,
                 gpu: GpuSignalConfig | None = None) -> None:
        self.cfg = cfg
        self._gpu_cfg = gpu or GpuSignalConfig()
        self.gpu: GpuSignals | None = None
        self.sink = sink
        self.procfs = procfs or ProcFS()
        self.kernel: Kernel | None = None
        self.tracer: Tracer | None = None
        self._source_factory = source_factory or RingSource
        self._rescans: Rescans | None = None
        self._last_stats_write = 0.0

    def _target_pids(self) -> list[int]:
        pids: list[int] = []
        for p in self.cfg.trace.pids:
            pids.append(p)
            pids.extend(self.procfs.children(p))
        return sorted(set(pids))

    def start(self) -> None:
        t = self.cfg.trace
        pids = self._target_pids()
        opts = LoadOptions(
            ringbuf_pages=t.ringbuf_mib * 256, max_payload=t.capture_bytes,
            target_pids=pids, tls=t.tls, ssl_libraries=t.ssl_libraries,
        )
        self.kernel = load(cuda_options(opts, self._gpu_cfg))
        source = self._source_factory(self.kernel)
        offset = clock_offset_ns()
        builder = SpanBuilder(clock_offset_ns=offset)
        self._rescans = Rescans(self._check_libraries)
        self.tracer = Tracer(
            source, self.sink, builder, procfs=self.procfs, port=t.port or None,
            on_process_exec=self._on_exec, on_process_exit=self.kernel.forget_pid,
            idle_ns=int(t.idle_timeout_s * 1e9),
        )
        self.tracer.prefill(pids or self.procfs.pids(), self.kernel.register_conn)
        self.gpu = GpuSignals.from_kernel(self.kernel, self._gpu_cfg, proc_root=self.procfs.root,
                                          clock_offset_ns=offset)
        self.gpu.install(self.tracer)

    def _on_exec(self, pid: int) -> None:
        if self._rescans is not None and (self.cfg.trace.tls or self._gpu_cfg.cuda):
            self._rescans.schedule(pid)

    def _check_libraries(self, pid: int) -> None:
        if self.kernel is None:
            return
        for lib in mapped_libraries(pid, "libssl", self.procfs.root):
            if lib not in self.kernel.attached_libraries():
                self.kernel.attach_uprobes(lib, TLS_UPROBES)
        if self.gpu is not None:
            self.gpu.check_process(pid)  # libcuda, probed once per file

    def step(self) -> None:
        assert self.tracer is not None and self._rescans is not None
        self.tracer.poll(self.cfg.trace.poll_ms)
        self._rescans.run_due()
        if self.gpu is not None:
            self.gpu.poll()

    def run(self, stop: threading.Event, duration_s: float | None = None) -> None:
        deadline = time.monotonic() + duration_s if duration_s else None
        while not stop.is_set():
            self.step()
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._maybe_write_stats()
        self.drain()

    def drain(self) -> None:
        """Read what is left in the ring, then flush every pending exchange."""
        assert self.tracer is not None
        for _ in range(50):
            if not self.tracer.poll(0):
                break
        self.tracer.close_all()
        if self.gpu is not None:
            self.gpu.stop()
        self._maybe_write_stats(force=True)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tracer is not None:
            s = asdict(self.tracer.stats)
            out["tracer"] = s
        if self.kernel is not None:
            names = {k.value: k.name.lower() for k in Kind}
            out["kernel_seen"] = {names.get(k, str(k)): v for k, v in self.kernel.counters("seen").items()}
            out["kernel_lost"] = {names.get(k, str(k)): v for k, v in self.kernel.counters("lost").items()}
            out["probes"] = [asdict(s) for s in self.kernel.report.statuses if not s.ok]
            out["uprobe_libraries"] = sorted(self.kernel.attached_libraries())
        out["time_unix"] = time.time()
        return out

    def _maybe_write_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_write < 5:
            return
        self._last_stats_write = now
        try:
            STATS_PATH.parent.mkdir(parents=True, exist_ok=True)
            tmp = STATS_PATH.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.stats(), indent=1))
            tmp.replace(STATS_PATH)
        except OSError:
            pass  # stats are a convenience; never fatal


def lost_total(stats: dict[str, Any]) -> int:
    return int(sum(stats.get("kernel_lost", {}).values()))


def format_stats_lines(stats: dict[str, Any]) -> Sequence[str]:
    t = stats.get("tracer", {})
    p = t.get("parser", {})
    return [
        f"records={t.get('records', 0)} spans={t.get('spans', 0)} "
        f"decode_errors={t.get('decode_errors', 0)} lost_in_kernel={lost_total(stats)} "
        f"parser_resyncs={p.get('resyncs', 0)} parser_malformed={p.get('malformed', 0)}",
    ]
