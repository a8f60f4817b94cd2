"""Member offsets of kernel structs, read from the running kernel's BTF (/sys/kernel/btf/vmlinux).

The kernel programs read no kernel struct through compiled-in headers (Debian's 6.1 headers
need not match the running kernel). Where a program must walk kernel memory (a socket's
addresses at accept/connect, when the syscall's own buffer is NULL), it takes the offsets as
-D flags computed here from the kernel's own type information, so they are right for the
kernel that runs. A kernel without BTF gets no flags and the walk is compiled out.

BTF layout: a header, then type records (each `name_off, info, size|type` and a kind-specific
tail), then a string table (include/uapi/linux/btf.h).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
_MAGIC = 0xEB9F
_STRUCT, _UNION = 4, 5
_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG = 8, 9, 10, 11, 18
# bytes that follow the 12-byte common record, per kind: fixed, and per vlen entry
_TAIL = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8), 14: (4, 0),
         15: (0, 12), 17: (4, 0), 19: (0, 12)}


class BtfError(ValueError):
    """The BTF blob is not what this parser understands, or a struct/member is missing."""


@dataclass(frozen=True, slots=True)
class _Type:
    name_off: int
    kind: int
    kind_flag: bool
    vlen: int
    ref: int  # size (struct, union) or referenced type id (typedef, pointer, ...)
    tail: int  # byte offset of the kind-specific tail in the type section


class Btf:
    """The struct and union types of one BTF blob, with member lookup through anonymous members."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 24:
            raise BtfError("BTF blob too short")
        magic, _ver, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
        if magic != _MAGIC:
            raise BtfError(f"bad BTF magic {magic:#x}")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", blob, 8)
        self._types_at = hdr_len + type_off
        self._blob = blob
        self._str = blob[hdr_len + str_off: hdr_len + str_off + str_len]
        self._types: list[_Type | None] = [None]  # ids start at 1
        self._by_name: dict[str, int] = {}
        self._parse(type_len)

    @classmethod
    def from_file(cls, path: Path = VMLINUX) -> Btf:
        return cls(path.read_bytes())

    def _parse(self, type_len: int) -> None:
        pos, end = self._types_at, self._types_at + type_len
        blob = self._blob
        while pos < end:
            name_off, info, ref = struct.unpack_from("<III", blob, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            fixed, per = _TAIL.get(kind, (0, 0))
            t = _Type(name_off, kind, bool(info >> 31), vlen, ref, pos + 12)
            self._types.append(t)
            if kind in (_STRUCT, _UNION) and name_off:
                self._by_name.setdefault(self._name(name_off), len(self._types) - 1)
            pos += 12 + fixed + per * vlen

    def _name(self, off: int) -> str:
        end = self._str.find(b"\0", off)
        return self._str[off:end].decode()

    def _resolve(self, tid: int) -> _Type | None:
        """Through typedef/const/volatile/restrict/type tags to the type itself."""
        for _ in range(32):
            t = self._types[tid] if 0 < tid < len(self._types) else None
            if t is None or t.kind not in (_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG):
                return t
            tid = t.ref
        return None

    def _members(self, t: _Type) -> list[tuple[str, int, int]]:
        """(name, type id, bit offset) of each member."""
        out = []
        for i in range(t.vlen):
            name_off, tid, off = struct.unpack_from("<III", self._blob, t.tail + 12 * i)
            out.append((self._name(name_off), tid, off & 0xFFFFFF if t.kind_flag else off))
        return out

    def _find(self, t: _Type, member: str) -> int | None:
        for name, tid, bits in self._members(t):
            if name == member:
                return bits
            if not name:  # an anonymous struct or union: look inside
                inner = self._resolve(tid)
                if inner is not None and inner.kind in (_STRUCT, _UNION):
                    sub = self._find(inner, member)
                    if sub is not None:
                        return bits + sub
        return None

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of `member` in `struct struct_name` (anonymous members searched)."""
        tid = self._by_name.get(struct_name)
        if tid is None:
            raise BtfError(f"struct {struct_name} not in BTF")
        t = self._types[tid]
        assert t is not None
        bits = self._find(t, member)
        if bits is None:
            raise BtfError(f"struct {struct_name} has no member {member}")
        if bits % 8:
            raise BtfError(f"{struct_name}.{member} is a bitfield")
        return bits // 8


# What the socket walk in bpf/http.c needs: task -> files -> fdt -> fd[] -> file ->
# private_data (struct socket: its type) -> sk -> __sk_common's addresses and ports.
SOCKET_WALK: Sequence[tuple[str, str, str]] = (
    ("SITS_OFF_TASK_FILES", "task_struct", "files"),
    ("SITS_OFF_FILES_FDT", "files_struct", "fdt"),
    ("SITS_OFF_FDT_MAX_FDS", "fdtable", "max_fds"),
    ("SITS_OFF_FDT_FD", "fdtable", "fd"),
    ("SITS_OFF_FILE_PRIVATE", "file", "private_data"),
    ("SITS_OFF_SOCKET_SK", "socket", "sk"),
    ("SITS_OFF_SOCKET_TYPE", "socket", "type"),
    ("SITS_OFF_SKC_DADDR", "sock_common", "skc_daddr"),
    ("SITS_OFF_SKC_RCV_SADDR", "sock_common", "skc_rcv_saddr"),
    ("SITS_OFF_SKC_DPORT", "sock_common", "skc_dport"),
    ("SITS_OFF_SKC_NUM", "sock_common", "skc_num"),
    ("SITS_OFF_SKC_FAMILY", "sock_common", "skc_family"),
    ("SITS_OFF_SKC_V6_DADDR", "sock_common", "skc_v6_daddr"),
    ("SITS_OFF_SKC_V6_RCV_SADDR", "sock_common", "skc_v6_rcv_saddr"),
)


def socket_walk_defines(btf: Btf | None = None, path: Path = VMLINUX) -> dict[str, int]:
    """The -D flags of the socket walk, or {} (walk compiled out) without usable BTF."""
    try:
        b = btf if btf is not None else Btf.from_file(path)
        out = {name: b.offset(s, m) for name, s, m in SOCKET_WALK}
    except (OSError, BtfError):
        return {}
    out["SITS_SOCK_WALK"] = 1
    return out


def run_delay_defines(btf: Btf | None = None, path: Path = VMLINUX) -> dict[str, int]:
    """SITS_OFF_TASK_RUN_DELAY: where a task keeps its run-queue waits' total
    (task_struct.sched_info.run_delay, ns: what /proc/<tid>/schedstat's second field shows),
    which bpf/events.h copies into each EV_DATA; {} without usable BTF."""
    try:
        b = btf if btf is not None else Btf.from_file(path)
        return {"SITS_OFF_TASK_RUN_DELAY": b.offset("task_struct", "sched_info")
                + b.offset("sched_info", "run_delay")}
    except (OSError, BtfError):
        return {}


def kernel_defines(path: Path = VMLINUX) -> dict[str, int]:
    """Every -D flag read from the running kernel's BTF (one parse): the socket walk's and
    the run-queue counter's offsets."""
    try:
        b = Btf.from_file(path)
    except (OSError, BtfError):
        return {}
    return {**socket_walk_defines(b), **run_delay_defines(b)}
