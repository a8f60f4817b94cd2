"""CPU reservations for the served process's busiest threads: SCHED_DEADLINE, reversibly.

For cpu_starvation, throttling the culprit (actuators.py) takes CPU from it; a reservation
gives CPU to the victim instead, whoever competes: each of the served process's busiest
threads gets `runtime` every `period` before any normal task runs, sized from what the thread
wanted just before (headroom x its time running and waiting to run). Flags: SCHED_FLAG_RECLAIM (a thread may run past its
runtime while the CPU has DEADLINE bandwidth to spare: a floor, not a ceiling; measured here: a
2 ms / 10 ms spinning thread got 0.94 of a CPU alone with it, 0.21 without) and
SCHED_FLAG_RESET_ON_FORK (a DEADLINE thread may not fork otherwise; children start normal).

Bounded: at most `max_threads` threads of one process, together at most `max_cpus` CPUs of
reservation, never the agent; the kernel's own admission control (95% of each CPU for
real-time and deadline tasks) may refuse, and then nothing stays applied. Reversible: `revert`
gives every thread still alive the policy, nice value and flags it had; what was done is
written to a state file, so an agent that died is undone by the next one's `revert_stale()`.
A thread that exits takes its reservation with it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .actuators import ActuatorError, descendants

SCHED_DEADLINE = 6
SCHED_FLAG_RESET_ON_FORK = 0x01
SCHED_FLAG_RECLAIM = 0x02
# the reservation a thread shrinks to before it leaves SCHED_DEADLINE (Sched.restore): the
# kernel's smallest runtime (2**DL_SCALE ns) every second, a millionth of a CPU
_RELEASE_RUNTIME_NS = 1 << 10
_RELEASE_PERIOD_NS = 10**9
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # sched_setattr, sched_getattr


class SchedAttr(ctypes.Structure):
    """struct sched_attr (include/uapi/linux/sched/types.h), SCHED_ATTR_SIZE_VER1."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("sched_util_min", ctypes.c_uint32), ("sched_util_max", ctypes.c_uint32)]


@dataclass(frozen=True)
class Policy:
    """What a thread had before: restored as it was."""

    policy: int
    flags: int
    nice: int
    priority: int


class Sched:
    """sched_getattr / sched_setattr through libc's syscall()."""

    def __init__(self) -> None:
        nums = _SYSCALLS.get(platform.machine())
        if nums is None:
            raise ActuatorError(f"SCHED_DEADLINE: no syscall numbers for {platform.machine()}")
        self._set, self._get = nums
        self._libc = ctypes.CDLL(None, use_errno=True)

    def get(self, tid: int) -> Policy:
        a = SchedAttr()
        if self._libc.syscall(self._get, tid, ctypes.byref(a), ctypes.sizeof(a), 0) != 0:
            raise _oserror(f"sched_getattr({tid})")
        return Policy(int(a.sched_policy), int(a.sched_flags), int(a.sched_nice),
                      int(a.sched_priority))

    def set(self, tid: int, attr: SchedAttr) -> None:
        attr.size = ctypes.sizeof(SchedAttr)
        if self._libc.syscall(self._set, tid, ctypes.byref(attr), 0) != 0:
            raise _oserror(f"sched_setattr({tid})")

    def reserve(self, tid: int, runtime_ns: int, period_ns: int) -> None:
        self.set(tid, SchedAttr(sched_policy=SCHED_DEADLINE,
                                sched_flags=SCHED_FLAG_RESET_ON_FORK | SCHED_FLAG_RECLAIM,
                                sched_runtime=runtime_ns, sched_deadline=period_ns,
                                sched_period=period_ns))

    def restore(self, tid: int, p: Policy) -> None:
        """Back to the policy it had. A DEADLINE thread first shrinks to the smallest
        reservation (1 us every second): the kernel returns a thread's bandwidth to the
        admission pool at once when its parameters change, but only at its "0-lag" time when
        it leaves the class, and on this VM's 6.18 kernel a thread that was sleeping then
        never returns it (measured: every undo of a reservation leaked its bandwidth until
        admission refused all; docs/control.md)."""
        if p.policy != SCHED_DEADLINE:
            try:
                self.set(tid, SchedAttr(sched_policy=SCHED_DEADLINE, sched_runtime=_RELEASE_RUNTIME_NS,
                                        sched_deadline=_RELEASE_PERIOD_NS,
                                        sched_period=_RELEASE_PERIOD_NS))
            except OSError as e:
                if e.errno == errno.ESRCH:
                    raise
        self.set(tid, SchedAttr(sched_policy=p.policy, sched_flags=p.flags, sched_nice=p.nice,
                                sched_priority=p.priority))


def _oserror(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


@dataclass
class Reservation:
    """One process's reserved threads: who, why, how much, what they had."""

    cause: str
    pid: int
    name: str
    period_ns: int
    runtime_ns: dict[int, int] = field(default_factory=dict)  # tid -> runtime per period
    demand_cpus: dict[int, float] = field(default_factory=dict)  # tid -> measured before
    previous: dict[int, Policy] = field(default_factory=dict)
    applied: bool = False
    started_unix: float = 0.0

    @property
    def cpus(self) -> float:
        return sum(self.runtime_ns.values()) / self.period_ns

    def to_json(self) -> dict[str, Any]:
        return {"kind": "cpu_reservation", "cause": self.cause, "pid": self.pid,
                "name": self.name, "threads": sorted(self.runtime_ns),
                "runtime_us": {str(t): r // 1000 for t, r in sorted(self.runtime_ns.items())},
                "period_us": self.period_ns // 1000, "reserved_cpus": round(self.cpus, 3),
                "applied": self.applied}


class DeadlineReserver:
    def __init__(self, *, period_ms: float = 10.0, headroom: float = 2.0, max_threads: int = 4,
                 max_cpus: float = 0.5, min_demand_cpus: float = 0.01, sample_s: float = 0.2,
                 state_path: Path | None = None, proc_root: Path = Path("/proc"),
                 sched: Sched | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.period_ns = int(period_ms * 1e6)
        self.headroom = headroom
        self.max_threads = max_threads
        self.max_cpus = max_cpus
        self.min_demand = min_demand_cpus
        self.sample_s = sample_s
        self.state_path = state_path
        self.proc = proc_root
        self.sched = sched or Sched()
        self._sleep = sleep
        self.active: dict[int, Reservation] = {}
        self._demand: dict[int, tuple[int, float]] = {}  # culprit -> (run + wait ns, at)

    # -- planning ----------------------------------------------------------------------------

    def _run_ns(self, pid: int) -> dict[int, int]:
        """tid -> ns on a CPU plus ns waiting for one (schedstat), every thread of `pid`."""
        out: dict[int, int] = {}
        try:
            tids = os.listdir(self.proc / str(pid) / "task")
        except OSError:
            return out
        for t in tids:
            try:
                f = (self.proc / str(pid) / "task" / t / "schedstat").read_text().split()
                out[int(t)] = int(f[0]) + int(f[1])
            except (OSError, ValueError, IndexError):
                continue
        return out

    def demand(self, pid: int) -> dict[int, float]:
        """CPUs each thread of `pid` wanted over `sample_s`: time on a CPU plus time waiting
        for one (schedstat), so a starved thread is sized by what it needs, not by the
        little it got."""
        a = self._run_ns(pid)
        t0 = time.monotonic()
        self._sleep(self.sample_s)
        b = self._run_ns(pid)
        dt = max(time.monotonic() - t0, self.sample_s, 1e-3)
        return {t: (b[t] - a.get(t, b[t])) / 1e9 / dt for t in b}

    def plan(self, cause: str, pid: int, name: str = "") -> Reservation:
        if pid <= 1 or pid == os.getpid():
            raise ActuatorError(f"will not reserve CPU for pid {pid}")
        busy = sorted(((c, t) for t, c in self.demand(pid).items() if c >= self.min_demand),
                      reverse=True)[: self.max_threads]
        if not busy:
            raise ActuatorError(f"pid {pid} has no thread using {self.min_demand:g} CPU")
        r = Reservation(cause, pid, name, self.period_ns)
        left = self.max_cpus * self.period_ns
        for c, t in busy:
            want = max(int(0.05 * self.period_ns), int(c * self.headroom * self.period_ns))
            run = int(min(want, 0.9 * self.period_ns, left))
            if run < int(0.05 * self.period_ns):
                break
            r.runtime_ns[t], r.demand_cpus[t] = run, round(c, 4)
            left -= run
        return r

    # -- acting --------------------------------------------------------------------------------

    def apply(self, r: Reservation) -> Reservation:
        """All threads or none: a refusal (a thread gone, no permission) undoes the rest. The
        kernel's admission control (EBUSY: other deadline tasks hold the bandwidth) is met by
        halving a thread's runtime down to 5% of the period; what was admitted is recorded."""
        done: list[int] = []
        try:
            for tid, run in list(r.runtime_ns.items()):
                r.previous[tid] = self.sched.get(tid)
                r.runtime_ns[tid] = self._reserve_admitted(tid, run, r.period_ns)
                done.append(tid)
        except OSError as e:
            for tid in done:
                self._restore(tid, r.previous[tid])
            why = "the kernel's deadline admission control refused" if e.errno == errno.EBUSY \
                else str(e)
            raise ActuatorError(f"cannot reserve {r.cpus:.2f} CPU for pid {r.pid}: {why}") from None
        r.applied, r.started_unix = True, time.time()
        self.active[r.pid] = r
        self._save()
        return r

    def _reserve_admitted(self, tid: int, run: int, period: int) -> int:
        while True:
            try:
                self.sched.reserve(tid, run, period)
                return run
            except OSError as e:
                if e.errno != errno.EBUSY or run // 2 < int(0.05 * period):
                    raise
                run //= 2

    def revert(self, pid: int) -> Reservation | None:
        r = self.active.pop(pid, None)
        if r is not None:
            for tid, p in r.previous.items():
                self._restore(tid, p)
            r.applied = False
            self._save()
        return r

    def revert_all(self) -> list[Reservation]:
        return [r for pid in list(self.active) if (r := self.revert(pid)) is not None]

    def culprit_demand(self, pid: int) -> float | None:
        """CPUs the culprit and its descendants wanted since the last call (time on a CPU plus
        time waiting for one, every thread's schedstat): a competitor held back by the
        reservation still shows its demand, so the reservation is not undone because it
        worked. None on the first call or once the culprit is gone."""
        if not (self.proc / str(pid)).exists():
            self._demand.pop(pid, None)
            return None
        ns = sum(sum(self._run_ns(p).values()) for p in [pid, *descendants(self.proc, pid)])
        now = time.monotonic()
        prev = self._demand.get(pid)
        self._demand[pid] = (ns, now)
        if prev is None or now <= prev[1]:
            return None
        return max(0, ns - prev[0]) / 1e9 / (now - prev[1])

    def alive(self, r: Reservation) -> bool:
        return any((self.proc / str(r.pid) / "task" / str(t)).exists() for t in r.runtime_ns)

    def _restore(self, tid: int, p: Policy) -> None:
        try:
            if self.sched.get(tid).policy == SCHED_DEADLINE:  # still ours; a changed one is not
                self.sched.restore(tid, p)
        except OSError:
            pass  # the thread exited: its reservation went with it

    # -- crash safety ----------------------------------------------------------------------

    def _save(self) -> None:
        if self.state_path is None:
            return
        rows = [{"pid": r.pid, "previous": {str(t): asdict(p) for t, p in r.previous.items()}}
                for r in self.active.values()]
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(self.state_path)
        except OSError:
            pass

    def revert_stale(self) -> int:
        """Undo what a previous agent left (its state file); returns the threads restored."""
        if self.state_path is None:
            return 0
        try:
            rows = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return 0
        n = 0
        for row in rows if isinstance(rows, list) else []:
            for t, p in dict(row.get("previous", {})).items():
                try:
                    if self.sched.get(int(t)).policy == SCHED_DEADLINE:
                        self.sched.restore(int(t), Policy(**p))
                        n += 1
                except (OSError, TypeError, ValueError):
                    continue
        self.state_path.unlink(missing_ok=True)
        return n
