"""Probes declared as data, checked against the running kernel, attached in one loop.

Each probe names its program, its attach point and whether the agent can run
without it. Tracepoints are checked in tracefs before compiling (a missing
optional one is compiled out through a -D flag; a missing required one stops
start-up with the reason); uprobes are attached after loading, per library
found, and a library that lacks a symbol is reported, not fatal.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sits_trace.agent.model import Check


@dataclass(frozen=True, slots=True)
class Tracepoint:
    category: str
    event: str
    group: str
    required: bool = True

    @property
    def name(self) -> str:
        return f"{self.category}:{self.event}"

    @property
    def disable_define(self) -> str:
        """The -D flag that compiles this probe out when the kernel lacks it."""
        return f"SITS_NO_{self.category.upper()}_{self.event.upper()}"


@dataclass(frozen=True, slots=True)
class Uprobe:
    symbol: str
    fn_enter: str
    fn_exit: str  # "": entry only, no uretprobe (e.g. counted launches)
    group: str
    library: str  # short name: "libssl", "libcuda"
    required: bool = False


def _syscall_pair(name: str, group: str = "http", required: bool = True) -> list[Tracepoint]:
    return [
        Tracepoint("syscalls", f"sys_enter_{name}", group, required),
        Tracepoint("syscalls", f"sys_exit_{name}", group, required),
    ]


HTTP_TRACEPOINTS: tuple[Tracepoint, ...] = tuple(
    [tp for n in ("accept4", "connect", "close", "read", "write", "recvfrom", "sendto")
     for tp in _syscall_pair(n)]
    + [tp for n in ("accept", "readv", "writev", "recvmsg", "sendmsg", "sendfile64")
       for tp in _syscall_pair(n, required=False)]
    + [Tracepoint("sched", "sched_process_exec", "proc", False),
       Tracepoint("sched", "sched_process_exit", "proc", False),
       Tracepoint("sched", "sched_process_fork", "proc", False)]
)

TLS_UPROBES: tuple[Uprobe, ...] = (
    Uprobe("SSL_read", "sits_ssl_read_enter", "sits_ssl_exit", "tls", "libssl"),
    Uprobe("SSL_write", "sits_ssl_write_enter", "sits_ssl_exit", "tls", "libssl"),
    Uprobe("SSL_read_ex", "sits_ssl_read_ex_enter", "sits_ssl_exit", "tls", "libssl"),
    Uprobe("SSL_write_ex", "sits_ssl_write_ex_enter", "sits_ssl_exit", "tls", "libssl"),
    Uprobe("SSL_set_bio", "sits_ssl_set_bio", "", "tls", "libssl"),
)
# memory-BIO TLS (asyncio, uvloop): the ciphertext fed to an SSL* ties it to its socket
BIO_UPROBES: tuple[Uprobe, ...] = (
    Uprobe("BIO_write", "sits_bio_write", "", "tls", "libcrypto"),
)
# TLS probes by library: each library found on the system or mapped by a process gets its set
TLS_LIBRARIES: tuple[tuple[str, tuple[Uprobe, ...]], ...] = (
    ("libssl", TLS_UPROBES), ("libcrypto", BIO_UPROBES))


@dataclass(slots=True)
class ProbeStatus:
    """What happened to one probe: shown by `doctor` and exported as agent metrics."""

    name: str
    group: str
    required: bool
    ok: bool
    detail: str = ""


@dataclass(slots=True)
class ProbeReport:
    statuses: list[ProbeStatus] = field(default_factory=list)

    def add(self, st: ProbeStatus) -> None:
        self.statuses.append(st)

    def failed_required(self) -> list[ProbeStatus]:
        return [s for s in self.statuses if s.required and not s.ok]


class ProbeError(RuntimeError):
    """A required probe cannot be attached; the message says why and what to do."""


def tracefs_root(candidates: Sequence[str] = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
                 ) -> Path | None:
    for c in candidates:
        if (Path(c) / "events").is_dir():
            return Path(c)
    return None


def check_tracepoints(tps: Iterable[Tracepoint], root: Path | None, report: ProbeReport
                      ) -> list[str]:
    """Record each tracepoint's presence; return the -D defines for missing optional ones."""
    defines: list[str] = []
    for tp in tps:
        present = root is not None and (root / "events" / tp.category / tp.event / "id").exists()
        detail = "" if present else "not in tracefs"
        report.add(ProbeStatus(tp.name, tp.group, tp.required, present, detail))
        if not present and not tp.required:
            defines.append(tp.disable_define)
    return defines


def elf_has_symbol(path: str, symbol: str) -> bool:
    """Does the ELF file name `symbol` in its string tables (a cheap check for doctor;
    attaching is the real test)?"""
    return _dynsym_contains(path, symbol)


def _dynsym_contains(path: str, symbol: str) -> bool:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return False
    return (b"\x00" + symbol.encode() + b"\x00") in data


def find_libraries(short: str, proc_root: str = "/proc", extra: Sequence[str] = ()) -> list[str]:
    """Paths of a shared library (e.g. libssl) on the system and mapped by running processes."""
    found: dict[str, None] = {}
    for p in extra:
        if os.path.exists(p):
            found[os.path.realpath(p)] = None
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
              "/usr/lib64", "/usr/lib", "/usr/local/lib", "/usr/local/nvidia/lib64"):
        for lib in sorted(Path(d).glob(f"{short}.so*")) if os.path.isdir(d) else ():
            if lib.is_file():
                found[os.path.realpath(lib)] = None
    for pid in _pids(proc_root):
        for p in mapped_libraries(pid, short, proc_root):
            found[p] = None
    return list(found)


def _pids(proc_root: str) -> list[int]:
    try:
        return [int(n) for n in os.listdir(proc_root) if n.isdigit()]
    except OSError:
        return []


def read_maps(pid: int, proc_root: str = "/proc") -> bytes:
    """/proc/<pid>/maps as bytes (empty when the process is gone or hidden)."""
    try:
        with open(f"{proc_root}/{pid}/maps", "rb") as f:
            return f.read()
    except OSError:
        return b""


def libraries_in(maps: bytes, pid: int, short: str, proc_root: str = "/proc") -> list[str]:
    """Files named like `short`.so* in `maps` (read_maps of `pid`), as paths on this host.

    Every traced process is asked this every `trace.library_rescan_s`, for several
    libraries, so a process that maps nothing of the name costs one substring search, and
    a library's several mappings (one per segment) one path resolution, not one each
    (docs/performance.md, session 34)."""
    name = os.fsencode("/" + short)
    if name not in maps:
        return []
    paths: dict[str, None] = {}
    for raw in maps.split(b"\n"):
        if name in raw:
            line = os.fsdecode(raw)
            paths[line.split(None, 5)[-1] if line.count(" ") >= 5 else ""] = None
    out: dict[str, None] = {}
    for path in paths:
        base = os.path.basename(path)
        if base.startswith(short + ".so") or base.startswith(short + "-"):
            host_path = f"{proc_root}/{pid}/root{path}"
            real = path if os.path.exists(path) else host_path
            out[os.path.realpath(real)] = None
    return list(out)


def mapped_libraries(pid: int, short: str, proc_root: str = "/proc") -> list[str]:
    """Files named like `short`.so* that process `pid` maps (its own view of the path)."""
    return libraries_in(read_maps(pid, proc_root), pid, short, proc_root)


_SHT_DYNSYM = 11
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size


_EXPORTS_MAX = 256
_exports: dict[tuple[str, str, int, int, int, int], bool] = {}


def elf_exports(path: str, symbol: str) -> bool:
    """Does the ELF64 file define `symbol` in its dynamic symbol table? (A program that
    links OpenSSL statically and exports it, as node does, is probed like libssl.)

    Remembered per file (device, inode, size, mtime): every library rescan asks it of each
    traced process that maps no libssl, and reading node's symbol table takes ~10 ms."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (path, symbol, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _exports.get(key)
    if known is not None:
        return known
    try:
        with open(path, "rb") as f:
            found = _defines(f, symbol.encode())
    except (OSError, ValueError, struct.error):
        found = False
    if len(_exports) >= _EXPORTS_MAX:
        _exports.clear()
    _exports[key] = found
    return found


def _defines(f: BinaryIO, name: bytes) -> bool:
    eh = f.read(64)
    if eh[:4] != b"\x7fELF" or eh[4] != 2 or eh[5] != 1:  # ELF64, little-endian
        return False
    shoff, = struct.unpack_from("<Q", eh, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", eh, 0x3A)
    f.seek(shoff)
    table = f.read(shentsize * shnum)
    sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != _SHT_DYNSYM or entsize != _SYM.size or link >= shnum:
            continue
        str_off, str_size = sections[link][4], sections[link][5]
        f.seek(str_off)
        at = f.read(str_size).find(b"\x00" + name + b"\x00")
        if at < 0:
            return False
        f.seek(off)
        syms = f.read(size - size % _SYM.size)
        return any(n == at + 1 and shndx != 0 for n, _, _, shndx, _, _ in _SYM.iter_unpack(syms))
    return False


def _exe_path(pid: int, proc_root: str) -> str | None:
    """The program of `pid` as a path on this host (through its root when in a container)."""
    try:
        path = os.readlink(f"{proc_root}/{pid}/exe")
    except OSError:
        return None
    real = path if os.path.exists(path) else f"{proc_root}/{pid}/root{path}"
    return os.path.realpath(real)


def ssl_executable(pid: int, proc_root: str = "/proc", maps: bytes | None = None) -> str | None:
    """The program of `pid` when it maps no libssl but exports SSL_read itself (`maps`:
    its read_maps, when the caller has it already)."""
    if maps is None:
        maps = read_maps(pid, proc_root)
    if libraries_in(maps, pid, "libssl", proc_root):
        return None
    exe = _exe_path(pid, proc_root)
    return exe if exe is not None and elf_exports(exe, "SSL_read") else None


def ssl_executables(proc_root: str = "/proc") -> list[str]:
    """Running programs that carry OpenSSL inside (see ssl_executable), each looked at once."""
    seen: dict[str, bool] = {}
    for pid in _pids(proc_root):
        if mapped_libraries(pid, "libssl", proc_root):
            continue
        exe = _exe_path(pid, proc_root)
        if exe is not None and exe not in seen:
            seen[exe] = elf_exports(exe, "SSL_read")
    return [exe for exe, yes in seen.items() if yes]


def tracepoint_checks(tps: Sequence[Tracepoint], root: Path | None) -> list[Check]:
    """One row per probe group: how many of its tracepoints exist, naming the missing."""
    groups: dict[str, list[Tracepoint]] = {}
    for tp in tps:
        groups.setdefault(tp.group, []).append(tp)
    out = []
    for group, members in groups.items():
        missing = [tp for tp in members
                   if root is None or not (root / "events" / tp.category / tp.event / "id").exists()]
        detail = f"{len(members) - len(missing)}/{len(members)} present"
        if missing:
            detail += "; missing " + ", ".join(tp.name for tp in missing)
        fix = "needs CONFIG_FTRACE_SYSCALLS" if any(tp.category == "syscalls" for tp in missing) \
            else "optional: this kernel lacks them; the agent runs without"
        # a group fails the agent only when a required tracepoint of it is missing
        out.append(Check(f"tracepoints ({group})", not missing, detail, fix,
                         core=any(tp.required for tp in missing)))
    return out
