"""The agent: kernel programs + ring reader + tracer + library watcher, driven in one loop.

`sits-trace trace` and `sits-trace run` both drive an Agent; they differ in where
spans go and how long it runs. Beside the spans it keeps the node signals ([signals] in the
config): TCP and run-queue numbers (nodesignals), CUDA and NVML (gpusignals), each an annotator
of the spans, and the per-second feature frame they feed (`agent.features`, for RCA and the
metrics exporters through `metric_samples()`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from sits_trace.agent.capture.events import Kind
from sits_trace.agent.capture.loader import EventSource, Kernel, LoadOptions, RingSource, load
from sits_trace.agent.capture.probes import TLS_LIBRARIES, mapped_libraries, tracefs_root
from sits_trace.agent.model import MetricSample
from sits_trace.agent.signals import node as nodesignals
from sits_trace.agent.signals.gpu import GpuSignalConfig, GpuSignals, cuda_options
from sits_trace.agent.signals.node import NodeSignalConfig, NodeSignals
from sits_trace.agent.tracing.pipeline import Rescans, SpanSink, Tracer
from sits_trace.agent.tracing.procfs import ProcFS
from sits_trace.agent.tracing.redact import QueryRedactor
from sits_trace.agent.tracing.spans import SpanBuilder
from sits_trace.analyzers.features import FeatureFrame
from sits_trace.exporters.node_metrics import counter_samples, cuda_counter_samples, metric_samples

from .config import STATS_PATH, Config


# SIGTERM to exit: the ring is read for at most this long after the probes are detached;
# exporters get STOP_FLUSH_S more (systemd's default TimeoutStopSec is 90 s; ours is 10)
DRAIN_S = 2.5
STOP_FLUSH_S = 3.0


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


def _tracefs() -> Path | None:
    try:
        return tracefs_root()
    except OSError:  # unreadable without privileges: load() ends that in one line
        return None


class Agent:
    def __init__(self, cfg: Config, sink: SpanSink, *, procfs: ProcFS | None = None,
                 source_factory: Callable[[Kernel], EventSource] | None = None,
                 gpu: GpuSignalConfig | None = None) -> None:
        self.cfg = cfg
        sig = cfg.signals
        g = gpu or GpuSignalConfig()
        self._gpu_cfg = replace(g, cuda=g.cuda and sig.cuda, nvml=g.nvml and sig.nvml)
        self._node_cfg = NodeSignalConfig(tcp=sig.tcp, sched=sig.sched, sched_all=sig.sched_all)
        self.gpu: GpuSignals | None = None
        self.node: NodeSignals | None = None
        self.features: FeatureFrame | None = None
        self.sink = sink
        self.procfs = procfs or ProcFS()
        self.kernel: Kernel | None = None
        self.tracer: Tracer | None = None
        self._source_factory = source_factory or RingSource
        self._rescans: Rescans | None = None
        self._last_stats_write = 0.0
        self.drain_abandoned_bytes = 0  # ring bytes left unread at the stop deadline
        self.heartbeat = time.monotonic()  # last loop turn (the systemd watchdog reads it)

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
            target_pids=pids, tls=t.tls, ssl_libraries=t.ssl_libraries, cpu_budget=t.cpu_budget,
        )
        add = nodesignals.load_additions(self._node_cfg, _tracefs(), self.procfs.root)
        # both append to extra_programs/defines/tracepoints: they compose in either order
        self.kernel = load(nodesignals.extend_options(cuda_options(opts, self._gpu_cfg), add))
        source = self._source_factory(self.kernel)
        offset = clock_offset_ns()
        builder = SpanBuilder(clock_offset_ns=offset,
                              redactor=QueryRedactor(t.redact_query_keys))
        self._rescans = Rescans(self._check_libraries)
        self.tracer = Tracer(
            source, self.sink, builder, procfs=self.procfs, port=t.port or None,
            on_process_exec=self._on_exec, on_process_exit=self._on_process_exit,
            idle_ns=int(t.idle_timeout_s * 1e9),
        )
        self.node = NodeSignals.from_kernel(self.kernel, proc_root=self.procfs.root)
        self.node.install(self.tracer)
        with_conns: set[int] = set()
        register = self.kernel.register_conn

        def prefill(pid: int, fd: int, conn_id: int, role: int) -> None:
            with_conns.add(pid)
            register(pid, fd, conn_id, role)

        self.tracer.prefill(pids or self.procfs.pids(), prefill)
        self.node.track_processes(sorted(set(pids) | with_conns))
        self.gpu = GpuSignals.from_kernel(self.kernel, self._gpu_cfg, proc_root=self.procfs.root,
                                          clock_offset_ns=offset)
        self.gpu.install(self.tracer)
        self.features = self._feature_frame(offset)

    def _feature_frame(self, offset: int) -> FeatureFrame | None:
        """The per-second frame of whatever signals this node has (GPU or not)."""
        assert self.node is not None and self.gpu is not None
        providers = self.node.providers()
        if not self.cfg.signals.features or not (providers or self.gpu.sampler or self.gpu.cuda):
            return None
        frame = FeatureFrame(sampler=self.gpu.sampler, cuda=self.gpu.cuda, providers=providers,
                             keep_s=self.cfg.signals.features_keep_s, clock_offset_ns=offset)
        frame.start()
        return frame

    def _on_process_exit(self, pid: int, fds: list[int]) -> None:
        if self.kernel is not None and fds:
            self.kernel.forget_pid(pid, fds)
        if self.gpu is not None:
            self.gpu.forget(pid)  # its CUDA totals; a reused pid starts from zero

    def _on_exec(self, pid: int) -> None:
        if self._rescans is not None and (self.cfg.trace.tls or self._gpu_cfg.cuda):
            self._rescans.schedule(pid)
        if self.node is not None and self.cfg.trace.pids:
            # a traced process's child ran exec: its threads count from now (without --pid,
            # http.c starts tracking a process at its first traced read or write)
            self.node.track_processes([pid])

    def _check_libraries(self, pid: int) -> None:
        if self.kernel is None:
            return
        for short, probes in TLS_LIBRARIES:
            for lib in mapped_libraries(pid, short, self.procfs.root):
                if lib not in self.kernel.attached_libraries():
                    self.kernel.attach_uprobes(lib, probes)
        if self.gpu is not None:
            self.gpu.check_process(pid)  # libcuda, probed once per file

    def step(self) -> None:
        assert self.tracer is not None and self._rescans is not None
        self.tracer.poll(self.cfg.trace.poll_ms)
        self.heartbeat = time.monotonic()
        self._rescans.run_due()
        if self.gpu is not None:
            self.gpu.poll()

    def run(self, stop: threading.Event, duration_s: float | None = None, *,
            reload: threading.Event | None = None,
            on_reload: Callable[[], None] | None = None) -> None:
        """Trace until `stop` is set (or `duration_s` passed), then drain. A set `reload`
        (SIGHUP) calls `on_reload` between two reads."""
        deadline = time.monotonic() + duration_s if duration_s else None
        while not stop.is_set():
            self.step()
            if deadline is not None and time.monotonic() >= deadline:
                break
            if reload is not None and reload.is_set():
                reload.clear()
                if on_reload is not None:
                    on_reload()
            self._maybe_write_stats()
        self.drain()

    def set_sink(self, sink: SpanSink) -> None:
        """Spans go to `sink` from the next one on (a reload's new exporters)."""
        self.sink = sink
        if self.tracer is not None:
            self.tracer.sink = sink

    def set_cpu_budget(self, cores: float) -> None:
        self.cfg.trace.cpu_budget = cores
        shedder = getattr(self.tracer.source if self.tracer else None, "shedder", None)
        if shedder is not None:
            shedder.budget = cores

    def drain(self, deadline_s: float = DRAIN_S) -> None:
        """Stop: detach the probes (no new records), read what is queued in the ring for
        at most `deadline_s`, then flush every pending exchange. Records still queued at
        the deadline are counted (`drain_abandoned_bytes`), never waited for."""
        assert self.tracer is not None
        if self.kernel is not None:
            self.kernel.detach_all()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if not self.tracer.poll(0):
                break
        pending = getattr(self.tracer.source, "pending_bytes", None)
        self.drain_abandoned_bytes = int(pending()) if pending is not None else 0
        self.tracer.close_all()
        if self.features is not None:
            self.features.stop()
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
        if self.node is not None:
            out["node_signals"] = nodesignals.stats(self.node, self.kernel)
        if self.features is not None:
            out["features"] = {"rows": len(self.features)}
        if self.drain_abandoned_bytes:
            out["drain_abandoned_bytes"] = self.drain_abandoned_bytes
        out["time_unix"] = time.time()
        return out

    def metric_samples(self) -> list[MetricSample]:
        """Node signals as (name, labels, value), for a scrape-time metrics collector: the
        feature frame's newest row (gauges, DCGM names for GPU signals) and the kernel's
        cumulative CUDA, TCP and run-queue counters (`_total`)."""
        out: list[MetricSample] = []
        if self.features is not None:
            out.extend(metric_samples(self.features.latest(), self.features.devices))
        if self.gpu is not None and self.gpu.cuda is not None:
            out.extend(cuda_counter_samples(self.gpu.cuda.totals()))
        if self.node is not None:
            out.extend(counter_samples(self.node))
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
        f"exchanges_shed={t.get('exchanges_shed', 0)} capture_shift={t.get('capture_shift', 0)} "
        f"parser_resyncs={p.get('resyncs', 0)} parser_malformed={p.get('malformed', 0)} "
        f"drain_abandoned_bytes={stats.get('drain_abandoned_bytes', 0)}",
    ]
