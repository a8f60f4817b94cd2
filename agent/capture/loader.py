"""Compile the BPF programs with BCC, attach every probe in one loop, and read the ring.

The rest of the agent sees two small things from here: an EventSource (records
as bytes, so a recorded file can stand in for the kernel) and a Kernel handle
for the maps the agent writes (target pids, pre-existing connections) and reads
(per-kind seen/lost counters).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from . import bpfsrc, ringbuf
from .btf import kernel_defines
from .probes import (
    HTTP_TRACEPOINTS,
    TLS_LIBRARIES,
    ProbeError,
    ProbeReport,
    ProbeStatus,
    Tracepoint,
    Uprobe,
    check_tracepoints,
    find_libraries,
    ssl_executables,
    tracefs_root,
)
from .ringbuf import MmapRing
from .shedding import LoadShedder

_BPF_EXIST = 2  # bpf_map_update_elem: only replace an element that is there


class EventSource(Protocol):
    def read(self, timeout_ms: int) -> list[bytes]:
        """Records that arrived, waiting at most timeout_ms for the first."""

    def close(self) -> None: ...


@dataclass(slots=True)
class LoadOptions:
    ringbuf_pages: int = 4096
    max_payload: int = 4096
    target_pids: Sequence[int] = ()
    tls: bool = True
    extra_programs: Sequence[str] = ()  # further files of bpf/, e.g. "tcp.c"
    extra_tracepoints: Sequence[Tracepoint] = ()
    extra_uprobes: Sequence[Uprobe] = ()
    extra_defines: dict[str, int | str] = field(default_factory=dict)
    ssl_libraries: Sequence[str] = ()  # extra libssl paths to probe


class BccUnavailable(ProbeError):
    pass


def import_bcc() -> Any:
    try:
        import bcc  # noqa: PLC0415 - a missing bcc is one clear line, not an import error
    except ImportError as exc:
        raise BccUnavailable(
            "the bcc Python module is missing: run `make setup` (installs Debian's python3-bpfcc "
            "and a venv with --system-site-packages)"
        ) from exc
    return bcc


class Kernel:
    """The loaded programs: maps, probe report, uprobe attachment."""

    def __init__(self, bpf: Any, report: ProbeReport, opts: LoadOptions,
                 defines: dict[str, int | str] | None = None) -> None:
        self.bpf = bpf
        self.report = report
        self.opts = opts
        self.defines = dict(defines or {})  # the -D values the programs were built with
        self._attached: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def counters(self, name: str) -> dict[int, int]:
        """Per-kind totals of the per-CPU `seen` or `lost` array."""
        table = self.bpf[name]
        out: dict[int, int] = {}
        for k, v in table.items():
            total = sum(int(x) for x in v)
            if total:
                out[int(k.value)] = total
        return out

    def set_capture_shift(self, shift: int) -> None:
        """Capture one exchange in 2**shift from now on (0: all)."""
        table = self.bpf["capture_shift"]
        table[table.Key(0)] = table.Leaf(shift)

    def shed_counts(self) -> dict[tuple[int, int], int]:
        """Exchanges the kernel did not capture, by (pid, role)."""
        out: dict[tuple[int, int], int] = {}
        for k, v in self.bpf["shed"].items():
            key = int(k.value)
            out[(key >> 8, key & 0xFF)] = sum(int(x) for x in v)
        return out

    def exchanges(self) -> int:
        """Exchanges the kernel saw begin, captured or skipped (all CPUs)."""
        table = self.bpf["exchange_seq"]
        return sum(int(x) for x in table[table.Key(0)])

    def add_target_pid(self, pid: int) -> None:
        table = self.bpf["target_pids"]
        table[table.Key(pid)] = table.Leaf(1)

    def register_conn(self, pid: int, fd: int, conn_id: int, role: int) -> None:
        """Trace a connection that was open before the agent started."""
        table = self.bpf["conns"]
        leaf = table.Leaf()
        leaf.conn_id = conn_id
        leaf.role = role
        table[table.Key((pid << 32) | fd)] = leaf
        self._mark_conns(pid)

    def mute_conn(self, pid: int, fd: int, conn_id: int) -> bool:
        """Send nothing more of this connection's reads and writes (conn_state.mute): the
        agent found no HTTP on it. Only while (pid, fd) is still the connection `conn_id`,
        and never re-creating an entry that went away meanwhile (BPF_EXIST)."""
        table = self.bpf["conns"]
        key = table.Key((pid << 32) | fd)
        try:
            leaf = table[key]
        except KeyError:
            return False
        if int(leaf.conn_id) != conn_id:
            return False
        leaf.mute = 1
        from bcc.libbcc import lib  # noqa: PLC0415 - BCC only where the kernel is loaded

        return int(lib.bpf_update_elem(table.map_fd, ctypes.byref(key), ctypes.byref(leaf),
                                       _BPF_EXIST)) == 0

    def _mark_conns(self, pid: int) -> None:
        """Set the process's bit in `conn_tgids` (bpf/events.h): its reads and writes are
        looked at; every other process's return after a bit test."""
        table = self.bpf["conn_tgids"]
        key = table.Key((pid >> 6) & 0xFFFF)
        table[key] = table.Leaf(int(table[key].value) | (1 << (pid & 63)))

    def forget_pid(self, pid: int, fds: Sequence[int]) -> None:
        table = self.bpf["conns"]
        for fd in fds:
            try:
                del table[table.Key((pid << 32) | fd)]
            except KeyError:
                pass

    def attach_uprobes(self, library: str, probes: Sequence[Uprobe]) -> list[ProbeStatus]:
        """Attach each probe to `library` once; report each symbol's outcome."""
        out: list[ProbeStatus] = []
        with self._lock:
            for p in probes:
                key = (library, p.symbol)
                if key in self._attached:
                    continue
                st = ProbeStatus(f"uprobe:{os.path.basename(library)}:{p.symbol}", p.group,
                                 p.required, True)
                try:
                    # the return probe first: a call whose entry the agent sees then always
                    # has its return seen too. Entry first, a call entered between the two
                    # attachments left its entry's state standing (tls.c's `ssl_active`),
                    # and the thread's next socket read tied that SSL* to another
                    # connection (CI: two node streams' records crossed)
                    if p.fn_exit:  # "": entry only
                        self.bpf.attach_uretprobe(name=library, sym=p.symbol,
                                                  fn_name=p.fn_exit)
                    self.bpf.attach_uprobe(name=library, sym=p.symbol, fn_name=p.fn_enter)
                    self._attached.add(key)
                except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception
                    st.ok = False
                    st.detail = str(exc).splitlines()[0][:200]
                out.append(st)
                self.report.add(st)
        return out

    def detach_all(self) -> int:
        """Detach every tracepoint and uprobe (maps stay: the ring can still be read).
        Stopping under load starts here, so the records left to read are bounded."""
        n = 0
        bpf = self.bpf
        with self._lock:
            for tp in list(getattr(bpf, "tracepoint_fds", {})):
                n += _quietly(bpf.detach_tracepoint, tp)
            for ev in list(getattr(bpf, "uprobe_fds", {})):
                n += _quietly(bpf.detach_uprobe_event, ev)
            self._attached.clear()
        return n

    def attached_libraries(self) -> set[str]:
        return {lib for lib, _ in self._attached}


def _quietly(fn: Callable[[Any], object], arg: Any) -> int:
    try:
        fn(arg)
    except Exception:  # noqa: BLE001 - bcc raises bare Exception; stopping goes on
        return 0
    return 1


CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39


def bpf_refusal(syscall: Callable[[], tuple[int, int]] | None = None) -> str | None:
    """Why the kernel refuses bpf() to a privileged process (one line), or None when it
    creates a one-entry array map. EPERM there is a seccomp filter: kernels before 5.11,
    where it can also be RLIMIT_MEMLOCK, are not asked."""
    if syscall is None:
        if tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) < (5, 11):
            return None
        syscall = _map_create
    fd, err = syscall()
    if fd >= 0:
        os.close(fd)
        return None
    if err == 38:  # ENOSYS
        return "this kernel has no bpf() system call (CONFIG_BPF_SYSCALL)"
    if err == 1:  # EPERM
        return ("the kernel refused bpf() (Operation not permitted) to a privileged process: "
                "a seccomp filter blocks it (a container runtime's, or systemd's "
                "SystemCallFilter): allow bpf and perf_event_open")
    return None  # anything else: BCC's own error says more


def _map_create() -> tuple[int, int]:
    attr = struct.pack("5I", 2, 4, 4, 1, 0)  # BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry
    buf = ctypes.create_string_buffer(attr, len(attr))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(321, 0, buf, len(attr)))  # x86_64 bpf(BPF_MAP_CREATE)
    return fd, ctypes.get_errno()


def bpf_privileged(status: str | None = None) -> bool:
    """Root, or the effective capabilities BPF tracing needs: CAP_BPF and CAP_PERFMON
    (or CAP_SYS_ADMIN, which kernels before 5.8 ask for): a systemd unit runs without root."""
    if status is None:
        if os.geteuid() == 0:
            return True
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return False
    eff = next((int(line.split()[1], 16) for line in status.splitlines()
                if line.startswith("CapEff:")), 0)
    bits = {cap for cap in (CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF) if eff >> cap & 1}
    return CAP_SYS_ADMIN in bits or {CAP_BPF, CAP_PERFMON} <= bits


def load(opts: LoadOptions, *, agent_pid: int | None = None) -> Kernel:
    """Compile, load and attach. Raises ProbeError with a one-line reason and fix."""
    bcc = import_bcc()
    if not bpf_privileged():
        raise ProbeError("loading BPF programs needs root (or CAP_BPF+CAP_PERFMON): run with sudo")
    refused = bpf_refusal() if os.uname().machine == "x86_64" else None
    if refused:
        raise ProbeError(refused)
    try:
        root = tracefs_root()
    except PermissionError:  # tracefs is 0700 root: capabilities without DAC_READ_SEARCH
        raise ProbeError("tracefs (/sys/kernel/tracing) is not readable: needs root or "
                         "CAP_DAC_READ_SEARCH (and CAP_SYS_ADMIN for uprobes)") from None
    if root is None:
        raise ProbeError("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")
    report = ProbeReport()
    tps = list(HTTP_TRACEPOINTS) + list(opts.extra_tracepoints)
    missing_defines = check_tracepoints(tps, root, report)
    bad = report.failed_required()
    if bad:
        names = ", ".join(s.name for s in bad)
        raise ProbeError(f"required tracepoints missing from this kernel: {names}")
    files = ["http.c"] + (["tls.c"] if opts.tls else []) + list(opts.extra_programs)
    defines: dict[str, int | str] = {
        "SITS_AGENT_PID": agent_pid if agent_pid is not None else os.getpid(),
        "SITS_RINGBUF_PAGES": opts.ringbuf_pages,
        "SITS_MAX_PAYLOAD": opts.max_payload,
        "SITS_FILTER_PIDS": 1 if opts.target_pids else 0,
        **dict.fromkeys(missing_defines, 1),
        **kernel_defines(),  # {} without kernel BTF: addresses then come from /proc
        **opts.extra_defines,
    }
    text = bpfsrc.program_text(files)
    tries = [defines]
    if "SITS_EXIT_ARGS" not in defines:
        # reads and writes traced at their exit only, their arguments read from the thread's
        # saved registers (bpf/http.c): x86-64, kernels with bpf_task_pt_regs (5.15); else
        # an enter and an exit tracepoint each, ~100 ns more a call for every process
        exit_args = platform.machine() == "x86_64"
        tries = [{**defines, "SITS_EXIT_ARGS": 1}] if exit_args else []
        tries.append({**defines, "SITS_EXIT_ARGS": 0})
    if "SITS_TASK_STORAGE" not in defines:
        # kernels before 5.11 have no task storage for tracing programs: per-thread state
        # in a hash instead (bpf/http.c), a little more per traced syscall
        tries.append({**tries[-1], "SITS_TASK_STORAGE": 0})
    for i, d in enumerate(tries):
        try:
            bpf = bcc.BPF(text=text, cflags=bpfsrc.cflags(d))
            break
        except Exception as exc:
            if i == len(tries) - 1:
                raise ProbeError(f"BPF programs failed to compile or load: {exc}. "
                                 "Run `sits-trace doctor` to see what is missing") from exc
    if "SITS_EXIT_ARGS" not in defines:
        exit_only = bool(d.get("SITS_EXIT_ARGS"))
        report.add(ProbeStatus(
            "syscall arguments at exit", "http", False, exit_only,
            "" if exit_only else "reads and writes traced at enter and exit (not x86-64, or "
            "no bpf_task_pt_regs: kernel before 5.15): ~100 ns more a call, every process"))
    k = Kernel(bpf, report, opts, d)
    for pid in opts.target_pids:
        k.add_target_pid(pid)
    if opts.tls:
        for short, probes in TLS_LIBRARIES:
            extra = opts.ssl_libraries if short == "libssl" else ()
            for lib in find_libraries(short, extra=extra):
                k.attach_uprobes(lib, probes)
        for exe in ssl_executables():  # OpenSSL linked into the program (node)
            for _, probes in TLS_LIBRARIES:
                k.attach_uprobes(exe, probes)
    return k


class RingSource:
    """Records from the kernel's ring buffer, in batches.

    On x86-64 the ring is read in place through mmap (agent/capture/ringbuf.py): no call into
    C per record. Elsewhere, or with SITS_RING_READER=bcc, BCC's reader copies each
    record out in a ctypes callback.
    """

    def __init__(self, kernel: Kernel, map_name: str = "events") -> None:
        self._bpf = kernel.bpf
        self._mmap: MmapRing | None = None
        self._kernel = kernel
        self._read_bytes = 0  # the BCC reader's progress, for the shedder
        table = kernel.bpf[map_name]
        if ringbuf.supported() and os.environ.get("SITS_RING_READER", "mmap") != "bcc":
            self._mmap = MmapRing(table.map_fd, kernel.opts.ringbuf_pages * mmap.PAGESIZE)
        if self._mmap is not None:
            return
        self._batch: list[bytes] = []
        string_at = ctypes.string_at
        batch = self._batch

        def _cb(_ctx: Any, data: Any, size: int) -> int:
            batch.append(string_at(data, size))
            return 0

        self._cb = _cb  # keep a reference: bcc holds only a C pointer
        table.open_ring_buffer(_cb)

    def ring_progress(self) -> tuple[int, int]:
        """(bytes read so far, bytes waiting): how busy the ring is, for the load shedder."""
        m = self._mmap
        return (m.read_bytes(), m.pending_bytes()) if m is not None else (self._read_bytes, 0)

    def pending_bytes(self) -> int:
        """Bytes waiting in the ring (0 where the reader cannot tell)."""
        return self.ring_progress()[1]

    @property
    def reader(self) -> str:
        return "mmap" if self._mmap is not None else "bcc"

    def read(self, timeout_ms: int) -> list[bytes]:
        if self._mmap is not None:
            return self._mmap.read(timeout_ms)
        self._bpf.ring_buffer_poll(timeout_ms)
        self._bpf.ring_buffer_consume()
        out = self._batch[:]
        self._batch.clear()
        self._read_bytes += sum(map(len, out))
        return out

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


_REC_MAGIC = b"SITSREC1"


class Recorder:
    """Writes every record it is given to a file: the fixtures unit tests replay.

    The file holds the raw captured bytes, unredacted (credentials, cookies, bodies): it is
    created owner-only (0600), and an existing file is made so before it is written."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        self._f: BinaryIO = os.fdopen(fd, "wb")
        self._f.write(_REC_MAGIC)

    def write(self, records: Sequence[bytes]) -> None:
        for r in records:
            self._f.write(struct.pack("<I", len(r)))
            self._f.write(r)

    def close(self) -> None:
        self._f.close()


class RecordedSource:
    """Replays a file written by Recorder, in batches."""

    def __init__(self, path: Path, batch: int = 256) -> None:
        data = Path(path).read_bytes()
        if not data.startswith(_REC_MAGIC):
            raise ValueError(f"{path}: not a sits-trace recording")
        self._records = _split_records(data[len(_REC_MAGIC):])
        self._pos = 0
        self._batch = batch

    def read(self, timeout_ms: int) -> list[bytes]:
        out = self._records[self._pos:self._pos + self._batch]
        self._pos += len(out)
        return out

    @property
    def exhausted(self) -> bool:
        return self._pos >= len(self._records)

    def close(self) -> None:
        pass


def _split_records(buf: bytes) -> list[bytes]:
    out: list[bytes] = []
    pos = 0
    while pos + 4 <= len(buf):
        (n,) = struct.unpack_from("<I", buf, pos)
        out.append(buf[pos + 4:pos + 4 + n])
        pos += 4 + n
    return out


class TeeSource:
    """Passes records through while recording them."""

    def __init__(self, inner: EventSource, recorder: Recorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def read(self, timeout_ms: int) -> list[bytes]:
        recs = self.inner.read(timeout_ms)
        self.recorder.write(recs)
        return recs

    def pending_bytes(self) -> int:
        inner = getattr(self.inner, "pending_bytes", None)
        return int(inner()) if inner is not None else 0

    def close(self) -> None:
        self.inner.close()
        self.recorder.close()


OnRecords = Callable[[list[bytes]], None]


def ring_shedder(kernel: Kernel, ring: RingSource, cpu_budget: float) -> LoadShedder:
    """The load shedder of a loaded kernel read through `ring`. Whoever drives the read loop
    owns it (the daemon): it ticks it before each read and reports `shedding(...)`."""
    return LoadShedder(kernel.set_capture_shift, cpu_budget=cpu_budget,
                       lost=lambda: sum(kernel.counters("lost").values()),
                       ring=ring.ring_progress, exchanges=kernel.exchanges)


def shedding(kernel: Kernel, shedder: LoadShedder) -> tuple[int, int]:
    """(current capture shift, exchanges the kernel skipped so far)."""
    return shedder.state.shift, sum(kernel.shed_counts().values())
