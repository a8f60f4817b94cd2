"""The agent's CPU while a client hammers a port nobody listens on any more.

A second nginx is started and given one wrk connection (paced, 1 request a second), then
stopped: wrk keeps reconnecting as fast as it can, every attempt refused with a reset each way
(~40k a second here). The agent traces the first nginx (`trace --json`, default budget), which
keeps serving a few requests a second. Prints the agent's cores over the storm, the resets the
kernel sent (nstat's TcpOutRsts) and the agent's stats line; with --baseline, each round runs
that checkout's agent too, alternating.

Usage: bench/tcp_storm.py [--seconds 8] [--rounds 2] [--baseline /path/to/other/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # the sibling bench: nginx helpers


def out_rsts() -> int:
    """TcpOutRsts from /proc/net/snmp (a header line, then a line of values)."""
    head, values = (ln.split()[1:] for ln in Path("/proc/net/snmp").read_text().splitlines()
                    if ln.startswith("Tcp:"))
    return int(dict(zip(head, values, strict=True))["OutRsts"])


def one(sits: str, seconds: float) -> tuple[float, int, str]:
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        traced_port, dead_port = overhead.free_port(), overhead.free_port()
        traced = overhead.start_nginx(Path(d1), traced_port, 1)
        dying = overhead.start_nginx(Path(d2), dead_port, 1)
        agent = subprocess.Popen([sits, "trace", "--json", "--pid", str(traced.pid)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert agent.stderr is not None
        for line in agent.stderr:
            if line.startswith(overhead.TRACE_READY):
                break
        pace = Path(d2) / "pace.lua"
        pace.write_text("function delay() return 1000 end\n")
        wrk = subprocess.Popen(["wrk", "-t1", "-c1", f"-d{seconds + 4:.0f}s", "-s", str(pace),
                                f"http://127.0.0.1:{dead_port}/"], stdout=subprocess.DEVNULL)
        time.sleep(1.5)
        dying.terminate()
        dying.wait(timeout=10)
        time.sleep(1)
        c0, r0, t0 = overhead.cpu_seconds(agent.pid), out_rsts(), time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:  # the traced server keeps working meanwhile
            subprocess.run(["curl", "-s", "-o", "/dev/null", f"http://127.0.0.1:{traced_port}/"],
                           check=False)
            time.sleep(0.2)
        cores = (overhead.cpu_seconds(agent.pid) - c0) / (time.monotonic() - t0)
        resets = out_rsts() - r0
        wrk.wait(timeout=60)
        lines = overhead.stop_agent(agent)
        traced.terminate()
        traced.wait(timeout=10)
    stats = next((ln for ln in reversed(lines) if "records=" in ln), "")
    return cores, resets, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="python of another checkout's venv, alternated")
    a = ap.parse_args()
    sides = {"this": str(Path(sys.executable).parent / "sits-trace")}
    if a.baseline:
        sides["base"] = str(Path(a.baseline).parent / "sits-trace")
    for r in range(a.rounds):
        for name, sits in sides.items():
            cores, resets, stats = one(sits, a.seconds)
            print(f"round {r + 1} [{name}]: agent {cores:.3f} cores while the kernel sent "
                  f"{resets / a.seconds:.0f} resets/s | {stats}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
