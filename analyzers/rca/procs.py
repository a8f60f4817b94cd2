"""Per-process CPU time, memory and faults from /proc, sampled about once a second: what
names the competing process behind cpu_starvation and host_memory_pressure.

One snapshot reads /proc/<pid>/stat and /proc/<pid>/schedstat (the main thread's time waiting
for a CPU) of every process (a few ms for a few hundred processes) and the node's pressure-stall
totals (/proc/pressure/{cpu,memory}). The analysis compares two
snapshots at a window's edges with those at the baseline's edges.

A few watched processes (the engine's local dependencies) also get their whole run-queue wait,
every thread's including those that exited, from the kernel's taskstats (TGID query over generic
netlink, pyroute2; root). /proc only has it per thread: a thread-per-request server's waits live
in threads that are gone by the next snapshot (a CI run blamed a starved local dependency because
its main thread, parked in accept(), showed a fifth of the wait).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
_TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
_PAGE_MB = (os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096) / 2**20
ProcStat = tuple[str, float, float, float, float, int, float]
# comm, cpu s, rss MB, majflt, minflt, session id, run-queue wait s (main thread)


@dataclass(slots=True)
class ProcSnapshot:
    """The node's processes at one moment: pid -> (comm, cpu seconds, rss MB, major faults,
    minor faults, session id, seconds the main thread waited for a CPU), and pressure-stall
    totals in seconds."""

    t_ns: int
    procs: dict[int, ProcStat] = field(default_factory=dict)
    psi: dict[str, float] = field(default_factory=dict)  # "cpu_some", "memory_some", ...
    task_wait: dict[int, float] = field(default_factory=dict)  # watched: s, every thread

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t_ns, "psi": self.psi,
                               "procs": [[p, *v] for p, v in self.procs.items()]}
        if self.task_wait:
            out["task_wait"] = [[p, v] for p, v in self.task_wait.items()]
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProcSnapshot:
        procs = {int(r[0]): (str(r[1]), float(r[2]), float(r[3]), float(r[4]), float(r[5]),
                             int(r[6]) if len(r) > 6 else 0, float(r[7]) if len(r) > 7 else 0.0)
                 for r in d.get("procs", ())}
        return cls(int(d["t"]), procs, {k: float(v) for k, v in d.get("psi", {}).items()},
                   {int(p): float(v) for p, v in d.get("task_wait", ())})


def parse_stat(text: str) -> ProcStat | None:
    """(comm, cpu s, rss MB, majflt, minflt, session, 0.0) from one /proc/<pid>/stat line."""
    head, sep, rest = text.rpartition(")")
    if not sep:
        return None
    f = rest.split()
    try:  # after comm, from field 3 (state): session 6, minflt 10, majflt 12, utime 14,
        # stime 15, rss 24 (proc(5))
        cpu = (int(f[11]) + int(f[12])) / _TICK
        return (head.partition("(")[2], cpu, int(f[21]) * _PAGE_MB, float(f[9]), float(f[7]),
                int(f[3]), 0.0)
    except (IndexError, ValueError):
        return None


def parse_schedstat(text: str) -> float:
    """Seconds waited on a run queue, from /proc/<pid>/schedstat ("run_ns wait_ns slices")."""
    f = text.split()
    try:
        return int(f[1]) / 1e9
    except (IndexError, ValueError):
        return 0.0


def parse_psi(text: str) -> float | None:
    """Seconds some task stalled (the `some` line's total=, in microseconds)."""
    for line in text.splitlines():
        if line.startswith("some"):
            for part in line.split():
                if part.startswith("total="):
                    return int(part[6:]) / 1e6
    return None


class TaskWaits:
    """Seconds a whole process (every thread, live or exited) waited for a CPU: taskstats'
    cpu_delay_total for a TGID. Needs CAP_NET_ADMIN; off after the first failure (None)."""

    def __init__(self) -> None:
        self._sock: Any = None
        self.failed: str | None = None

    def _open(self) -> Any:
        from pyroute2.netlink import NLM_F_REQUEST  # noqa: PLC0415 - only when watching
        from pyroute2.netlink.taskstats import TASKSTATS_CMD_GET, AsyncTaskStats, TaskStats, tcmd  # noqa: PLC0415

        class _AsyncTgid(AsyncTaskStats):  # type: ignore[misc]
            async def get_tgid_stat(self, pid: int) -> Any:
                msg = tcmd()
                msg["cmd"] = TASKSTATS_CMD_GET
                msg["version"] = 1
                msg["attrs"].append(["TASKSTATS_CMD_ATTR_TGID", pid])
                return await self.nlm_request(msg, self.prid, msg_flags=NLM_F_REQUEST)

        class _Tgid(TaskStats):  # type: ignore[misc]
            async_class = _AsyncTgid

            def get_tgid_stat(self, pid: int) -> Any:
                return self._run_sync_cleanup(self.asyncore.get_tgid_stat, pid)

        sock = _Tgid()
        sock.bind()
        return sock

    def wait_s(self, pid: int) -> float | None:
        if self.failed is not None:
            return None
        try:
            if self._sock is None:
                self._sock = self._open()
            msg = self._sock.get_tgid_stat(pid)[0]
            stats = msg.get_attr("TASKSTATS_TYPE_AGGR_TGID").get_attr("TASKSTATS_TYPE_STATS")
            return int(stats["cpu_delay_total"]) / 1e9
        except Exception as exc:  # noqa: BLE001 - gone process, no netlink, no permission
            if "No such process" in str(exc) or getattr(exc, "code", None) == 3:
                return None  # ESRCH: the process exited; the reader stays on
            self.failed = f"{type(exc).__name__}: {exc}"
            self.close()
            return None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except Exception:  # noqa: BLE001
                pass
            self._sock = None


class ProcSampler:
    def __init__(self, proc_root: str = "/proc",
                 clock_ns: Callable[[], int] | None = None,
                 watch: Callable[[], Collection[int]] | None = None,
                 task_waits: TaskWaits | None = None) -> None:
        self.root = proc_root
        self._clock = clock_ns or time.time_ns
        self._watch = watch  # processes whose whole run-queue wait is read (taskstats)
        self._waits = task_waits
        self._warned = False

    def snapshot(self) -> ProcSnapshot:
        snap = ProcSnapshot(self._clock())
        for pid in self._watch() if self._watch is not None else ():
            if self._waits is None:
                self._waits = TaskWaits()
            v = self._waits.wait_s(pid)
            if v is not None:
                snap.task_wait[pid] = v
            elif self._waits.failed is not None and not self._warned:
                self._warned = True
                log.warning("rca: taskstats unavailable (%s): a local dependency's wait for a "
                            "CPU is its main thread's only", self._waits.failed)
        try:
            names = os.listdir(self.root)
        except OSError:
            return snap
        for name in names:
            if name.isdigit():
                st = _read(f"{self.root}/{name}/stat")
                parsed = parse_stat(st) if st else None
                if parsed is not None:
                    ss = _read(f"{self.root}/{name}/schedstat")
                    snap.procs[int(name)] = (*parsed[:6], parse_schedstat(ss) if ss else 0.0)
        for res in ("cpu", "memory", "io"):
            txt = _read(f"{self.root}/pressure/{res}")
            v = parse_psi(txt) if txt else None
            if v is not None:
                snap.psi[f"{res}_some"] = v
        return snap


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


@dataclass(slots=True)
class ProcDelta:
    """What each process did between two snapshots (per second of wall time)."""

    seconds: float
    cpu_cores: dict[int, float]  # CPU seconds per second
    rss_mb: dict[int, float]  # at the end
    rss_growth_mb: dict[int, float]
    majflt_per_s: dict[int, float]
    comm: dict[int, str]
    psi: dict[str, float]  # fraction of the time stalled
    session: dict[int, int] = field(default_factory=dict)  # session id (autogroup scheduling)
    runq_per_s: dict[int, float] = field(default_factory=dict)  # s waiting for a CPU per s
    # the same, every thread of the process (taskstats), watched processes in both snapshots
    task_wait_per_s: dict[int, float] = field(default_factory=dict)
    # processes that exited inside the interval: their last RSS (a memory competitor that
    # left just before the window's last snapshot is still the window's culprit)
    gone_rss_mb: dict[int, float] = field(default_factory=dict)


_NONE: ProcStat = ("", 0.0, 0.0, 0.0, 0.0, 0, 0.0)


def delta(a: ProcSnapshot, b: ProcSnapshot) -> ProcDelta:
    """b minus a; processes in b only count from zero (started inside the interval)."""
    dt = max((b.t_ns - a.t_ns) / 1e9, 1e-3)
    pids = np.fromiter(b.procs, dtype=np.int64, count=len(b.procs))
    vb = np.array([b.procs[p][1:5] for p in pids.tolist()], dtype=float).reshape(-1, 4)
    va = np.array([a.procs.get(p, _NONE)[1:5] for p in pids.tolist()], dtype=float).reshape(-1, 4)
    d = np.maximum(vb - va, 0.0)
    cpu = d[:, 0] / dt
    keys = pids.tolist()
    gone = {p: v for p, v in a.procs.items() if p not in b.procs}
    return ProcDelta(
        dt, dict(zip(keys, cpu.tolist())), dict(zip(keys, vb[:, 1].tolist())),
        dict(zip(keys, (vb[:, 1] - va[:, 1]).tolist())), dict(zip(keys, (d[:, 2] / dt).tolist())),
        {p: b.procs[p][0] for p in keys} | {p: v[0] for p, v in gone.items()},
        {k: max(0.0, v - a.psi.get(k, v)) / dt for k, v in b.psi.items()},
        {p: b.procs[p][5] for p in keys},
        {p: max(0.0, b.procs[p][6] - a.procs.get(p, _NONE)[6]) / dt for p in keys},
        task_wait_rates(a, b),
        {p: v[2] for p, v in gone.items()},
    )


def task_wait_rates(a: ProcSnapshot, b: ProcSnapshot) -> dict[int, float]:
    """Seconds waited for a CPU per second, every thread, of the watched processes in both."""
    dt = max((b.t_ns - a.t_ns) / 1e9, 1e-3)
    return {p: max(0.0, v - a.task_wait[p]) / dt for p, v in b.task_wait.items()
            if p in a.task_wait}


def shares_cpus(pid: int, victim: int) -> bool:
    """Whether two processes may run on a common CPU (affinity); True when unknown."""
    try:
        return bool(os.sched_getaffinity(pid) & os.sched_getaffinity(victim))
    except OSError:
        return True
