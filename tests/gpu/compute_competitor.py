"""GPU compute contention for the RCA scenario: bf16 matrix products on the same GPU, in a loop.

Runs 16384^3 products (32 queued per sync) on its own stream until killed or --seconds pass; prints its
product count (JSON) on SIGTERM/exit. It copies almost nothing: its mark is kernel launches.

    python3 tests/gpu/compute_competitor.py --seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--queue", type=int, default=32, help="products queued per sync")
    a = ap.parse_args()
    x = torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    n = 0
    print(f"ready pid={os.getpid()}", flush=True)
    t0 = time.monotonic()
    with torch.cuda.stream(stream):
        while not stop["now"] and time.monotonic() - t0 < a.seconds:
            for _ in range(a.queue):
                torch.mm(x, y)
                n += 1
            stream.synchronize()
    dt = time.monotonic() - t0
    print(json.dumps({"pid": os.getpid(), "products": n, "tflops": 2 * a.n ** 3 * n / dt / 1e12,
                      "seconds": dt}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
