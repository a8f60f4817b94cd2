"""cuda_slots' reader against BCC's: the same entries, and µs per read of a 65,536-entry LRU hash.

    .venv/bin/python bench/batch_read.py [--reads 50]      (root: loads a BPF map)

agent/signals/cuda/maps.py's BatchReader reads a hash map with BPF_MAP_LOOKUP_BATCH into
buffers it keeps; BCC's items_lookup_batch allocates arrays for the whole map on each call.
The agent reads cuda_slots once per loop (50 a second) on a node where libcuda is probed.
The map here has cuda_slots' capacity and key and value sizes.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

from sits_trace.agent.capture.wire import CudaSlotC, CudaSlotKeyC
from sits_trace.agent.signals.cuda.maps import BatchReader

PROGRAM = """
struct k { u8 raw[%d]; };
struct v { u8 raw[%d]; };
BPF_TABLE("lru_hash", struct k, struct v, m, 65536);
"""


def per_read_us(fn: Callable[[], object], reads: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reads):
        fn()
    return (time.perf_counter() - t0) / reads * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reads", type=int, default=50)
    a = ap.parse_args()
    from bcc import BPF
    from bcc.libbcc import lib

    b = BPF(text=PROGRAM % (ctypes.sizeof(CudaSlotKeyC), ctypes.sizeof(CudaSlotC)))
    t = b["m"]
    reader = BatchReader(lib, int(t.map_fd), ctypes.sizeof(t.Key), ctypes.sizeof(t.Leaf))
    filled = 0
    for fill in (0, 100, 3000):
        for i in range(filled, fill):
            t[t.Key.from_buffer_copy(bytes(CudaSlotKeyC(slot=i, tgid=7)))] = \
                t.Leaf.from_buffer_copy(bytes(CudaSlotC(launches=i)))
        filled = fill
        ours = sorted(reader.read())
        theirs = sorted((bytes(k), bytes(v)) for k, v in t.items_lookup_batch())
        assert ours == theirs and len(ours) == fill, (len(ours), len(theirs))
        print(f"{fill:5d} entries: BCC items_lookup_batch "
              f"{per_read_us(lambda: list(t.items_lookup_batch()), a.reads):7.0f} µs/read, "
              f"BatchReader {per_read_us(reader.read, a.reads):7.0f} µs/read (same entries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
