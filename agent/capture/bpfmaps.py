"""Kernel maps as bytes: what the node-signal readers see of BCC's tables.

Readers decode keys and values with their own ctypes mirrors, so a dict of recorded
bytes (tests/unit) stands in for the kernel exactly as BccMaps does for real maps.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any, Protocol


class MapAccess(Protocol):
    def lookup(self, name: str, key: bytes) -> bytes | None:
        """The value stored under `key`, or None."""

    def items(self, name: str) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of a hash or array map."""

    def percpu_sums(self, name: str) -> list[int]:
        """A per-CPU array of u64: each index summed over the CPUs."""

    def update(self, name: str, key: bytes, value: bytes) -> None: ...


class BccMaps:
    """MapAccess over a loaded bcc.BPF object."""

    _PERCPU_TYPES = frozenset({5, 6, 10})  # BPF_MAP_TYPE_PERCPU_HASH, _ARRAY, LRU_PERCPU_HASH

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf
        # per map: (fd, key buffer, value buffer) for one bpf(2) lookup with no allocation,
        # or None where BCC's own path is needed (per-CPU values); span annotators look up
        # a map per span, and BCC's __getitem__ allocated and converted each time
        self._fast: dict[str, tuple[int, Any, Any] | None] = {}
        try:
            from bcc.libbcc import lib  # noqa: PLC0415 - BCC only where the agent loads maps
        except ImportError:
            lib = None
        self._lib = lib

    def _prepare(self, name: str) -> tuple[int, Any, Any] | None:
        t = self._bpf[name]
        if self._lib is None or getattr(t, "ttype", 5) in self._PERCPU_TYPES:
            return None
        return (int(t.map_fd), ctypes.create_string_buffer(ctypes.sizeof(t.Key)),
                ctypes.create_string_buffer(ctypes.sizeof(t.Leaf)))

    def lookup(self, name: str, key: bytes) -> bytes | None:
        if name not in self._fast:
            self._fast[name] = self._prepare(name)
        fast = self._fast[name]
        if fast is not None and len(key) == len(fast[1]):
            fd, kbuf, vbuf = fast
            ctypes.memmove(kbuf, key, len(key))
            if self._lib.bpf_lookup_elem(fd, kbuf, vbuf) != 0:
                return None
            return bytes(vbuf.raw)
        t = self._bpf[name]
        try:
            return bytes(t[t.Key.from_buffer_copy(key)])
        except KeyError:
            return None

    def items(self, name: str) -> list[tuple[bytes, bytes]]:
        return [(bytes(k), bytes(v)) for k, v in self._bpf[name].items()]

    def percpu_sums(self, name: str) -> list[int]:
        t = self._bpf[name]
        return [sum(int(x) for x in t.getvalue(t.Key(i))) for i in range(len(t))]

    def update(self, name: str, key: bytes, value: bytes) -> None:
        t = self._bpf[name]
        t[t.Key.from_buffer_copy(key)] = t.Leaf.from_buffer_copy(value)


class DictMaps:
    """MapAccess over plain dicts of bytes: recorded fixtures, unit tests."""

    def __init__(self, maps: Mapping[str, dict[bytes, bytes]] | None = None,
                 percpu: Mapping[str, list[int]] | None = None) -> None:
        self.maps: dict[str, dict[bytes, bytes]] = {k: dict(v) for k, v in (maps or {}).items()}
        self.percpu: dict[str, list[int]] = {k: list(v) for k, v in (percpu or {}).items()}

    def lookup(self, name: str, key: bytes) -> bytes | None:
        return self.maps.get(name, {}).get(key)

    def items(self, name: str) -> list[tuple[bytes, bytes]]:
        return list(self.maps.get(name, {}).items())

    def percpu_sums(self, name: str) -> list[int]:
        return list(self.percpu.get(name, []))

    def update(self, name: str, key: bytes, value: bytes) -> None:
        self.maps.setdefault(name, {})[key] = value


def u32(v: int) -> bytes:
    return bytes(ctypes.c_uint32(v))


def u64(v: int) -> bytes:
    return bytes(ctypes.c_uint64(v))


def as_u64(raw: bytes) -> int:
    return int.from_bytes(raw[:8], "little")


class _ProgInfo(ctypes.Structure):
    """The head of struct bpf_prog_info (uapi/linux/bpf.h) up to recursion_misses."""

    _fields_ = [
        ("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32), ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16), ("ifindex", ctypes.c_uint32),
        ("gpl_compatible", ctypes.c_uint32), ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64), ("nr_jited_ksyms", ctypes.c_uint32),
        ("nr_jited_func_lens", ctypes.c_uint32), ("jited_ksyms", ctypes.c_uint64),
        ("jited_func_lens", ctypes.c_uint64), ("btf_id", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32), ("func_info", ctypes.c_uint64),
        ("nr_func_info", ctypes.c_uint32), ("nr_line_info", ctypes.c_uint32),
        ("line_info", ctypes.c_uint64), ("jited_line_info", ctypes.c_uint64),
        ("nr_jited_line_info", ctypes.c_uint32), ("line_info_rec_size", ctypes.c_uint32),
        ("jited_line_info_rec_size", ctypes.c_uint32), ("nr_prog_tags", ctypes.c_uint32),
        ("prog_tags", ctypes.c_uint64), ("run_time_ns", ctypes.c_uint64),
        ("run_cnt", ctypes.c_uint64), ("recursion_misses", ctypes.c_uint64),
    ]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32),
                ("info", ctypes.c_uint64)]


_SYS_BPF = 321  # x86-64
_BPF_OBJ_GET_INFO_BY_FD = 15


def recursion_misses(prog_fd: int) -> int | None:
    """How often the kernel skipped this program because another BPF program was running on
    the CPU (tracepoint programs do not nest): events the program never saw."""
    info = _ProgInfo()
    attr = _InfoAttr(prog_fd, ctypes.sizeof(info), ctypes.addressof(info))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_BPF, _BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr), ctypes.sizeof(attr)):
        return None
    if attr.info_len < _ProgInfo.recursion_misses.offset + 8:
        return None
    return int(info.recursion_misses)
