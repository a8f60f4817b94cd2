"""CUDA driver signals from bpf/cuda.c: launches, copies, sync waits of traced processes.

The kernel keeps per-process totals (`cuda_procs`) and launches and sync waits per time slot
(`cuda_slots`, 2^SITS_CUDA_SLOT_SHIFT ns each); every copy arrives as an EV_CUDA_COPY record
and every allocation as EV_CUDA_MEM. CudaSignals reads all three and answers "what did process
P do on the GPU between t0 and t1" (`window`), which the span annotator in gpusignals.py
turns into `sits.cuda.*` attributes.

Copies through cuMemcpy/cuMemcpyAsync name no direction: the agent resolves it from the
address ranges that allocations it saw returned (device, pinned host, registered host). A
pointer outside every known range counts as pageable host memory only when the process called
cuInit after the agent started (so every allocation was seen); otherwise the direction stays
'unknown'.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sits_trace.agent.capture.events import DecodeError
from sits_trace.agent.capture.probes import (
    ProbeStatus,
    Uprobe,
    elf_has_symbol,
    find_libraries,
    mapped_libraries,
)
from sits_trace.agent.capture.wire import (
    CopyDir,
    CudaApi,
    CudaCopyEventC,
    CudaInitEventC,
    CudaMemEventC,
    CudaProcC,
    CudaSlotC,
    CudaSlotKeyC,
    Kind,
    MemKind,
    MemOp,
)
from sits_trace.agent.model import Check

if TYPE_CHECKING:
    from sits_trace.agent.capture.loader import Kernel

CUDA_PROGRAM = "cuda.c"
LIBCUDA = "libcuda"
# where drivers put libcuda besides the paths the processes map (also found by find_libraries)
LIBCUDA_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
)
DEFAULT_SLOT_SHIFT = 20  # 1.048576 ms


def _u(symbol: str, enter: str, exit_: str = "sits_cuda_call_exit") -> Uprobe:
    return Uprobe(symbol, enter, exit_, "cuda", LIBCUDA)


# entry-only probes have fn_exit "" (loader attaches no uretprobe)
CUDA_UPROBES: tuple[Uprobe, ...] = (
    _u("cuLaunchKernel", "sits_cuda_launch", ""),
    _u("cuLaunchKernel_ptsz", "sits_cuda_launch", ""),
    _u("cuLaunchKernelEx", "sits_cuda_launch", ""),
    _u("cuLaunchKernelEx_ptsz", "sits_cuda_launch", ""),
    _u("cuGraphLaunch", "sits_cuda_graph_launch", ""),
    _u("cuGraphLaunch_ptsz", "sits_cuda_graph_launch", ""),
    _u("cuMemcpyHtoD_v2", "sits_cuda_memcpy_htod"),
    _u("cuMemcpyHtoD_v2_ptds", "sits_cuda_memcpy_htod"),
    _u("cuMemcpyDtoH_v2", "sits_cuda_memcpy_dtoh"),
    _u("cuMemcpyDtoH_v2_ptds", "sits_cuda_memcpy_dtoh"),
    _u("cuMemcpyDtoD_v2", "sits_cuda_memcpy_dtod"),
    _u("cuMemcpyDtoD_v2_ptds", "sits_cuda_memcpy_dtod"),
    _u("cuMemcpy", "sits_cuda_memcpy"),
    _u("cuMemcpy_ptds", "sits_cuda_memcpy"),
    _u("cuMemcpyHtoDAsync_v2", "sits_cuda_memcpy_htod_async"),
    _u("cuMemcpyHtoDAsync_v2_ptsz", "sits_cuda_memcpy_htod_async"),
    _u("cuMemcpyDtoHAsync_v2", "sits_cuda_memcpy_dtoh_async"),
    _u("cuMemcpyDtoHAsync_v2_ptsz", "sits_cuda_memcpy_dtoh_async"),
    _u("cuMemcpyDtoDAsync_v2", "sits_cuda_memcpy_dtod_async"),
    _u("cuMemcpyDtoDAsync_v2_ptsz", "sits_cuda_memcpy_dtod_async"),
    _u("cuMemcpyAsync", "sits_cuda_memcpy_async"),
    _u("cuMemcpyAsync_ptsz", "sits_cuda_memcpy_async"),
    _u("cuStreamSynchronize", "sits_cuda_stream_sync"),
    _u("cuStreamSynchronize_ptsz", "sits_cuda_stream_sync"),
    _u("cuCtxSynchronize", "sits_cuda_ctx_sync"),
    _u("cuEventSynchronize", "sits_cuda_event_sync"),
    _u("cuMemAlloc_v2", "sits_cuda_mem_alloc"),
    _u("cuMemAllocAsync", "sits_cuda_mem_alloc_async"),
    _u("cuMemAllocAsync_ptsz", "sits_cuda_mem_alloc_async"),
    _u("cuMemAllocManaged", "sits_cuda_mem_alloc_managed"),
    _u("cuMemHostAlloc", "sits_cuda_mem_host_alloc"),
    _u("cuMemAllocHost_v2", "sits_cuda_mem_alloc_host"),
    _u("cuMemHostRegister_v2", "sits_cuda_mem_host_register"),
    _u("cuMemMap", "sits_cuda_mem_map"),
    _u("cuMemFree_v2", "sits_cuda_mem_free"),
    _u("cuMemFreeAsync", "sits_cuda_mem_free_async"),
    _u("cuMemFreeAsync_ptsz", "sits_cuda_mem_free_async"),
    _u("cuMemFreeHost", "sits_cuda_mem_free_host"),
    _u("cuMemHostUnregister", "sits_cuda_mem_host_unregister"),
    _u("cuMemUnmap", "sits_cuda_mem_unmap"),
    _u("cuInit", "sits_cuda_init", ""),
)
# the symbols without which the CUDA signals say little (doctor reports the rest as optional)
CORE_SYMBOLS = ("cuLaunchKernel", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
                "cuStreamSynchronize")


@dataclass(frozen=True, slots=True)
class CudaCopy:
    pid: int
    tid: int
    ts_enter_ns: int
    ts_exit_ns: int
    bytes: int
    dst: int
    src: int
    stream: int
    api: CudaApi
    is_async: bool
    direction: CopyDir  # as the kernel saw it (UNKNOWN for cuMemcpy/cuMemcpyAsync)


@dataclass(frozen=True, slots=True)
class CudaMem:
    pid: int
    tid: int
    ts_ns: int
    ptr: int
    bytes: int
    op: MemOp
    mem: MemKind
    api: CudaApi


@dataclass(slots=True)
class CudaTotals:
    """One process's totals since the agent started (bpf/cuda.c struct cuda_proc)."""

    launches: int = 0
    graph_launches: int = 0
    h2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    d2h_copies: int = 0
    d2d_bytes: int = 0
    d2d_copies: int = 0
    other_bytes: int = 0
    other_copies: int = 0
    copy_call_ns: int = 0
    sync_ns: int = 0
    syncs: int = 0
    failed: int = 0


def _check(raw: bytes, kind: Kind, cls: type[ctypes.Structure]) -> None:
    if len(raw) < ctypes.sizeof(cls) or int.from_bytes(raw[:4], "little") != kind:
        raise DecodeError(f"{kind.name} record of {len(raw)} bytes")


def decode_copy(raw: bytes) -> CudaCopy:
    _check(raw, Kind.CUDA_COPY, CudaCopyEventC)
    c = CudaCopyEventC.from_buffer_copy(raw[: ctypes.sizeof(CudaCopyEventC)])
    try:
        return CudaCopy(c.tgid, c.tid, c.ts_enter_ns, c.ts_exit_ns, c.bytes, c.dst, c.src,
                        c.stream, CudaApi(c.api), bool(c.is_async), CopyDir(c.direction))
    except ValueError as exc:
        raise DecodeError(str(exc)) from exc


def decode_mem(raw: bytes) -> CudaMem:
    _check(raw, Kind.CUDA_MEM, CudaMemEventC)
    m = CudaMemEventC.from_buffer_copy(raw[: ctypes.sizeof(CudaMemEventC)])
    try:
        return CudaMem(m.tgid, m.tid, m.ts_ns, m.ptr, m.bytes, MemOp(m.op), MemKind(m.mem),
                       CudaApi(m.api))
    except ValueError as exc:
        raise DecodeError(str(exc)) from exc


def decode_init(raw: bytes) -> tuple[int, int]:
    """(pid, ts_ns) of an EV_CUDA_INIT record."""
    _check(raw, Kind.CUDA_INIT, CudaInitEventC)
    i = CudaInitEventC.from_buffer_copy(raw[: ctypes.sizeof(CudaInitEventC)])
    return i.tgid, i.ts_ns


def decode_totals(raw: bytes) -> CudaTotals:
    p = CudaProcC.from_buffer_copy(raw[: ctypes.sizeof(CudaProcC)])
    return CudaTotals(*(getattr(p, f[0]) for f in CudaProcC._fields_))


# ---- address ranges: the direction of cuMemcpy / cuMemcpyAsync ----

_DEVICE_KINDS = (MemKind.DEVICE, MemKind.MAPPED, MemKind.MANAGED)


class AddressMap:
    """One process's known allocations, as sorted, non-overlapping [start, end) ranges."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: dict[int, tuple[int, MemKind]] = {}  # start -> (end, kind)
        self.complete = False  # every allocation seen (cuInit after the agent started)

    def add(self, ptr: int, size: int, kind: MemKind) -> None:
        if size <= 0:
            return
        if ptr in self._ranges:
            self.remove(ptr)
        bisect.insort(self._starts, ptr)
        self._ranges[ptr] = (ptr + size, kind)

    def remove(self, ptr: int) -> None:
        if self._ranges.pop(ptr, None) is not None:
            i = bisect.bisect_left(self._starts, ptr)
            if i < len(self._starts) and self._starts[i] == ptr:
                del self._starts[i]

    def kind_of(self, addr: int) -> MemKind | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        end, kind = self._ranges[start]
        return kind if addr < end else None

    def __len__(self) -> int:
        return len(self._starts)

    def _is_device(self, addr: int) -> bool | None:
        """True/False when known, None when the address is in no range and ranges are partial."""
        k = self.kind_of(addr)
        if k is not None:
            return k in _DEVICE_KINDS
        return False if self.complete else None

    def direction(self, dst: int, src: int) -> CopyDir:
        d, s = self._is_device(dst), self._is_device(src)
        if d is None or s is None:
            return CopyDir.UNKNOWN
        if d and s:
            return CopyDir.D2D
        if d:
            return CopyDir.H2D
        if s:
            return CopyDir.D2H
        return CopyDir.UNKNOWN  # host to host through cuMemcpy: not a PCIe transfer


# ---- reading the kernel's maps ----

class CudaMaps(Protocol):
    def procs(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of `cuda_procs`."""

    def slots(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of `cuda_slots`."""

    def delete_slots(self, keys: Sequence[bytes]) -> None: ...


class BccCudaMaps:
    """CudaMaps over a loaded bcc.BPF object: batch syscalls where the kernel has them."""

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf
        self._batch = True

    def procs(self) -> list[tuple[bytes, bytes]]:
        return [(bytes(k), bytes(v)) for k, v in self._bpf["cuda_procs"].items()]

    def slots(self) -> list[tuple[bytes, bytes]]:
        t = self._bpf["cuda_slots"]
        if self._batch:
            try:
                return [(bytes(k), bytes(v)) for k, v in t.items_lookup_batch()]
            except Exception:  # noqa: BLE001 - bcc raises bare Exception (no batch ops: EINVAL)
                self._batch = False
        return [(bytes(k), bytes(v)) for k, v in t.items()]

    def delete_slots(self, keys: Sequence[bytes]) -> None:
        t = self._bpf["cuda_slots"]
        if not keys:
            return
        if self._batch:
            arr = (t.Key * len(keys))(*(t.Key.from_buffer_copy(k) for k in keys))
            try:
                t.items_delete_batch(arr)
            except Exception:  # noqa: BLE001 - an entry was evicted meanwhile (ENOENT)
                self._delete_each(keys)
            return
        self._delete_each(keys)

    def _delete_each(self, keys: Sequence[bytes]) -> None:
        t = self._bpf["cuda_slots"]
        for k in keys:
            try:
                del t[t.Key.from_buffer_copy(k)]
            except KeyError:
                pass


class DictCudaMaps:
    """CudaMaps over dicts of bytes: unit tests."""

    def __init__(self) -> None:
        self.proc_map: dict[bytes, bytes] = {}
        self.slot_map: dict[bytes, bytes] = {}

    def procs(self) -> list[tuple[bytes, bytes]]:
        return list(self.proc_map.items())

    def slots(self) -> list[tuple[bytes, bytes]]:
        return list(self.slot_map.items())

    def delete_slots(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.slot_map.pop(k, None)


def slot_key(pid: int, slot: int) -> bytes:
    return bytes(CudaSlotKeyC(slot=slot, tgid=pid))


# ---- what a process did in a window ----

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


# ---- libraries and probes ----

def find_libcuda(proc_root: str = "/proc", extra: Sequence[str] = ()) -> list[str]:
    """libcuda files on the system and mapped by processes, one path per file (inode): a file
    reached through two paths (a container's root) would count every call twice."""
    return unique_files(find_libraries(LIBCUDA, proc_root, extra=[*LIBCUDA_PATHS, *extra]))


def unique_files(paths: Iterable[str], seen: set[tuple[int, int]] | None = None) -> list[str]:
    """The paths naming distinct files (device, inode); `seen` carries inodes across calls."""
    done = seen if seen is not None else set()
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key not in done:
            done.add(key)
            out.append(p)
    return out


class CudaProbes:
    """Attaches CUDA_UPROBES to each libcuda once; rescans new processes (after exec)."""

    def __init__(self, kernel: Kernel, proc_root: str = "/proc",
                 extra: Sequence[str] = ()) -> None:
        self.kernel = kernel
        self.proc_root = proc_root
        self.extra = list(extra)
        self._inodes: set[tuple[int, int]] = set()
        self.libraries: list[str] = []

    def attach_all(self) -> list[ProbeStatus]:
        found = find_libraries(LIBCUDA, self.proc_root, extra=[*LIBCUDA_PATHS, *self.extra])
        return self._attach(found)

    def check_process(self, pid: int) -> list[ProbeStatus]:
        """A process that exec'd (or loaded libcuda late): probe its libcuda if new."""
        return self._attach(mapped_libraries(pid, LIBCUDA, self.proc_root))

    def _attach(self, paths: Iterable[str]) -> list[ProbeStatus]:
        out: list[ProbeStatus] = []
        for lib in unique_files(paths, self._inodes):
            self.libraries.append(lib)
            out += self.kernel.attach_uprobes(lib, CUDA_UPROBES)
        return out


# ---- doctor ----

def doctor_checks(proc_root: str = "/proc") -> list[Check]:
    """One row per libcuda found: which probed symbols it exports. Never a core check."""

    libs = find_libcuda(proc_root)
    if not libs:
        return [Check("libcuda", False, "no libcuda.so found on the system or in processes",
                      "optional: CUDA signals need the NVIDIA driver's libcuda.so.1")]
    out = []
    symbols = sorted({u.symbol for u in CUDA_UPROBES})
    for lib in libs:
        missing = [s for s in symbols if not elf_has_symbol(lib, s)]
        core_missing = [s for s in CORE_SYMBOLS if s in missing]
        detail = f"{len(symbols) - len(missing)}/{len(symbols)} probed symbols"
        if missing:
            detail += "; missing " + ", ".join(missing)
        out.append(Check(f"libcuda {lib}", not core_missing, detail,
                         "" if not core_missing else
                         "a stripped or unusual libcuda: launches/copies are not traced here"))
    return out
