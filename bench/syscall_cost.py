"""What the agent's syscall programs cost a process that is NOT traced: a load generator, a
database, a sidecar on the same node. An attached syscall tracepoint runs for every call of
every process, whether its program returns at once or not.

`dd if=/dev/zero of=/dev/null bs=1` (one read and one write a byte, an untraced process)
is timed with nothing loaded, with the agent's programs as shipped (reads and writes traced
at their exit alone, `SITS_EXIT_ARGS=1`) and with enter and exit tracepoints (the fallback,
`SITS_EXIT_ARGS=0`, what every read and write cost before), interleaved round by round. The
programs trace another process (this script's own child, idle), as the agent traces a
server while wrk runs beside it.

Two more variants split the shipped cost into what is the kernel's and what is the
programs' own:
- `one-tracepoint`: a program that returns at once on `sys_enter_close` alone, which dd
  calls a handful of times. While any syscall tracepoint is attached, every thread on the
  node takes the kernel's slow syscall path (syscall work flags) at every call: the floor
  of tracing through syscall tracepoints at all.
- `empty-programs`: a program that returns at once, on every syscall tracepoint
  `bpf/http.c` attaches (read from the loaded agent): what running any program there
  costs. The difference to `exit-only` is what the agent's programs do for a process they
  do not trace.

Usage: bench/syscall_cost.py [--rounds 5] [--count 1000000]
Prints ns per read+write pair above nothing loaded, per variant, and the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {"exit-only": 1, "enter+exit": 0, "one-tracepoint": -1, "empty-programs": -2,
            "raw-sys-exit": -3}

def child(exit_args: int, target: int) -> int:
    from bcc import BPF
    from sits_trace.agent.capture.loader import LoadOptions, load

    held: list[object] = []  # the loaded programs stay attached while this child lives
    if exit_args == -3:
        held.append(BPF(text="RAW_TRACEPOINT_PROBE(sys_exit) { return 0; }"))
    elif exit_args == -1:
        held.append(BPF(text="TRACEPOINT_PROBE(syscalls, sys_enter_close) { return 0; }"))
    else:
        shipped = 1 if exit_args < 0 else exit_args  # the empty programs: where exit-only's are
        kernel = load(LoadOptions(target_pids=[target], tls=False,
                                  extra_defines={"SITS_EXIT_ARGS": shipped}))
        assert kernel.defines["SITS_EXIT_ARGS"] == shipped
        if exit_args == -2:  # the same syscall tracepoints, each with an empty program
            from kernel_only import empty_programs  # the sibling bench's --floor

            held.append(empty_programs(kernel.bpf, "syscalls:")[0])
        else:
            held.append(kernel)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    return 0


def dd_ns(count: int) -> float:
    """Wall ns per read+write pair of one dd run (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", "of=/dev/null", "bs=1", f"count={count}",
                        "status=none"], check=True)
        best = min(best, time.perf_counter() - t0)
    return best / count * 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--target", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, args.target)
    idle = subprocess.Popen(["sleep", "3600"])
    added: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for r in range(args.rounds):
            base = dd_ns(args.count)
            row = [f"round {r + 1}: nothing loaded {base:.0f} ns"]
            for name, value in VARIANTS.items():
                p = subprocess.Popen([sys.executable, __file__, "--child", str(value),
                                      "--target", str(idle.pid)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                assert p.stdout is not None and p.stdin is not None
                if p.stdout.readline().strip() != "ready":
                    raise SystemExit(f"bench: the programs ({name}) did not load")
                ns = dd_ns(args.count)
                p.stdin.close()
                p.wait(timeout=60)
                added[name].append(ns - base)
                row.append(f"{name} {ns:.0f} ns (+{ns - base:.0f})")
            print("; ".join(row), flush=True)
    finally:
        idle.kill()
    summary = {name: round(statistics.median(v), 1) for name, v in added.items()}
    print("ns added per read+write pair of an untraced process, median of "
          f"{args.rounds} rounds: " + ", ".join(f"{k} +{v}" for k, v in summary.items()))
    out = Path(__file__).parent / "results" / f"syscall_cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "added_ns": added, "median": summary}, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
