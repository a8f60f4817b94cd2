"""CPU signals from bpf/sched.c: run-queue delay of traced threads, per span and per second.

The kernel adds each run-queue wait of a tracked thread to its counter in `runq_threads` (the
same quantity as /proc/<tid>/schedstat's second field), to its process's totals in
`runq_procs` and to a per-process log2 histogram `runq_hist`. http.c copies the calling
thread's counter into every EV_DATA (`runq_us`), so the agent knows it exactly at the exit of
each read and write.

Span attributes (SchedSignals.annotate, fed by SchedSignals.on_data):
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

import collections
import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from sits_trace.agent.capture.bpfmaps import MapAccess, u32
from sits_trace.agent.capture.events import DataEvent
from sits_trace.agent.capture.probes import Tracepoint
from sits_trace.agent.capture.wire import RUNQ_SLOTS, RunqHistKeyC, RunqProcC, RunqThreadC
from sits_trace.agent.model import Direction, Exchange, Span

SCHED_PROGRAM = "sched.c"
SCHED_TRACEPOINTS: tuple[Tracepoint, ...] = (
    Tracepoint("sched", "sched_wakeup", "sched", False),
    Tracepoint("sched", "sched_wakeup_new", "sched", False),
    Tracepoint("sched", "sched_switch", "sched", False),
)
_INGRESS = Direction.INGRESS
_WRAP = 1 << 32  # EV_DATA.runq_us is the low 32 bits of the counter in microseconds


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


# one read/write seen: (exit ns, tid, the tid's runq_us then), a tuple (one per record)
_Obs = tuple[int, int, int]


def runq_between(samples: list[tuple[int, int]]) -> int:
    """Microseconds waited over consecutive snapshots (tid's runq_us), modulo 2^32; a step
    back (the thread's counter restarted) adds nothing."""
    total = 0
    for (_, a), (_, b) in zip(samples, samples[1:]):
        d = (b - a) % _WRAP
        if d < _WRAP // 2:
            total += d
    return total


class _ConnObs:
    """One connection's reads and writes seen, oldest first, from index r0 / w0 on (reads
    kept apart from writes so a long stream's writes don't push the request's first read
    out; each side keeps at most `per_conn`)."""

    def __init__(self) -> None:
        self.reads: list[_Obs] = []
        self.writes: list[_Obs] = []
        self.r0 = 0
        self.w0 = 0


def _window(q: list[_Obs], i: int, start: int, end: int, out: list[_Obs]) -> int:
    """Append q's observations from index i on that end in [start, end] to `out`; returns
    the index of the first one not before `start` (those before it are forgotten)."""
    n = len(q)
    while i < n and q[i][0] < start:
        i += 1
    for j in range(i, n):  # a loop, not a generator: this runs for every span
        o = q[j]
        if o[0] <= end:
            out.append(o)
    return i


def _compact(q: list[_Obs], i: int) -> int:
    """Drop q's forgotten prefix (before index i) once it is over half of q and over 64
    entries; returns the index of the first kept one. Amortized O(1) per entry, and q holds
    at most twice what is kept (plus 64) whether or not spans consume it."""
    if i > 64 and 2 * i > len(q):
        del q[:i]
        return 0
    return i


class SchedSignals:
    """Reads bpf/sched.c's maps, keeps the runq snapshots of EV_DATA, annotates spans."""

    def __init__(self, maps: MapAccess, *, proc_root: str = "/proc",
                 monotonic_ns: Callable[[], int] = time.monotonic_ns, max_conns: int = 4096,
                 per_conn: int = 256) -> None:
        self.maps = maps
        self.proc_root = proc_root
        self._now = monotonic_ns
        self._max_conns = max_conns
        self._per_conn = per_conn
        # per connection, least recently used first: its reads and writes seen
        self._conns: collections.OrderedDict[int, _ConnObs] = collections.OrderedDict()
        self._last_conn = 0  # the connection of the last record: already at the end
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
        return n

    def thread(self, tid: int) -> RunqCounter | None:
        raw = self.maps.lookup("runq_threads", u32(tid))
        return decode_runq_thread(raw) if raw is not None else None

    # ---- spans ----

    def on_data(self, ev: DataEvent) -> None:
        """Tracer data observer: keep the thread's runq snapshot at this read/write."""
        cid = ev.conn_id
        if not cid:
            return  # TLS plaintext of an unknown socket: no stable key here
        conns = self._conns
        c = conns.get(cid)
        if c is None:
            c = conns[cid] = _ConnObs()
            if len(conns) > self._max_conns:
                conns.popitem(last=False)
        elif cid != self._last_conn:  # the last record's connection is at the end already
            conns.move_to_end(cid)
        self._last_conn = cid
        o = (ev.ts_exit_ns, ev.tid, ev.runq_us)
        if ev.direction == _INGRESS:
            c.reads.append(o)
            if len(c.reads) - c.r0 > self._per_conn:
                c.r0 = _compact(c.reads, c.r0 + 1)  # the oldest falls out
        else:
            c.writes.append(o)
            if len(c.writes) - c.w0 > self._per_conn:
                c.w0 = _compact(c.writes, c.w0 + 1)

    def _take_window(self, conn_id: int, start: int, end: int) -> list[_Obs]:
        """The connection's observations inside [start, end], in time order; those before
        `start` are forgotten (the next exchange on it starts later)."""
        obs: list[_Obs] = []
        c = self._conns.get(conn_id)
        if c is None:
            return obs
        c.r0 = _compact(c.reads, _window(c.reads, c.r0, start, end, obs))
        c.w0 = _compact(c.writes, _window(c.writes, c.w0, start, end, obs))
        if len(obs) > 1:
            prev = -1
            for o in obs:  # usually in time order already (a read, then a write)
                if o[0] <= prev:
                    obs.sort()
                    break
                prev = o[0]
        return obs

    def annotate(self, ex: Exchange, span: Span) -> None:
        """Tracer annotator: the sits.cpu.* attributes (see the module docstring)."""
        start = ex.request.start_ns
        end = ex.response.end_ns if ex.response is not None else ex.request.end_ns
        win = self._take_window(ex.conn.conn_id, start, end)
        if not win:
            return
        tid = win[0][1]
        one = True
        for o in win:
            if o[1] != tid:
                one = False
                break
        if one:  # one thread did the span's I/O (the common case)
            delay = 0
            last = win[0][2]
            for o in win:
                d = (o[2] - last) % _WRAP
                if d < _WRAP // 2:
                    delay += d
                last = o[2]
            threads = 1
        else:
            per_tid: dict[int, list[tuple[int, int]]] = {}
            for ts, t, runq in win:
                per_tid.setdefault(t, []).append((ts, runq))
            delay = sum(runq_between(s) for s in per_tid.values())
            threads = len(per_tid)
        exact = (threads == 1 and ex.response is not None
                 and win[0][0] == start and win[-1][0] == end)
        attrs = span.attributes
        attrs["sits.cpu.runq_delay_us"] = delay
        attrs["sits.cpu.runq_threads"] = threads
        attrs["sits.cpu.runq_delay_exact"] = exact

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
