"""Reading cuda.c's maps (`cuda_procs`, `cuda_slots`): over BCC, or over dicts in unit tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from sits_trace.agent.capture.wire import CudaSlotKeyC


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
