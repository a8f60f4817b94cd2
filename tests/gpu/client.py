"""Load for the GPU scenario: N sequential GETs over one keep-alive connection to 127.0.0.1.

Prints one JSON line: the client-side latencies' p50/p90/p99 in ms and the request count.

    python3 tests/gpu/client.py --port 8088 --requests 2000
"""

from __future__ import annotations

import argparse
import http.client
import json
import time


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8088)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    a = ap.parse_args()
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)
    lat: list[float] = []
    t_end = time.monotonic() + a.max_seconds
    errors = 0
    for _ in range(a.requests):
        if time.monotonic() > t_end:
            break
        t0 = time.perf_counter()
        conn.request("GET", "/infer")
        r = conn.getresponse()
        r.read()
        lat.append((time.perf_counter() - t0) * 1e3)
        errors += r.status != 200
    print(json.dumps({"requests": len(lat), "errors": errors, "p50_ms": percentile(lat, 50),
                      "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
                      "mean_ms": sum(lat) / max(1, len(lat))}), flush=True)


if __name__ == "__main__":
    main()
