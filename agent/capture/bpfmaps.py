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

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf

    def lookup(self, name: str, key: bytes) -> bytes | None:
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
