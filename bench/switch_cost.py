"""What the agent's programs cost processes that are NOT traced as they switch and wake:
bpf/sched.c's sched_switch and sched_wakeup run on every context switch of the node, and the
syscall exit tracepoints on every read and write.

`perf bench sched pipe` (two processes passing a token through two pipes, both on CPU 0:
each round trip is two writes, two reads, two wakeups and two context switches) is timed with nothing loaded
and with the agent's programs loaded as `run` loads them (node signals included), tracing
another process (an idle child of this script), interleaved round by round. With
--baseline, that checkout's programs are timed too, in the same rounds.

Usage: bench/switch_cost.py [--rounds 5] [--loops 200000] [--http-alone]
                            [--baseline /path/to/.venv/bin/python]
Prints ns added per round trip above nothing loaded, per variant, and the median.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(target: int, signals: bool) -> int:
    """Load the programs for `target` as the agent does (without the node signals' when
    not `signals`), until stdin closes."""
    from sits_trace.agent.capture.loader import LoadOptions, load
    from sits_trace.agent.capture.probes import tracefs_root
    from sits_trace.agent.signals import node as nodesignals

    opts = LoadOptions(target_pids=[target])
    if signals:
        opts = nodesignals.extend_options(
            opts, nodesignals.load_additions(nodesignals.NodeSignalConfig(), tracefs_root()))
    load(opts)
    print("ready", flush=True)
    sys.stdin.read()
    return 0


def pipe_ns(loops: int) -> float:
    """ns per round trip of one `perf bench sched pipe` run (best of 3)."""
    best = float("inf")
    for _ in range(3):
        # both on one CPU: the switches themselves, not the VM's cross-CPU wakeups (which
        # moved the untraced figure by 10% from one run to the next)
        out = subprocess.run(["taskset", "-c", "0", "perf", "bench", "sched", "pipe", "-l",
                              str(loops)],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r"([\d.]+) usecs/op", out)
        if not m:
            raise SystemExit(f"bench: no usecs/op in perf's output: {out[-300:]}")
        best = min(best, float(m.group(1)) * 1000)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loops", type=int, default=200000)
    ap.add_argument("--baseline", help="python of another checkout's venv: its programs too")
    ap.add_argument("--http-alone", action="store_true",
                    help="also this checkout's bpf/http.c alone (no node signals): what the "
                         "syscall tracepoints cost apart from sched.c and tcp.c")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--no-signals", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, not args.no_signals)
    variants = {"this": [sys.executable],
                **({"http.c alone": [sys.executable, "--no-signals"]} if args.http_alone else {}),
                **({"base": [args.baseline]} if args.baseline else {})}
    idle = subprocess.Popen(["sleep", "3600"])
    added: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for r in range(args.rounds):
            base = pipe_ns(args.loops)
            row = [f"round {r + 1}: nothing loaded {base:.0f} ns"]
            order = list(variants.items())
            for name, (py, *extra) in (order if r % 2 == 0 else order[::-1]):
                p = subprocess.Popen([py, __file__, "--child", str(idle.pid), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
                assert p.stdout is not None and p.stdin is not None
                if p.stdout.readline().strip() != "ready":
                    raise SystemExit(f"bench: the programs ({name}) did not load")
                ns = pipe_ns(args.loops)
                p.stdin.close()
                p.wait(timeout=60)
                added[name].append(ns - base)
                row.append(f"{name} {ns:.0f} ns (+{ns - base:.0f})")
            print("; ".join(row), flush=True)
    finally:
        idle.kill()
    summary = {name: round(statistics.median(v), 1) for name, v in added.items()}
    print("ns added per pipe round trip of two untraced processes, median of "
          f"{args.rounds} rounds: " + ", ".join(f"{k} +{v}" for k, v in summary.items()))
    out = Path(__file__).parent / "results" / f"switch_cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "added_ns": added, "median": summary}, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
