"""ns a run of each of the agent's kernel programs, on a traced connection in a hot loop.

`bench/overhead.py --bpf-stats` reads the programs' run time beside a real nginx, where the
caches are as cold as a paced load makes them, and this machine's noise moves each figure by
15% from one run to the next. This one measures the programs' own instructions and helper
calls: a child process (traced by pid) holds both ends of a loopback TCP connection and
makes `--count` HTTP/1.1 keep-alive exchanges over it with the calls wrk and nginx make (the
client: write, read; the server: recvfrom, writev of the response's head and body), while
this process loads the agent's programs as `run` does (node signals included), drains the
ring and reads each program's run time (kernel.bpf_stats_enabled=1 meanwhile).

With --baseline, that checkout's python runs this script over its own bpf/, round by round.

--untraced: the programs trace an idle process instead, and the child's exchanges are a
load generator's beside a traced server: what each program costs where it should return at
once (the syscall exits, tcp_probe on sockets that are not traced, the scheduler's).

Usage: bench/prog_cost.py [--rounds 5] [--count 20000] [--untraced]
                          [--baseline /path/to/.venv/bin/python]
Prints ns a run per program and ns an exchange for all programs, per round and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_only import prog_run_stats  # the sibling bench

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: wrk\r\n\r\n"
HEAD = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Mon, 07 Dec 2026 15:00:00 GMT\r\n"
        b"Content-Type: application/octet-stream\r\nContent-Length: 17\r\n"
        b"Connection: keep-alive\r\n\r\n")
BODY = b"hello from nginx\n"
SHOWN = ("sys_exit_recvfrom", "sys_exit_writev", "sys_exit_write", "sys_exit_read",
         "tcp_probe", "sched_switch", "sched_wakeup")


def exchanges(count: int) -> int:
    """The traced child: both ends of one connection, `count` exchanges once told to go."""
    sys.stdin.readline()
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    cli = socket.create_connection(ls.getsockname())
    srv, _ = ls.accept()
    for s in (cli, srv):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cfd, sfd = cli.fileno(), srv.fileno()
    for _ in range(count):
        os.write(cfd, REQUEST)
        srv.recv(4096)  # recvfrom
        os.writev(sfd, [HEAD, BODY])
        os.read(cfd, 4096)
    cli.close()
    srv.close()
    print("done", flush=True)
    return 0


def one(count: int, untraced: bool) -> int:
    """Load the programs for a child (`untraced`: for an idle process beside it), run it,
    print each program's runs and run time (JSON)."""
    from sits_trace.agent.capture.loader import LoadOptions, RingSource, load
    from sits_trace.agent.capture.probes import tracefs_root
    from sits_trace.agent.signals import node as nodesignals

    child = subprocess.Popen([sys.executable, __file__, "--child", str(count)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    idle = subprocess.Popen(["sleep", "3600"]) if untraced else None
    opts = nodesignals.extend_options(
        LoadOptions(target_pids=[(idle or child).pid], tls=False),
        nodesignals.load_additions(nodesignals.NodeSignalConfig(), tracefs_root()))
    kernel = load(opts)
    src = RingSource(kernel)
    stop = threading.Event()
    drained = [0]

    def drain() -> None:
        while not stop.is_set():
            drained[0] += len(src.read(20))

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    knob = Path("/proc/sys/kernel/bpf_stats_enabled")
    knob.write_text("1")
    try:
        before = {n.decode(): prog_run_stats(f.fd) for n, f in kernel.bpf.funcs.items()}
        child.stdin.write("go\n")
        child.stdin.flush()
        if child.stdout.readline().strip() != "done":
            raise SystemExit("bench: the traced child failed")
        after = {n.decode(): prog_run_stats(f.fd) for n, f in kernel.bpf.funcs.items()}
    finally:
        knob.write_text("0")
        child.wait(timeout=60)
        if idle is not None:
            idle.kill()
        time.sleep(0.2)
        stop.set()
        t.join()
    progs = {}
    for name, (t1, r1) in after.items():
        t0, r0 = before[name]
        if r1 > r0:
            progs[name.split("__")[-1]] = {"runs": r1 - r0, "ns": t1 - t0}
    print(json.dumps({"progs": progs, "records": drained[0]}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--baseline", help="python of another checkout's venv, run round by round")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--untraced", action="store_true",
                    help="the programs trace an idle process, not the child (see above)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return exchanges(args.child)
    if args.one:
        return one(args.count, args.untraced)
    runs = {"this": sys.executable, **({"base": args.baseline} if args.baseline else {})}
    got: dict[str, list[dict[str, dict[str, int]]]] = {k: [] for k in runs}
    for r in range(args.rounds):
        for label, py in runs.items():
            out = subprocess.run([py, __file__, "--one", "--count", str(args.count),
                                  *(["--untraced"] if args.untraced else [])],
                                 capture_output=True, text=True, check=True).stdout
            progs = json.loads(out.strip().splitlines()[-1])["progs"]
            got[label].append(progs)
            # a program that ran only a few times (the scheduler's: the child is one thread,
            # it hardly switches) says little: its run count is shown with it
            per = "  ".join(f"{n} {progs[n]['ns'] / progs[n]['runs']:.0f}"
                            + (f" ({progs[n]['runs']} runs)" if progs[n]["runs"] < 1000 else "")
                            for n in SHOWN if n in progs)
            total = sum(p["ns"] for p in progs.values()) / args.count
            print(f"round {r + 1} [{label}]: ns a run: {per}; all programs {total:.0f} ns "
                  "an exchange", flush=True)
    summary: dict[str, dict[str, float]] = {}
    for label, rounds in got.items():
        med = {n: statistics.median(p[n]["ns"] / p[n]["runs"] for p in rounds if n in p)
               for n in SHOWN if any(n in p for p in rounds)}
        med["exchange"] = statistics.median(sum(x["ns"] for x in p.values()) / args.count
                                            for p in rounds)
        summary[label] = {k: round(v, 1) for k, v in med.items()}
        print(f"[{label}] median of {len(rounds)} rounds, ns a run: "
              + ", ".join(f"{k} {v:.0f}" for k, v in summary[label].items() if k != "exchange")
              + f"; all programs {summary[label]['exchange']:.0f} ns an exchange")
    out = Path(__file__).parent / "results" / f"prog_cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": got, "median": summary}, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
