"""PCIe contention for the GPU scenario: bulk host->device copies from pinned memory.

Copies a 256 MiB pinned host buffer to the GPU with non-blocking copies on its own stream, in
a loop, until it is killed or --seconds pass; prints its copy count, bytes and GB/s (JSON) on
SIGTERM/exit.

    python3 tests/gpu/competitor.py --seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--mib", type=int, default=256)
    a = ap.parse_args()
    src = torch.empty(a.mib * MIB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(a.mib * MIB, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    copies = 0
    print(f"ready pid={os.getpid()}", flush=True)
    t0 = time.monotonic()
    with torch.cuda.stream(stream):
        while not stop["now"] and time.monotonic() - t0 < a.seconds:
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
                copies += 1
            stream.synchronize()
    dt = time.monotonic() - t0
    nbytes = copies * a.mib * MIB
    print(json.dumps({"pid": os.getpid(), "copies": copies, "bytes": nbytes,
                      "gb_per_s": nbytes / dt / 1e9, "seconds": dt}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
