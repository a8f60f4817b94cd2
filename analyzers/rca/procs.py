"""Per-process CPU time, memory and faults from /proc, sampled about once a second: what
names the competing process behind cpu_starvation and host_memory_pressure.

One snapshot reads /proc/<pid>/stat and /proc/<pid>/schedstat (the main thread's time waiting
for a CPU) of every process (a few ms for a few hundred processes) and the node's pressure-stall
totals (/proc/pressure/{cpu,memory}). The analysis compares two
snapshots at a window's edges with those at the baseline's edges.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t_ns, "psi": self.psi,
                "procs": [[p, *v] for p, v in self.procs.items()]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProcSnapshot:
        procs = {int(r[0]): (str(r[1]), float(r[2]), float(r[3]), float(r[4]), float(r[5]),
                             int(r[6]) if len(r) > 6 else 0, float(r[7]) if len(r) > 7 else 0.0)
                 for r in d.get("procs", ())}
        return cls(int(d["t"]), procs, {k: float(v) for k, v in d.get("psi", {}).items()})


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


class ProcSampler:
    def __init__(self, proc_root: str = "/proc",
                 clock_ns: Callable[[], int] | None = None) -> None:
        self.root = proc_root
        self._clock = clock_ns or time.time_ns

    def snapshot(self) -> ProcSnapshot:
        snap = ProcSnapshot(self._clock())
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
        for res in ("cpu", "memory"):
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
    return ProcDelta(
        dt, dict(zip(keys, cpu.tolist())), dict(zip(keys, vb[:, 1].tolist())),
        dict(zip(keys, (vb[:, 1] - va[:, 1]).tolist())), dict(zip(keys, (d[:, 2] / dt).tolist())),
        {p: b.procs[p][0] for p in keys},
        {k: max(0.0, v - a.psi.get(k, v)) / dt for k, v in b.psi.items()},
        {p: b.procs[p][5] for p in keys},
        {p: max(0.0, b.procs[p][6] - a.procs.get(p, _NONE)[6]) / dt for p in keys},
    )


def shares_cpus(pid: int, victim: int) -> bool:
    """Whether two processes may run on a common CPU (affinity); True when unknown."""
    try:
        return bool(os.sched_getaffinity(pid) & os.sched_getaffinity(victim))
    except OSError:
        return True
