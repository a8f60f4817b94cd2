"""The kernel half of tracing alone: load and attach the agent's programs for a pid and
drain the ring without decoding anything. bench/overhead.py --mode kernel runs this to
split the agent's cost into what the probes cost the traced process and what the
Python side costs on top.

Usage: bench/kernel_only.py --pid PID [--signals]   (until SIGINT; prints records and bytes
drained; --signals: the node signals' programs too, as the agent loads them)
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys
import threading
from pathlib import Path

from sits_trace.agent.capture.bpfmaps import _BPF_OBJ_GET_INFO_BY_FD, _SYS_BPF, _InfoAttr, _ProgInfo
from sits_trace.agent.capture.loader import LoadOptions, RingSource, load, ring_shedder
from sits_trace.agent.capture.probes import tracefs_root
from sits_trace.agent.config import default_cpu_budget
from sits_trace.agent.signals import node as nodesignals
from sits_trace.agent.tracing.procfs import ProcFS


def prog_run_stats(fd: int) -> tuple[int, int]:
    """run_time_ns and run_cnt of a program (counted while kernel.bpf_stats_enabled=1)."""
    info = _ProgInfo()
    attr = _InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info))
    if ctypes.CDLL(None).syscall(_SYS_BPF, _BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr),
                                 ctypes.sizeof(attr)):
        return 0, 0
    return int(info.run_time_ns), int(info.run_cnt)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--signals", action="store_true",
                    help="the node signals' programs too (bpf/tcp.c, bpf/sched.c), as the "
                         "agent loads them by default")
    args = ap.parse_args()
    pids = [args.pid, *ProcFS().children(args.pid)]  # nginx: the master and its workers
    opts = LoadOptions(target_pids=pids)
    if args.signals:
        opts = nodesignals.extend_options(
            opts, nodesignals.load_additions(nodesignals.NodeSignalConfig(), tracefs_root()))
    kernel = load(opts)
    src = RingSource(kernel)
    shedder = ring_shedder(kernel, src, default_cpu_budget())  # as the agent's loop does
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("sits-trace: tracing; kernel only", file=sys.stderr, flush=True)  # overhead.TRACE_READY
    n = size = 0
    while not stop.is_set():
        shedder.tick()
        recs = src.read(50)
        n += len(recs)
        size += sum(map(len, recs))
    lost = sum(kernel.counters("lost").values())
    if Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip() == "1":
        total = 0
        for name, fn in sorted(kernel.bpf.funcs.items()):
            t, runs = prog_run_stats(fn.fd)
            total += t
            if runs:
                print(f"  {name.decode():40s} runs={runs:9d} avg={t / runs:7.0f} ns total={t / 1e6:8.1f} ms",
                      file=sys.stderr)
        print(f"  all programs: {total / 1e6:.1f} ms", file=sys.stderr)
    print(f"records={n} bytes={size} lost_in_kernel={lost} reader={src.reader}",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
