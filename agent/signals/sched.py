"""CPU signals from bpf/sched.c: run-queue delay of traced threads, per span and per second.

The kernel adds each run-queue wait of a tracked thread to its counter in `runq_threads` (the
same quantity as /proc/<tid>/schedstat's second field), to its process's totals in
`runq_procs` and to a per-process log2 histogram `runq_hist`. Every EV_DATA carries the
calling thread's run-queue wait total (`runq_us`): the scheduler's own,
task_struct.sched_info.run_delay, where the kernel has BTF (bpf/events.h), else that counter;
so the agent knows it exactly at the exit of each read and write.

Span attributes (SchedSignals.annotate, from the counters the HTTP parser kept at each
exchange's ends: Exchange.runq_*):
  sits.cpu.runq_delay_us     run-queue wait of the serving thread between the exit of the read
                             that carried the request's first byte and the exit of the write
                             that carried the response's last byte (waits completed in that
                             window); when several threads served it, the sum of each one's
                             waits between its own first and last I/O in the window (a lower
                             bound)
  sits.cpu.runq_threads      how many threads did the span's I/O
  sits.cpu.runq_delay_exact  false when the value is a lower bound (several threads, or the
                             first or last I/O of the span not seen)
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from sits_trace.agent.capture.bpfmaps import MapAccess, u32, u64
from sits_trace.agent.capture.probes import Tracepoint
from sits_trace.agent.capture.wire import RUNQ_SLOTS, RunqHistKeyC, RunqProcC, RunqThreadC
from sits_trace.agent.model import Exchange, Span

SCHED_PROGRAM = "sched.c"
SCHED_TRACEPOINTS: tuple[Tracepoint, ...] = (
    Tracepoint("sched", "sched_wakeup", "sched", False),
    Tracepoint("sched", "sched_wakeup_new", "sched", False),
    Tracepoint("sched", "sched_switch", "sched", False),
)
_WRAP = 1 << 32  # EV_DATA.runq_us is the low 32 bits of the counter in microseconds
_TID_WORDS = 65536  # bpf/events.h SITS_TID_WORDS: runq_tid_bits, a bit a thread id


@dataclass(frozen=True, slots=True)
class RunqCounter:
    delay_ns: int  # run-queue wait of the waits timed
    count: int  # waits timed
    tgid: int
    untimed: int  # runs whose wait was not seen (lower bound then), see sched.c


def decode_runq_thread(raw: bytes) -> RunqCounter:
    t = RunqThreadC.from_buffer_copy(raw[: ctypes.sizeof(RunqThreadC)])
    return RunqCounter(t.delay_ns, t.count, t.tgid, t.untimed)


@dataclass(slots=True)
class ProcRunq:
    """One process over one interval."""

    delay_s_per_s: float  # run-queue wait summed over its threads, per second of wall time
    waits_per_s: float
    mean_wait_us: float
    hist_log2_us: list[int]  # waits in the interval by log2(wait in microseconds)


@dataclass(slots=True)
class SchedSample:
    interval_s: float
    procs: dict[int, ProcRunq]


def runq_between(counters: list[int]) -> int:
    """Microseconds waited over consecutive snapshots of a thread's runq_us, modulo 2^32; a
    step back (the thread's counter restarted) adds nothing."""
    total = 0
    for a, b in zip(counters, counters[1:]):
        d = (b - a) % _WRAP
        if d < _WRAP // 2:
            total += d
    return total


class SchedSignals:
    """Reads bpf/sched.c's maps, annotates spans."""

    def __init__(self, maps: MapAccess, *, proc_root: str = "/proc",
                 monotonic_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.maps = maps
        self.proc_root = proc_root
        self._now = monotonic_ns
        self._last_ns = self._now()
        self._last_procs = self._procs()
        self._last_hist = self._hist()

    # ---- processes and threads ----

    def track_process(self, pid: int) -> int:
        """Track a process's threads from now (e.g. a traced process found at start);
        returns how many threads were added."""
        self.maps.update("sched_tgids", u32(pid), b"\x01")
        try:
            tids = [int(t) for t in os.listdir(f"{self.proc_root}/{pid}/task")]
        except OSError:
            return 0
        n = 0
        for tid in tids:
            if self.maps.lookup("runq_threads", u32(tid)) is None:
                self.maps.update("runq_threads", u32(tid), bytes(RunqThreadC(tgid=pid)))
                n += 1
            self._mark_tid(tid)
        return n

    def _mark_tid(self, tid: int) -> None:
        """Set the thread's bit in `runq_tid_bits` (bpf/events.h): sched.c's programs look at
        tracked threads only. A read-modify-write: a bit the kernel sets in the same word
        meanwhile can be lost, and comes back when that thread next leaves a CPU."""
        key = u32((tid >> 6) & (_TID_WORDS - 1))
        raw = self.maps.lookup("runq_tid_bits", key)
        word = int.from_bytes(raw, "little") if raw else 0
        self.maps.update("runq_tid_bits", key, u64(word | (1 << (tid & 63))))

    def thread(self, tid: int) -> RunqCounter | None:
        raw = self.maps.lookup("runq_threads", u32(tid))
        return decode_runq_thread(raw) if raw is not None else None

    # ---- spans ----

    def annotate(self, ex: Exchange, span: Span) -> None:
        """Tracer annotator: the sits.cpu.* attributes (see the module docstring), from the
        run-queue counters the parser kept at the exchange's ends (Exchange.runq_*)."""
        if not ex.runq_tid0:
            return  # the request's first read or write was not seen
        switches = ex.runq_switches
        if switches is None:  # one thread did every read and write in between
            delay = (ex.runq1 - ex.runq0) % _WRAP
            if delay >= _WRAP // 2:
                delay = 0  # a step back: the thread's counter restarted
            threads = 1
        else:
            # each thread's counter from its first to its last read or write in the span,
            # in order: the exchange's first, the two sides of each switch, its last
            per_tid: dict[int, list[int]] = {ex.runq_tid0: [ex.runq0]}
            for before, u_before, after, u_after in switches:
                per_tid.setdefault(before, []).append(u_before)
                per_tid.setdefault(after, []).append(u_after)
            per_tid.setdefault(ex.runq_tid1, []).append(ex.runq1)
            delay = sum(runq_between(s) for s in per_tid.values())
            threads = len(per_tid)
        attrs = span.attributes
        attrs["sits.cpu.runq_delay_us"] = delay
        attrs["sits.cpu.runq_threads"] = threads
        attrs["sits.cpu.runq_delay_exact"] = threads == 1 and ex.runq_ends

    # ---- per-second numbers ----

    def proc_totals(self) -> dict[int, tuple[int, int]]:
        """Per tracked process since its tracking began: (run-queue wait ns, waits)."""
        return self._procs()

    def _procs(self) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for k, v in self.maps.items("runq_procs"):
            p = RunqProcC.from_buffer_copy(v[: ctypes.sizeof(RunqProcC)])
            out[int.from_bytes(k[:4], "little")] = (p.delay_ns, p.count)
        return out

    def _hist(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for k, v in self.maps.items("runq_hist"):
            hk = RunqHistKeyC.from_buffer_copy(k[: ctypes.sizeof(RunqHistKeyC)])
            if hk.slot < RUNQ_SLOTS:
                out.setdefault(hk.tgid, [0] * RUNQ_SLOTS)[hk.slot] = int.from_bytes(v[:8], "little")
        return out

    def sample(self) -> SchedSample:
        now = self._now()
        dt = max((now - self._last_ns) / 1e9, 1e-9)
        procs, hist = self._procs(), self._hist()
        out: dict[int, ProcRunq] = {}
        for tgid, (delay, count) in procs.items():
            d0, c0 = self._last_procs.get(tgid, (0, 0))
            h0 = self._last_hist.get(tgid, [0] * RUNQ_SLOTS)
            h = hist.get(tgid, [0] * RUNQ_SLOTS)
            dd, dc = delay - d0, count - c0
            out[tgid] = ProcRunq(dd / 1e9 / dt, dc / dt, dd / dc / 1e3 if dc else 0.0,
                                 [max(0, a - b) for a, b in zip(h, h0)])
        self._last_ns, self._last_procs, self._last_hist = now, procs, hist
        return SchedSample(dt, out)
