"""Overhead of tracing: nginx under wrk (keep-alive), with and without the agent.

Runs are interleaved (off, on, off, on, ...) so drift of this noisy machine hits
both sides alike; the result is the median of the per-pair ratios of
throughput and of p99 latency. With the agent on, it traces nginx and writes
every span as JSON to /dev/null (`sits-trace trace --json`), so span assembly
and serialisation are in the cost. Its stats line says whether events were lost.

Usage: bench/overhead.py [--pairs 5] [--seconds 5] [--connections 50] [--threads 1] [--paced-ms N]
                         [--mode trace] [--mode full] [--mode kernel] [--mode kernel-signals]
                         [--mode kernel-skip] [--mode floor] [--mode floor-signals] [--bpf-stats]
                         [--baseline /path/to/other/.venv/bin/python] [--baseline-env NAME=VALUE]
With --baseline, each mode also runs as "<mode>@base" with that interpreter (another checkout's
venv, e.g. main's), interleaved in the same rounds: before/after under the same noise.
With --baseline-env (e.g. SITS_NATIVE=0: this checkout's hot path interpreted, not compiled),
"<mode>@base" runs with that environment, with this checkout's interpreter unless --baseline.
Writes a JSON summary to bench/results/overhead-<time>.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
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
# the agent's own ready lines: matched at a line's start, since a warning before them may
# name agent/tracing/... (the stale compiled build's) or say "running"
TRACE_READY = "sits-trace: tracing;"
RUN_READY = "sits-trace: agent running"


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


def busy_seconds() -> float:
    """CPU seconds spent by the whole machine (all CPUs) outside idle and iowait."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def run_wrk(port: int, seconds: int, conns: int, threads: int) -> dict[str, float]:
    extra = ["-s", PACE_SCRIPT] if PACE_SCRIPT else []
    b0 = busy_seconds()
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--latency", *extra,
         f"http://127.0.0.1:{port}/"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", out)
    p99 = float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")
    busy = busy_seconds() - b0
    # CPU of everything (nginx, wrk, the agent, the kernel) per request: less noisy than
    # throughput when other work shares the machine
    return {"rps": rps, "p99_ms": p99, "cpu_us_per_req": busy / (rps * seconds) * 1e6}


CPU_BUDGET: str | None = None


BASELINE: str | None = None  # --baseline: another checkout's python, for "<mode>@base"
BASELINE_ENV: dict[str, str] = {}  # --baseline-env: the environment of "<mode>@base"


def agent_command(mode: str, pid: int) -> list[str]:
    py, sits, root = sys.executable, SITS, ROOT
    if mode.endswith("@base"):
        if BASELINE:
            py = BASELINE
            sits = str(Path(BASELINE).parent / "sits-trace")
            root = Path(BASELINE).parents[2]  # <checkout>/.venv/bin/python (not resolved)
        mode = mode[:-5]
    if mode == "kernel":  # probes and ring only: what the kernel half costs
        return [py, str(root / "bench" / "kernel_only.py"), "--pid", str(pid)]
    if mode == "kernel-signals":
        return [py, str(root / "bench" / "kernel_only.py"), "--pid", str(pid), "--signals"]
    if mode == "kernel-skip":  # records stepped over, not copied: no reader's work to speak of
        return [py, str(root / "bench" / "kernel_only.py"), "--pid", str(pid), "--signals",
                "--skip"]
    if mode in ("floor", "floor-signals"):  # empty programs on the same tracepoints
        return [py, str(root / "bench" / "kernel_only.py"), "--pid", str(pid), "--floor",
                *(["--signals"] if mode == "floor-signals" else [])]
    cmd = [sits, "trace", "--json", "--pid", str(pid)]
    if mode == "full":  # capture every exchange, whatever it costs
        return [*cmd, "--cpu-budget", "0"]
    return [*cmd, "--cpu-budget", CPU_BUDGET] if CPU_BUDGET else cmd


def start_agent(mode: str, pid: int) -> subprocess.Popen[str]:
    env = {**os.environ, **BASELINE_ENV} if mode.endswith("@base") else None
    p = subprocess.Popen(agent_command(mode, pid), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    assert p.stderr is not None
    for line in p.stderr:
        if line.startswith(TRACE_READY):
            return p
    raise SystemExit("bench: agent did not start")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def stop_agent(p: subprocess.Popen[str]) -> list[str]:
    """SIGINT, then the agent's stderr lines (its stats line last)."""
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    return err.strip().splitlines()


def agent_us_per_span(cpu_s: float, stats: str) -> float | None:
    m = re.search(r"\bspans=(\d+)", stats)
    return cpu_s / int(m.group(1)) * 1e6 if m and int(m.group(1)) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--mode", action="append",
                    choices=["trace", "full", "kernel", "kernel-signals", "kernel-skip", "floor",
                             "floor-signals"],
                    help="what runs in the 'on' runs: the agent as configured (trace, the "
                         "default: it sheds load over trace.cpu_budget), the agent capturing "
                         "everything (full: --cpu-budget 0), or only its kernel programs and a "
                         "ring drain (kernel; kernel-signals: with the node signals' programs "
                         "too, bpf/tcp.c and bpf/sched.c; kernel-skip: kernel-signals with the "
                         "ring's records stepped over, not copied; floor, floor-signals: "
                         "programs that return at once on the same tracepoints, what the "
                         "kernel's dispatch "
                         "costs whatever the programs do); repeat to interleave several in "
                         "each round")
    ap.add_argument("--cpu-budget", help="the agent's trace.cpu_budget in trace mode")
    ap.add_argument("--baseline", help="python of another checkout's venv: every mode also runs "
                                       "as <mode>@base with it, interleaved")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of <mode>@base (repeatable), e.g. SITS_NATIVE=0")
    ap.add_argument("--bpf-stats", action="store_true",
                    help="kernel mode: count BPF program run time (sysctl "
                         "kernel.bpf_stats_enabled=1 while it runs) and print it per program")
    ap.add_argument("--paced-ms", type=int, default=0,
                    help="pace each connection (wrk delay() in ms): a steady load below saturation")
    args = ap.parse_args()
    modes = args.mode or ["trace"]
    global BASELINE
    BASELINE = args.baseline
    BASELINE_ENV.update(kv.split("=", 1) for kv in args.baseline_env)
    if BASELINE or BASELINE_ENV:
        modes = [m for mode in modes for m in (mode, f"{mode}@base")]
    stats_knob = Path("/proc/sys/kernel/bpf_stats_enabled")
    if args.bpf_stats:
        stats_knob.write_text("1")
    global PACE_SCRIPT, CPU_BUDGET
    CPU_BUDGET = args.cpu_budget
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
                # the order alternates pair by pair (ABBA): a mode that always ran first in
                # its pair would carry whatever running first costs
                for mode in (modes if i % 2 == 0 else modes[::-1]):
                    off = run_wrk(port, args.seconds, args.connections, args.threads)
                    agent = start_agent(mode, nginx.pid)
                    time.sleep(0.5)
                    c0 = cpu_seconds(agent.pid)
                    on = run_wrk(port, args.seconds, args.connections, args.threads)
                    time.sleep(0.5)  # the agent finishes what the run left in the ring
                    agent_cpu = cpu_seconds(agent.pid) - c0
                    lines = stop_agent(agent)
                    # the stats line (older checkouts print more lines after it)
                    stats = next((x for x in reversed(lines) if "spans=" in x or "records=" in x),
                                 lines[-1] if lines else "")
                    if args.bpf_stats and mode.startswith("kernel"):
                        print("\n".join(lines[:-1]), flush=True)  # per-program run time
                    per_span = agent_us_per_span(agent_cpu, stats)
                    on["agent_cpu_s"] = agent_cpu
                    if per_span is not None:
                        on["agent_us_per_span"] = per_span
                    pairs.append({"mode": mode, "off": off, "on": on, "agent": stats})
                    spent = f" agent {per_span:.0f} us/span |" if per_span is not None else ""
                    print(f"pair {i + 1} [{mode}]:{spent} off {off['rps']:.0f} rps p99 "
                          f"{off['p99_ms']:.2f} ms {off['cpu_us_per_req']:.1f} us/req | on "
                          f"{on['rps']:.0f} rps p99 {on['p99_ms']:.2f} ms "
                          f"{on['cpu_us_per_req']:.1f} us/req | {stats}", flush=True)
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)
            if args.bpf_stats:
                stats_knob.write_text("0")
    summary: dict[str, object] = {"args": vars(args), "pairs": pairs}
    lines = []
    for mode in modes:
        mine = [p for p in pairs if p["mode"] == mode]
        tput = statistics.median(p["on"]["rps"] / p["off"]["rps"] for p in mine)  # type: ignore[index]
        p99 = statistics.median(p["on"]["p99_ms"] / p["off"]["p99_ms"] for p in mine)  # type: ignore[index]
        cpu = statistics.median(p["on"]["cpu_us_per_req"] - p["off"]["cpu_us_per_req"]  # type: ignore[index]
                                for p in mine)
        spans = [p["on"]["agent_us_per_span"] for p in mine if "agent_us_per_span" in p["on"]]  # type: ignore[index,operator]
        summary[mode] = {"throughput_ratio": round(tput, 3), "p99_ratio": round(p99, 3),
                         "added_cpu_us_per_req": round(cpu, 2)}
        if spans:
            summary[mode]["agent_us_per_span"] = round(statistics.median(spans), 1)  # type: ignore[index]
        lines.append(f"[{mode}] throughput ratio (traced/untraced, median of {len(mine)} pairs): "
                     f"{tput:.3f}; p99 latency ratio: {p99:.3f}; CPU added per request: "
                     f"{cpu:.1f} us" + (f"; agent CPU per span: {statistics.median(spans):.0f} us"
                                         if spans else ""))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
