"""The agent: kernel programs + ring reader + tracer + library watcher, driven in one loop.

`sits-trace trace` and `sits-trace run` both drive an Agent; they differ in where
spans go and how long it runs. Beside the spans it keeps the node signals ([signals] in the
config): TCP and run-queue numbers (signals/node.py), CUDA and NVML (signals/gpu.py), each an
annotator of the spans, and the per-second feature frame they feed (`Agent.features`, an
analyzers.features.FeatureFrame, for RCA and the metrics exporters through `metric_samples()`).
The loop also owns the load shedder (`trace.cpu_budget`, capture/shedding.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from sits_trace.agent.capture.events import Kind
from sits_trace.agent.capture.loader import (
    EventSource,
    Kernel,
    LoadOptions,
    RingSource,
    load,
    ring_shedder,
    shedding,
)
from sits_trace.agent.capture.probes import (
    TLS_LIBRARIES,
    libraries_in,
    read_maps,
    ssl_executable,
    tracefs_root,
)
from sits_trace.agent.capture.shedding import LoadShedder
from sits_trace.agent.clock import realtime_offset_ns
from sits_trace.agent.config import STATS_PATH, Config
from sits_trace.agent.model import AgentStats, MetricSample, Span
from sits_trace.agent.signals import node as nodesignals
from sits_trace.agent.signals.base import Signal
from sits_trace.agent.signals.gpu import GpuSignalConfig, GpuSignals, cuda_options
from sits_trace.agent.signals.node import NodeSignalConfig, NodeSignals
from sits_trace.agent.sinks import BatchSink, deliver
from sits_trace.agent.tracing.pipeline import Rescans, SpanSink, Tracer
from sits_trace.agent.tracing.procfs import ProcFS
from sits_trace.agent.tracing.redact import QueryRedactor
from sits_trace.agent.tracing.spans import SpanBuilder
from sits_trace.analyzers.control.agent_hook import AgentControl
from sits_trace.analyzers.features import FeatureFrame
from sits_trace.exporters.node_metrics import counter_samples, cuda_counter_samples, metric_samples

if TYPE_CHECKING:
    from sits_trace.analyzers.rca.live import LiveRca
    from sits_trace.analyzers.rca.metrics import VerdictMetrics
    from sits_trace.analyzers.rca.verdict import Verdict

# SIGTERM to exit: the ring is read for at most this long after the probes are detached;
# exporters get STOP_FLUSH_S more (systemd's default TimeoutStopSec is 90 s; ours is 10)
DRAIN_S = 2.5
STOP_FLUSH_S = 3.0


def _tracefs() -> Path | None:
    try:
        return tracefs_root()
    except OSError:  # unreadable without privileges: load() ends that in one line
        return None


class Agent:
    def __init__(self, cfg: Config, sink: SpanSink, *, procfs: ProcFS | None = None,
                 wrap_source: Callable[[RingSource], EventSource] | None = None,
                 gpu: GpuSignalConfig | None = None) -> None:
        self.cfg = cfg
        sig = cfg.signals
        g = gpu or GpuSignalConfig()
        self._gpu_cfg = replace(g, cuda=g.cuda and sig.cuda, nvml=g.nvml and sig.nvml)
        self._node_cfg = NodeSignalConfig(tcp=sig.tcp, sched=sig.sched, sched_all=sig.sched_all)
        self.gpu: GpuSignals | None = None
        self.node: NodeSignals | None = None
        self.signals: list[Signal] = []  # node and gpu, driven in one loop
        self.features: FeatureFrame | None = None
        self.sink = sink
        self.procfs = procfs or ProcFS()
        self.kernel: Kernel | None = None
        self.tracer: Tracer | None = None
        self._wrap_source = wrap_source  # e.g. a recorder around the ring (`trace --record`)
        self._ring: RingSource | None = None
        self.shedder: LoadShedder | None = None  # the loop ticks it: trace.cpu_budget
        self._rescans: Rescans | None = None
        self._last_stats_write = 0.0
        self.drain_abandoned_bytes = 0  # ring bytes left unread at the stop deadline
        self.heartbeat = time.monotonic()  # last loop turn (the systemd watchdog reads it)
        self.control = self._control() if cfg.control.enabled else None  # docs/control.md
        if self.control is not None:
            self.sink = self.control.tee(sink)
        self.rca: LiveRca | None = None  # [rca] enabled: the live analysis (docs/rca.md)
        self.rca_metrics: VerdictMetrics | None = None
        self._rca_add: Callable[[Span], None] | None = None
        if cfg.rca.enabled:
            self._rca_setup()

    def _control(self) -> AgentControl:
        e = self.cfg.export
        sinks = []
        if e.otlp_endpoint:  # the OTel SDK only with a collector to send action records to
            from sits_trace.exporters.otlp_logs import otlp_action_log  # noqa: PLC0415

            sinks.append(otlp_action_log(e.otlp_endpoint, e.otlp_protocol or "grpc"))
        return AgentControl.build(self.cfg.control, proc_root=Path(self.procfs.root),
                                  on_action=sinks)

    def _rca_setup(self) -> None:
        """Spans also go to the RCA engine; verdicts become metrics (sits_rca_*) and, with the
        control loop on, its input."""
        # pandas and the model only when [rca] is on: `trace` and `run` without it never pay
        from sits_trace.analyzers.rca.live import LiveRca  # noqa: PLC0415
        from sits_trace.analyzers.rca.metrics import VerdictMetrics  # noqa: PLC0415
        from sits_trace.analyzers.rca.setup import build_engine  # noqa: PLC0415

        engine = build_engine(self.cfg.rca, self.cfg.slo, service_name=self.cfg.export.service_name,
                              frame=lambda: self.features.frame() if self.features else None,
                              live=True)
        self.rca_metrics = VerdictMetrics(fresh_s=2 * engine.s.window_s)
        sinks: list[Callable[[Verdict], None]] = [self.rca_metrics.observe]
        e = self.cfg.export
        if e.otlp_endpoint:  # verdicts beside the spans: OTLP log records (sits.rca.verdict)
            from sits_trace.exporters.otlp_logs import otlp_verdict_log  # noqa: PLC0415

            vlog = otlp_verdict_log(e.otlp_endpoint, e.otlp_protocol or "grpc", e.service_name)
            sinks.append(lambda v: vlog(v.to_json()))
        if self.control is not None:  # verdicts drive the closed loop (docs/control.md)
            pushed = self.control.pushed
            sinks.append(lambda v: pushed.push(v.to_json()))
        self.rca = LiveRca(engine, sinks)
        self._rca_add = engine.add
        self.sink = self._with_rca(self.sink)

    def _with_rca(self, sink: SpanSink) -> SpanSink:
        add = self._rca_add
        if add is None:
            return sink

        def both(span: Span) -> None:
            sink(span)
            add(span)

        def many(spans: list[Span]) -> None:
            deliver(sink, spans)
            for span in spans:
                add(span)

        return BatchSink(both, many)

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
        add = nodesignals.load_additions(self._node_cfg, _tracefs(), self.procfs.root)
        # both append to extra_programs/defines/tracepoints: they compose in either order
        self.kernel = load(nodesignals.extend_options(cuda_options(opts, self._gpu_cfg), add))
        ring = self._ring = RingSource(self.kernel)
        source = self._wrap_source(ring) if self._wrap_source is not None else ring
        self.shedder = ring_shedder(self.kernel, ring, t.cpu_budget)
        kernel, shedder = self.kernel, self.shedder
        offset = realtime_offset_ns()
        builder = SpanBuilder(clock_offset_ns=offset,
                              redactor=QueryRedactor(t.redact_query_keys))
        self._rescans = Rescans(self._check_libraries, traced=lambda: self._traced_pids(),
                                sweep_s=t.library_rescan_s)
        self.tracer = Tracer(
            source, self.sink, builder, procfs=self.procfs, port=t.port or None,
            on_process_exec=self._on_exec, on_process_exit=self._on_process_exit,
            idle_ns=int(t.idle_timeout_s * 1e9), shedding=lambda: shedding(kernel, shedder),
        )
        if t.mute_non_http:
            self.tracer.mute = self.kernel.mute_conn
        self.node = NodeSignals.from_kernel(self.kernel, proc_root=self.procfs.root)
        with_conns: set[int] = set()
        register = self.kernel.register_conn

        def prefill(pid: int, fd: int, conn_id: int, role: int) -> None:
            with_conns.add(pid)
            register(pid, fd, conn_id, role)

        self.tracer.prefill(pids or self.procfs.pids(), prefill)
        self.node.track_processes(sorted(set(pids) | with_conns))
        self.gpu = GpuSignals.from_kernel(self.kernel, self._gpu_cfg, proc_root=self.procfs.root,
                                          clock_offset_ns=offset)
        self.signals = [self.node, self.gpu]
        for s in self.signals:  # handlers, observers, annotators: node's first, then GPU's
            s.install(self.tracer)
        self.features = self._feature_frame(offset)
        if self.control is not None:
            self.control.start()
        if self.rca is not None:
            self.rca.start()

    def _feature_frame(self, offset: int) -> FeatureFrame | None:
        """The per-second frame of whatever signals this node has (GPU or not)."""
        assert self.node is not None and self.gpu is not None
        providers = {k: v for s in self.signals for k, v in s.providers().items()}
        if not self.cfg.signals.features or not (providers or self.gpu.sampler or self.gpu.cuda):
            return None
        frame = FeatureFrame(sampler=self.gpu.sampler, cuda=self.gpu.cuda, providers=providers,
                             keep_s=self.cfg.signals.features_keep_s, clock_offset_ns=offset)
        frame.start()
        return frame

    def _on_process_exit(self, pid: int, fds: list[int]) -> None:
        if self.kernel is not None and fds:
            self.kernel.forget_pid(pid, fds)
        for s in self.signals:
            s.forget(pid)  # its CUDA totals; a reused pid starts from zero

    def _on_exec(self, pid: int) -> None:
        if self._rescans is not None and (self.cfg.trace.tls or self._gpu_cfg.cuda):
            self._rescans.schedule(pid)
        if self.node is not None and self.cfg.trace.pids:
            # a traced process's child ran exec: its threads count from now (without --pid,
            # http.c starts tracking a process at its first traced read or write)
            self.node.track_processes([pid])

    def _traced_pids(self) -> list[int]:
        return self.tracer.traced_pids() if self.tracer is not None else []

    def _check_libraries(self, pid: int) -> None:
        if self.kernel is None:
            return
        attached = self.kernel.attached_libraries()
        root = self.procfs.root
        maps = read_maps(pid, root)  # once for every question below (every traced pid, often)
        for short, probes in TLS_LIBRARIES:
            for lib in libraries_in(maps, pid, short, root):
                if lib not in attached:
                    self.kernel.attach_uprobes(lib, probes)
        if self.cfg.trace.tls:
            exe = ssl_executable(pid, root, maps)  # OpenSSL inside the program (node)
            if exe is not None and exe not in attached:
                for _, probes in TLS_LIBRARIES:
                    self.kernel.attach_uprobes(exe, probes)
        for s in self.signals:
            s.check_process(pid)  # libcuda, probed once per file

    def step(self) -> None:
        assert self.tracer is not None and self._rescans is not None
        if self.shedder is not None:
            self.shedder.tick()
        self.tracer.poll(self.cfg.trace.poll_ms)
        self.heartbeat = time.monotonic()
        self._rescans.run_due()
        for s in self.signals:
            s.poll()

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
        sink = self._with_rca(sink)
        self.sink = sink
        if self.tracer is not None:
            self.tracer.sink = sink

    def set_cpu_budget(self, cores: float) -> None:
        self.cfg.trace.cpu_budget = cores
        if self.shedder is not None:
            self.shedder.budget = cores

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
        self.drain_abandoned_bytes = self._ring.pending_bytes() if self._ring is not None else 0
        self.tracer.close_all()
        if self.rca is not None:
            self.rca.stop()
        if self.features is not None:
            self.features.stop()
        for s in self.signals:
            s.stop()
        if self.control is not None:
            self.control.stop()  # undoes every action it took
        self._maybe_write_stats(force=True)

    def stats(self) -> AgentStats:
        out = AgentStats()
        if self.tracer is not None:
            out.tracer = asdict(self.tracer.stats)
        if self.kernel is not None:
            names = {k.value: k.name.lower() for k in Kind}
            seen, lost = self.kernel.counters("seen"), self.kernel.counters("lost")
            out.kernel_seen = {names.get(k, str(k)): v for k, v in seen.items()}
            out.kernel_lost = {names.get(k, str(k)): v for k, v in lost.items()}
            out.probes = [asdict(s) for s in self.kernel.report.statuses if not s.ok]
            out.uprobe_libraries = sorted(self.kernel.attached_libraries())
            if out.tracer is not None:
                # requests whose capture stopped after too many tiny reads (slowloris,
                # bpf/events.h), beside the tracer's counters
                try:
                    out.tracer["dribbles"] = sum(self.kernel.counters("dribbles").values())
                except KeyError:  # a kernel object without bpf/http.c
                    out.tracer["dribbles"] = 0
        if self.node is not None:
            out.node_signals = nodesignals.stats(self.node, self.kernel)
        if self.features is not None:
            out.features = {"rows": len(self.features)}
        if self.drain_abandoned_bytes:
            out.drain_abandoned_bytes = self.drain_abandoned_bytes
        out.time_unix = time.time()
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
        if self.control is not None:
            out.extend(self.control.metric_samples())
        if self.rca_metrics is not None:
            out.extend(self.rca_metrics.samples())
        return out

    def _maybe_write_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_write < 5:
            return
        self._last_stats_write = now
        try:
            STATS_PATH.parent.mkdir(parents=True, exist_ok=True)
            tmp = STATS_PATH.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.stats().to_json(), indent=1))
            tmp.replace(STATS_PATH)
        except OSError:
            pass  # stats are a convenience; never fatal


def lost_total(stats: AgentStats) -> int:
    return stats.lost_total


def format_stats_lines(stats: AgentStats) -> Sequence[str]:
    s = stats
    return [
        f"records={s.count('records')} spans={s.count('spans')} "
        f"decode_errors={s.count('decode_errors')} lost_in_kernel={s.lost_total} "
        f"exchanges_shed={s.count('exchanges_shed')} capture_shift={s.count('capture_shift')} "
        f"parser_resyncs={s.parser_count('resyncs')} "
        f"parser_malformed={s.parser_count('malformed')} "
        f"parser_internal_errors={s.parser_count('internal_errors')} "
        f"drain_abandoned_bytes={s.drain_abandoned_bytes or 0}",
        # what could not be traced, by cause (issue 10): the agent's own loss, requests past
        # the capture limit of one read, entries whose close event was lost
        (f"capture_lost={s.parser_count('capture_lost')} "
         f"requests_uncaptured={s.parser_count('requests_uncaptured')} "
         f"uncaptured_bytes={s.parser_count('uncaptured_bytes')} "
         f"tls_false_alarms={s.parser_count('tls_false_alarms')} "
         f"conns_expired={s.count('conns_expired')} conns_replaced={s.count('conns_replaced')} "
         f"conns_active={s.count('conns_active')} dribbles={s.count('dribbles')} "
         f"orphan_data={s.count('orphan_data')} "
         f"orphan_responses={s.parser_count('orphan_responses')} "
         f"conns_muted={s.count('conns_muted')}"),
    ]
