"""CPU cost of `sits-trace top` itself: the TUI in a real terminal (tmux), refreshing every
second from a `sits-trace run` daemon's API socket while ~1,000 spans/s flow (nginx under a
paced `hey`: every request is a SERVER span in nginx and a CLIENT span in hey).

The figure is the top process's own CPU (utime + stime from /proc/<pid>/stat) over the
measurement, as a percentage of one core; the daemon's CPU and the span rate it saw are printed
beside it. Needs root (the daemon loads the probes), nginx, hey and tmux.

Usage: bench/top_cost.py [--seconds 30] [--rate 500] [--interval 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import RUN_READY, free_port, start_nginx

SITS = str(Path(sys.executable).parent / "sits-trace")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def snapshot(sock: Path) -> dict[str, object]:
    out = subprocess.run([SITS, "top", "--once", "--json", "--socket", str(sock)],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    snap: dict[str, object] = json.loads(out)
    return snap


def pane_pid(session: str) -> int:
    out = subprocess.run(["tmux", "list-panes", "-t", session, "-F", "#{pane_pid}"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=int, default=500, help="requests/s (two spans each)")
    ap.add_argument("--interval", type=float, default=1.0, help="top's refresh interval")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        port = free_port()
        sock = tmp / "api.sock"
        cfg = tmp / "c.toml"
        cfg.write_text(f'[trace]\ncpu_budget = 0\n[export]\njsonl_path = ""\n'
                       f'[api]\nsocket = "{sock}"\n')
        nginx = start_nginx(tmp, port, 1)
        daemon = subprocess.Popen([SITS, "run", "-c", str(cfg)], stderr=subprocess.PIPE, text=True)
        session = f"sits-top-bench-{port}"
        load = None
        try:
            assert daemon.stderr is not None
            for line in daemon.stderr:
                if line.startswith(RUN_READY):
                    break
            else:
                raise SystemExit("bench: the daemon did not start")
            # two workers, each paced: hey -q is requests per second per worker
            load = subprocess.Popen(["hey", "-z", f"{args.seconds + 15:.0f}s", "-c", "2",
                                     "-q", str(args.rate // 2), f"http://127.0.0.1:{port}/"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                            f"{SITS} top --socket {sock} --interval {args.interval}"], check=True)
            time.sleep(5)  # start-up (imports, first frames) is not the steady cost
            top_pid = pane_pid(session)
            s0, t0, c0, d0 = snapshot(sock), time.monotonic(), cpu_seconds(top_pid), \
                cpu_seconds(daemon.pid)
            time.sleep(args.seconds)
            s1, t1, c1, d1 = snapshot(sock), time.monotonic(), cpu_seconds(top_pid), \
                cpu_seconds(daemon.pid)
            assert isinstance(s0["spans_seen"], int) and isinstance(s1["spans_seen"], int)
            wall = t1 - t0
            result = {
                "seconds": round(wall, 1), "interval_s": args.interval,
                "spans_per_s": round((s1["spans_seen"] - s0["spans_seen"]) / wall, 1),
                "routes": len(s1["routes"]),  # type: ignore[arg-type]
                "top_cpu_pct_of_core": round(100 * (c1 - c0) / wall, 2),
                "daemon_cpu_pct_of_core": round(100 * (d1 - d0) / wall, 1),
            }
            print(json.dumps(result))
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], check=False,
                           capture_output=True)
            if load is not None:
                load.terminate()
                load.wait(10)
            daemon.terminate()
            daemon.wait(30)
            nginx.terminate()
            nginx.wait(10)


if __name__ == "__main__":
    main()
