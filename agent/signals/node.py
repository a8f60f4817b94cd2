"""Node signals (TCP, CPU run queue) wired into the loader and the tracer.

    add = load_additions(NodeSignalConfig(), tracefs_root())
    kernel = load(extend_options(opts, add))
    node = NodeSignals.from_kernel(kernel)
    node.install(tracer)          # handlers, annotators
    node.track_processes(pids)    # threads of processes traced from the start
    FeatureFrame(providers=node.providers())   # per-second rows: tcp_*, cpu_runq_*
    counter_samples(node)         # cumulative counters, for a scrape-time collector

Feature-frame signals (sits_<signal> as metrics, see exporters/node_metrics.py):
  tcp_<total>_per_s             node TCP rates, one per TcpTotal (retransmits, resets_out,
                                resets_in, opens_active, ..., time_wait_entries)
  tcp_time_wait_sockets         sockets in TIME_WAIT now, by port (entity local_port<n> for
                                this side's port, peer_port<n> for the remote one)
  cpu_runq_delay_s_per_s        run-queue wait of a tracked process's threads, per second (pid)
  cpu_runq_waits_per_s, cpu_runq_mean_wait_us
Counters (counter_samples): sits_tcp_<total>_total, sits_cpu_runq_delay_seconds_total{pid},
sits_cpu_runq_waits_total{pid}.

All of it is optional: a missing tracepoint is compiled out (-DSITS_NO_<CAT>_<EVENT>) and
reported by doctor; a group whose tracepoints are all missing is simply not read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sits_trace.agent.capture.bpfmaps import BccMaps, MapAccess, recursion_misses
from sits_trace.agent.capture.events import Kind
from sits_trace.agent.capture.loader import Kernel, LoadOptions
from sits_trace.agent.capture.probes import Tracepoint, tracefs_root, tracepoint_checks
from sits_trace.agent.model import Check, Provider

from .sched import SCHED_PROGRAM, SCHED_TRACEPOINTS, SchedSample, SchedSignals
from .tcp import TCP_PROGRAM, TCP_TRACEPOINTS, TcpSample, TcpSignals

if TYPE_CHECKING:  # the pipeline imports the parser stack; only its type is needed here
    from sits_trace.agent.tracing.pipeline import Tracer


@dataclass(slots=True)
class NodeSignalConfig:
    tcp: bool = True
    sched: bool = True
    sched_all: bool = False  # every process's threads, not only those with traced connections


@dataclass(slots=True)
class LoadAdditions:
    programs: list[str] = field(default_factory=list)
    tracepoints: list[Tracepoint] = field(default_factory=list)
    defines: dict[str, int | str] = field(default_factory=dict)


def tracepoint_fields(root: Path | None, category: str, event: str) -> dict[str, str]:
    """Field name -> declared C type, from the tracepoint's tracefs format ({} if absent)."""
    if root is None:
        return {}
    try:
        text = (root / "events" / category / event / "format").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("field:"):
            continue
        decl = line[len("field:"):].split(";", 1)[0].strip()
        ctype, _, name = decl.rpartition(" ")
        out[name.split("[", 1)[0]] = ctype
    return out


def ephemeral_range(proc_root: str = "/proc") -> tuple[int, int]:
    try:
        lo, hi = Path(f"{proc_root}/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def tcp_defines(root: Path | None, proc_root: str = "/proc") -> dict[str, int | str]:
    """-D flags for tcp.c, from what this kernel's tracepoints carry (probed, not versioned)."""
    retrans = tracepoint_fields(root, "tcp", "tcp_retransmit_skb")
    rst = tracepoint_fields(root, "tcp", "tcp_send_reset")
    probe = tracepoint_fields(root, "tcp", "tcp_probe")
    lo, hi = ephemeral_range(proc_root)
    return {
        # 6.x: tcp_probe carries the socket: traced connections only (bpf/sockio.h)
        "SITS_TCP_PROBE_SK": int("skaddr" in probe),
        "SITS_TCP_RETRANS_ERR": int("err" in retrans),
        # 6.10+: struct sockaddr copies (saddr[28]); before: sport/dport and saddr_v6
        "SITS_TCP_RST_SOCKADDR": int("saddr_v6" not in rst),
        "SITS_TCP_RST_REASON": int(rst.get("reason", "").startswith("enum sk_rst_reason")),
        "SITS_EPHEMERAL_LO": lo,
        "SITS_EPHEMERAL_HI": hi,
    }


def load_additions(cfg: NodeSignalConfig, root: Path | None,
                   proc_root: str = "/proc") -> LoadAdditions:
    add = LoadAdditions()
    if cfg.tcp:
        add.programs.append(TCP_PROGRAM)
        add.tracepoints.extend(TCP_TRACEPOINTS)
        add.defines.update(tcp_defines(root, proc_root))
    if cfg.sched:
        add.programs.append(SCHED_PROGRAM)
        add.tracepoints.extend(SCHED_TRACEPOINTS)
        add.defines["SITS_SCHED"] = 1
        add.defines["SITS_SCHED_ALL"] = int(cfg.sched_all)
    return add


def extend_options(opts: LoadOptions, add: LoadAdditions) -> LoadOptions:
    return dataclasses.replace(
        opts,
        extra_programs=[*opts.extra_programs, *add.programs],
        extra_tracepoints=[*opts.extra_tracepoints, *add.tracepoints],
        extra_defines={**opts.extra_defines, **add.defines},
    )


def _any_present(kernel: Kernel, tps: Sequence[Tracepoint]) -> bool:
    names = {tp.name for tp in tps}
    return any(s.ok for s in kernel.report.statuses if s.name in names)


@dataclass(slots=True)
class NodeSample:
    tcp: TcpSample | None
    sched: SchedSample | None


class NodeSignals:
    def __init__(self, tcp: TcpSignals | None, sched: SchedSignals | None) -> None:
        self.tcp = tcp
        self.sched = sched

    @classmethod
    def from_kernel(cls, kernel: Kernel, proc_root: str = "/proc",
                    maps: MapAccess | None = None) -> NodeSignals:
        m = maps or BccMaps(kernel.bpf)
        programs = set(kernel.opts.extra_programs)
        tcp = TcpSignals(m) if TCP_PROGRAM in programs and _any_present(
            kernel, TCP_TRACEPOINTS) else None
        sched = SchedSignals(m, proc_root=proc_root) if SCHED_PROGRAM in programs and \
            _any_present(kernel, SCHED_TRACEPOINTS) else None
        return cls(tcp, sched)

    def install(self, tracer: Tracer) -> None:
        if self.tcp is not None:
            tracer.handlers[int(Kind.TCP_EVENT)] = self.tcp.on_record
            tracer.annotators.append(self.tcp.annotate)
            tracer.batch_observers.append(self.tcp.new_batch)
        if self.sched is not None:
            tracer.annotators.append(self.sched.annotate)

    def poll(self) -> None:
        """Nothing to drain each loop: the readers sample the maps when asked."""

    def check_process(self, pid: int) -> None:
        """No libraries to probe: tracepoints only."""

    def forget(self, pid: int) -> None:
        """The kernel's LRU maps age exited processes out."""

    def stop(self) -> None:
        """No thread of its own."""

    def track_processes(self, pids: Sequence[int]) -> None:
        """Processes traced from the start (--pid, or those with prefilled connections)."""
        if self.sched is not None:
            for pid in pids:
                self.sched.track_process(pid)

    def sample(self) -> NodeSample:
        return NodeSample(self.tcp.sample() if self.tcp else None,
                          self.sched.sample() if self.sched else None)

    def providers(self) -> dict[str, Provider]:
        """Feature-frame providers, one per group: each call samples its group's interval."""
        out: dict[str, Provider] = {}
        tcp, sched = self.tcp, self.sched
        if tcp is not None:
            out["tcp"] = lambda: tcp_features(tcp.sample())
        if sched is not None:
            out["cpu"] = lambda: sched_features(sched.sample(), sched.proc_root)
        return out


def tcp_features(s: TcpSample) -> Mapping[str | tuple[str, str], float]:
    out: dict[str | tuple[str, str], float] = {f"{k}_per_s": v for k, v in s.rates.items()}
    for (side, port), n in s.time_wait.items():
        out[("time_wait_sockets", f"{side}_port{port}")] = float(n)
    return out


def sched_features(s: SchedSample, proc_root: str = "/proc"
                   ) -> Mapping[str | tuple[str, str], float]:
    """Per process; one that exited is left out once it has no wait in the interval."""
    out: dict[str | tuple[str, str], float] = {}
    for pid, p in s.procs.items():
        if not p.waits_per_s and not os.path.exists(f"{proc_root}/{pid}"):
            continue
        ent = f"pid{pid}"
        out[("runq_delay_s_per_s", ent)] = p.delay_s_per_s
        out[("runq_waits_per_s", ent)] = p.waits_per_s
        out[("runq_mean_wait_us", ent)] = p.mean_wait_us
    return out


def doctor_checks() -> list[Check]:
    """One doctor row per group (tcp, sched): for doctor.EXTRA_CHECKS."""

    return tracepoint_checks([*TCP_TRACEPOINTS, *SCHED_TRACEPOINTS], tracefs_root())


def stats(node: NodeSignals, kernel: Kernel | None = None) -> dict[str, Any]:
    """What the agent's own stats file shows of node signals."""
    out: dict[str, Any] = {"tcp": node.tcp is not None, "sched": node.sched is not None,
                           "tcp_decode_errors": node.tcp.decode_errors if node.tcp else 0}
    if kernel is not None:
        out["program_misses"] = {k: v for k, v in program_misses(kernel).items() if v}
    return out


def program_misses(kernel: Kernel) -> dict[str, int]:
    """Per program: runs the kernel skipped because another BPF program was running on the CPU
    (tracepoint programs do not nest), i.e. events the counters never saw."""
    out: dict[str, int] = {}
    for name, fn in kernel.bpf.funcs.items():
        n = recursion_misses(fn.fd)
        if n is not None:
            out[name.decode() if isinstance(name, bytes) else str(name)] = n
    return out
