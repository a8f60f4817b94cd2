"""Reading cuda.c's maps (`cuda_procs`, `cuda_slots`): over BCC, or over dicts in unit tests."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Any, Protocol

from sits_trace.agent.capture.wire import CudaSlotKeyC


class CudaMaps(Protocol):
    def procs(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of `cuda_procs`."""

    def slots(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of `cuda_slots`."""

    def delete_slots(self, keys: Sequence[bytes]) -> None: ...


class BatchReader:
    """Every (key, value) of a hash map by BPF_MAP_LOOKUP_BATCH, `chunk` entries a call, into
    buffers kept between reads. BCC's items_lookup_batch allocates key and value arrays for
    the map's whole capacity on every call (65,536 slots here: ~3 MB each loop)."""

    def __init__(self, lib: Any, fd: int, key_size: int, value_size: int,
                 chunk: int = 1024) -> None:
        self._lib = lib
        self._fd = fd
        self._ks, self._vs, self._chunk = key_size, value_size, chunk
        self._keys = ctypes.create_string_buffer(key_size * chunk)
        self._values = ctypes.create_string_buffer(value_size * chunk)

    def read(self) -> list[tuple[bytes, bytes]]:
        """Raises OSError when the kernel refuses (no batch ops: EINVAL)."""
        out: list[tuple[bytes, bytes]] = []
        ks, vs = self._ks, self._vs
        token = ctypes.c_uint32(0)
        count = ctypes.c_uint32(0)
        first = True
        while True:
            count.value = self._chunk
            res = self._lib.bpf_lookup_batch(self._fd, None if first else ctypes.byref(token),
                                             ctypes.byref(token), self._keys, self._values,
                                             ctypes.byref(count))
            err = ctypes.get_errno()
            n = count.value
            if n:
                kb = ctypes.string_at(self._keys, n * ks)
                vb = ctypes.string_at(self._values, n * vs)
                out.extend((kb[i * ks:(i + 1) * ks], vb[i * vs:(i + 1) * vs]) for i in range(n))
            if res != 0:
                if err == errno.ENOENT:  # the end of the map
                    return out
                raise OSError(err, os.strerror(err))
            if n == 0:  # no progress (a concurrent update): what was read
                return out
            first = False


class BccCudaMaps:
    """CudaMaps over a loaded bcc.BPF object: batch syscalls where the kernel has them."""

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf
        self._batch = True
        self._reader: BatchReader | None = None

    def procs(self) -> list[tuple[bytes, bytes]]:
        return [(bytes(k), bytes(v)) for k, v in self._bpf["cuda_procs"].items()]

    def slots(self) -> list[tuple[bytes, bytes]]:
        t = self._bpf["cuda_slots"]
        if self._batch:
            try:
                if self._reader is None:
                    from bcc.libbcc import lib  # noqa: PLC0415 - BCC only where maps are loaded

                    self._reader = BatchReader(lib, int(t.map_fd), ctypes.sizeof(t.Key),
                                               ctypes.sizeof(t.Leaf))
                return self._reader.read()
            except Exception:  # noqa: BLE001 - no batch ops (EINVAL), or an older BCC
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
