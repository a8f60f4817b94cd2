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
