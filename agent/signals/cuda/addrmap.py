"""Address ranges of a process's allocations: the direction of cuMemcpy / cuMemcpyAsync.

Copies through cuMemcpy/cuMemcpyAsync name no direction: it is resolved from the address
ranges that allocations the agent saw returned (device, pinned host, registered host). A
pointer outside every known range counts as pageable host memory only when the process called
cuInit after the agent started (so every allocation was seen); otherwise the direction stays
'unknown'.
"""

from __future__ import annotations

import bisect

from sits_trace.agent.capture.wire import CopyDir, MemKind

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
