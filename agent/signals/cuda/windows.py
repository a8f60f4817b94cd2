"""Per-process CUDA activity in a span's window: cuda.c's records and slots, kept and queried.

The kernel counts launches and sync waits per process in slots of 2^slot_shift ns
(`cuda_slots`); every copy arrives as an EV_CUDA_COPY record and every allocation as
EV_CUDA_MEM. CudaSignals reads both and answers "what did process P do on the GPU between t0
and t1" (`window`), which the span annotator in signals/gpu.py turns into `sits.cuda.*`.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sits_trace.agent.capture.events import DecodeError
from sits_trace.agent.capture.wire import CopyDir, CudaSlotC, CudaSlotKeyC, Kind, MemOp

from .addrmap import AddressMap
from .maps import CudaMaps
from .records import CudaCopy, CudaTotals, decode_copy, decode_init, decode_mem, decode_totals

DEFAULT_SLOT_SHIFT = 20  # 1.048576 ms


@dataclass(slots=True)
class CudaWindow:
    """One process's CUDA activity between two CLOCK_MONOTONIC instants."""

    launches: int = 0
    graph_launches: int = 0
    syncs: int = 0
    sync_wait_ns: int = 0
    copies: dict[CopyDir, int] = field(default_factory=dict)  # direction -> count
    copy_bytes: dict[CopyDir, int] = field(default_factory=dict)
    copy_call_ns: int = 0  # time inside copy calls (for sync copies, the copy)
    slot_ns: int = 0  # resolution of launches and syncs (edge slots are prorated)
    seen: bool = False  # any CUDA activity of the process known around the window


@dataclass(slots=True)
class _Proc:
    # slot -> [launches, graph_launches, syncs, sync_ns, first_ns, last_ns, deleted (0/1)]
    slots: dict[int, list[int]] = field(default_factory=dict)
    copies: collections.deque[CudaCopy] = field(default_factory=collections.deque)
    addrs: AddressMap = field(default_factory=AddressMap)


class CudaSignals:
    """Decodes cuda.c's records, drains its slot map, answers per-process windows."""

    def __init__(self, maps: CudaMaps, *, slot_shift: int = DEFAULT_SLOT_SHIFT,
                 keep_s: float = 120.0, max_copies: int = 200_000,
                 monotonic_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.maps = maps
        self.slot_shift = slot_shift
        self.slot_ns = 1 << slot_shift
        self._keep_ns = int(keep_s * 1e9)
        self._max_copies = max_copies
        self._now = monotonic_ns
        self._procs: dict[int, _Proc] = {}
        self._lock = threading.Lock()
        self._read_upto_ns = 0  # slots were read at this instant
        self.decode_errors = 0
        self.copies_seen = 0
        self.resolved_directions = 0

    # ---- records ----

    def handlers(self) -> dict[int, Callable[[bytes], None]]:
        """kind -> handler, for Tracer.handlers."""
        return {int(Kind.CUDA_COPY): self.on_copy, int(Kind.CUDA_MEM): self.on_mem,
                int(Kind.CUDA_INIT): self.on_init}

    def _proc(self, pid: int) -> _Proc:
        p = self._procs.get(pid)
        if p is None:
            p = self._procs[pid] = _Proc()
        return p

    def on_copy(self, raw: bytes) -> None:
        try:
            c = decode_copy(raw)
        except DecodeError:
            self.decode_errors += 1
            return
        with self._lock:
            p = self._proc(c.pid)
            if c.direction is CopyDir.UNKNOWN:
                d = p.addrs.direction(c.dst, c.src)
                if d is not CopyDir.UNKNOWN:
                    self.resolved_directions += 1
                    c = _with_direction(c, d)
            p.copies.append(c)
            self.copies_seen += 1
            while len(p.copies) > self._max_copies:
                p.copies.popleft()

    def on_mem(self, raw: bytes) -> None:
        try:
            m = decode_mem(raw)
        except DecodeError:
            self.decode_errors += 1
            return
        with self._lock:
            addrs = self._proc(m.pid).addrs
            if m.op is MemOp.ALLOC:
                addrs.add(m.ptr, m.bytes, m.mem)
            else:
                addrs.remove(m.ptr)

    def on_init(self, raw: bytes) -> None:
        try:
            pid, _ = decode_init(raw)
        except DecodeError:
            self.decode_errors += 1
            return
        with self._lock:
            p = self._proc(pid)
            if not len(p.addrs):
                p.addrs.complete = True  # nothing allocated before: every allocation is ahead

    def forget(self, pid: int) -> None:
        with self._lock:
            self._procs.pop(pid, None)

    # ---- slots ----

    def poll(self) -> None:
        """Read the kernel's slots; delete those no CPU can still add to (two slots old)."""
        now = self._now()
        rows = self.maps.slots()
        old: list[bytes] = []
        horizon = (now >> self.slot_shift) - 2
        with self._lock:
            for k, v in rows:
                key = CudaSlotKeyC.from_buffer_copy(k[: ctypes.sizeof(CudaSlotKeyC)])
                val = CudaSlotC.from_buffer_copy(v[: ctypes.sizeof(CudaSlotC)])
                counts = [val.launches, val.graph_launches, val.syncs, val.sync_ns,
                          val.first_ns, val.last_ns, 0]
                slots = self._proc(key.tgid).slots
                prev = slots.get(key.slot)
                if prev is not None and prev[_DELETED]:
                    # deleted before, re-created by a late CPU: the new entry holds only the rest
                    counts = _merge_slot(prev, counts)
                if key.slot < horizon:
                    counts[_DELETED] = 1
                    old.append(k)
                slots[key.slot] = counts
            self._read_upto_ns = now
            self._expire(now)
        self.maps.delete_slots(old)

    def _expire(self, now: int) -> None:
        cut_ns = now - self._keep_ns
        cut_slot = cut_ns >> self.slot_shift
        for p in self._procs.values():
            for s in [s for s in p.slots if s < cut_slot]:
                del p.slots[s]
            while p.copies and p.copies[0].ts_enter_ns < cut_ns:
                p.copies.popleft()

    # ---- windows ----

    def window(self, pid: int, start_ns: int, end_ns: int) -> CudaWindow:
        """What `pid` did between start_ns and end_ns (CLOCK_MONOTONIC)."""
        if end_ns >= self._read_upto_ns:
            self.poll()  # the window's last slots may not have been read yet
        w = CudaWindow(slot_ns=self.slot_ns)
        with self._lock:
            p = self._procs.get(pid)
            if p is None:
                return w
            w.seen = bool(p.slots or p.copies)
            self._add_slots(w, p, start_ns, end_ns)
            for c in _copies_between(p.copies, start_ns, end_ns):
                w.copies[c.direction] = w.copies.get(c.direction, 0) + 1
                w.copy_bytes[c.direction] = w.copy_bytes.get(c.direction, 0) + c.bytes
                w.copy_call_ns += c.ts_exit_ns - c.ts_enter_ns
        return w

    def _add_slots(self, w: CudaWindow, p: _Proc, start_ns: int, end_ns: int) -> None:
        """Slots inside the window count whole; a slot that straddles an edge counts the share
        of its activity interval [first_ns, last_ns] that lies inside."""
        first, last = start_ns >> self.slot_shift, end_ns >> self.slot_shift
        acc = [0.0, 0.0, 0.0, 0.0]
        for s in range(first, last + 1):
            counts = p.slots.get(s)
            if counts is None:
                continue
            frac = _share(counts[_FIRST], counts[_LAST], start_ns, end_ns)
            for i in range(4):
                acc[i] += counts[i] * frac
        w.launches, w.graph_launches, w.syncs = (round(x) for x in acc[:3])
        w.sync_wait_ns = round(acc[3])

    # ---- totals ----

    def totals(self) -> dict[int, CudaTotals]:
        """Per process, since the agent started (from the kernel)."""
        return {int.from_bytes(k[:4], "little"): decode_totals(v) for k, v in self.maps.procs()}

    def pids(self) -> list[int]:
        with self._lock:
            return sorted(self._procs)

    def stats(self) -> dict[str, int]:
        return {"copies": self.copies_seen, "decode_errors": self.decode_errors,
                "resolved_directions": self.resolved_directions}


_FIRST, _LAST, _DELETED = 4, 5, 6


def _merge_slot(a: list[int], b: list[int]) -> list[int]:
    return [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], min(a[_FIRST], b[_FIRST]),
            max(a[_LAST], b[_LAST]), 0]


def _share(a: int, b: int, start: int, end: int) -> float:
    """The part of activity interval [a, b] inside [start, end] (all or nothing for a point)."""
    if b <= a:
        return 1.0 if start <= a <= end else 0.0
    return max(0, min(b, end) - max(a, start)) / (b - a)


def _with_direction(c: CudaCopy, d: CopyDir) -> CudaCopy:
    return CudaCopy(c.pid, c.tid, c.ts_enter_ns, c.ts_exit_ns, c.bytes, c.dst, c.src, c.stream,
                    c.api, c.is_async, d)


def _copies_between(copies: collections.deque[CudaCopy], start: int, end: int
                    ) -> Iterable[CudaCopy]:
    """Copies that started inside [start, end] (records arrive nearly in time order)."""
    for c in reversed(copies):
        if c.ts_enter_ns < start - 1_000_000_000:
            break  # a second before the window: older records cannot be inside it
        if start <= c.ts_enter_ns <= end:
            yield c
