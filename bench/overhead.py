"""Overhead of tracing: nginx under wrk (keep-alive), with and without the agent.

Runs are interleaved (off, on, off, on, ...) so drift of this noisy machine hits
both sides alike; the result is the median of the per-pair ratios of
throughput and of p99 latency. With the agent on, it traces nginx and writes
every span as JSON to /dev/null (`sits-trace trace --json`), so span assembly
and serialisation are in the cost. Its stats line says whether events were lost.

Usage: bench/overhead.py [--pairs 5] [--seconds 5] [--connections 50] [--threads 1] [--paced-ms N]
Writes a JSON summary to bench/results/overhead-<time>.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITS = str(Path(sys.executable).parent / "sits-trace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_nginx(d: Path, port: int, workers: int) -> subprocess.Popen[bytes]:
    conf = d / "nginx.conf"
    conf.write_text(f"""
worker_processes {workers};
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{ return 200 "hello from nginx\\n"; }}
    }}
}}
""")
    p = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(d)])
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p
        except OSError:
            time.sleep(0.05)
    raise SystemExit("bench: nginx did not start")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


PACE_SCRIPT: str | None = None  # a wrk lua script whose delay() paces each connection


def run_wrk(port: int, seconds: int, conns: int, threads: int) -> dict[str, float]:
    extra = ["-s", PACE_SCRIPT] if PACE_SCRIPT else []
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--latency", *extra,
         f"http://127.0.0.1:{port}/"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", out)
    p99 = float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")
    return {"rps": rps, "p99_ms": p99}


def start_agent(pid: int) -> subprocess.Popen[str]:
    p = subprocess.Popen([SITS, "trace", "--json", "--pid", str(pid)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    for line in p.stderr:
        if "tracing" in line:
            return p
    raise SystemExit("bench: agent did not start")


def stop_agent(p: subprocess.Popen[str]) -> str:
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    return err.strip().splitlines()[-1] if err.strip() else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--paced-ms", type=int, default=0,
                    help="pace each connection (wrk delay() in ms): a steady load below saturation")
    args = ap.parse_args()
    global PACE_SCRIPT
    pace_dir = tempfile.mkdtemp()
    port = free_port()
    pairs: list[dict[str, object]] = []
    if args.paced_ms:
        PACE_SCRIPT = str(Path(pace_dir) / "pace.lua")
        Path(PACE_SCRIPT).write_text(f"function delay() return {args.paced_ms} end\n")
    with tempfile.TemporaryDirectory() as d:
        nginx = start_nginx(Path(d), port, args.workers)
        try:
            run_wrk(port, 2, args.connections, args.threads)  # warm-up
            for i in range(args.pairs):
                off = run_wrk(port, args.seconds, args.connections, args.threads)
                agent = start_agent(nginx.pid)
                time.sleep(0.5)
                on = run_wrk(port, args.seconds, args.connections, args.threads)
                stats = stop_agent(agent)
                pairs.append({"off": off, "on": on, "agent": stats})
                print(f"pair {i + 1}: off {off['rps']:.0f} rps p99 {off['p99_ms']:.2f} ms | "
                      f"on {on['rps']:.0f} rps p99 {on['p99_ms']:.2f} ms | {stats}", flush=True)
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)
    tput = statistics.median(p["on"]["rps"] / p["off"]["rps"] for p in pairs)  # type: ignore[index]
    p99 = statistics.median(p["on"]["p99_ms"] / p["off"]["p99_ms"] for p in pairs)  # type: ignore[index]
    summary = {"throughput_ratio": round(tput, 3), "p99_ratio": round(p99, 3), "args": vars(args),
               "pairs": pairs}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"throughput ratio (traced/untraced, median of {len(pairs)} pairs): {tput:.3f}")
    print(f"p99 latency ratio (traced/untraced): {p99:.3f}")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
