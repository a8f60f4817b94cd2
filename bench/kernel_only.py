"""The kernel half of tracing alone: load and attach the agent's programs for a pid and
drain the ring without decoding anything. bench/overhead.py --mode kernel runs this to
split the agent's cost into what the probes cost the traced process and what the
Python side costs on top.

Usage: bench/kernel_only.py --pid PID [--signals] [--floor | --skip]   (until SIGINT; prints
records and bytes drained; --signals: the node signals' programs too, as the agent loads them)

--skip: the ring's records are stepped over (each header read, no record copied), every
50 ms: the programs' whole work, and as little of the reader's as frees the ring.

--floor: the agent's programs are loaded to learn which tracepoints they attach, then
replaced by programs that return at once on the same tracepoints, and nothing is read. What
tracing costs a server through these tracepoints whatever the programs do: bench/overhead.py
--mode floor, beside --mode kernel, splits the kernel half's cost into the kernel's dispatch
and the programs' own work.
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from sits_trace.agent.capture import ringbuf
from sits_trace.agent.capture.bpfmaps import _BPF_OBJ_GET_INFO_BY_FD, _SYS_BPF, _InfoAttr, _ProgInfo
from sits_trace.agent.capture.loader import LoadOptions, RingSource, load, ring_shedder
from sits_trace.agent.capture.probes import tracefs_root
from sits_trace.agent.capture.ringbuf import MmapRing
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
    ap.add_argument("--skip", action="store_true",
                    help="step over the ring's records instead of copying them (see above)")
    ap.add_argument("--floor", action="store_true",
                    help="programs that return at once on the agent's tracepoints (see above)")
    args = ap.parse_args()
    pids = [args.pid, *ProcFS().children(args.pid)]  # nginx: the master and its workers
    opts = LoadOptions(target_pids=pids)
    if args.signals:
        opts = nodesignals.extend_options(
            opts, nodesignals.load_additions(nodesignals.NodeSignalConfig(), tracefs_root()))
    kernel = load(opts)
    if args.floor:
        return floor(kernel)
    src = RingSource(kernel)
    shedder = ring_shedder(kernel, src, default_cpu_budget())  # as the agent's loop does
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("sits-trace: tracing; kernel only", file=sys.stderr, flush=True)  # overhead.TRACE_READY
    n = size = 0
    ring = src._mmap
    while not stop.is_set():
        shedder.tick()
        if args.skip and ring is not None:
            stop.wait(0.05)
            k, b = step_over(ring)
            n += k
            size += b
            continue
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


def step_over(ring: MmapRing) -> tuple[int, int]:
    """Frees the ring up to its first record still being written, reading only the records'
    headers (the layout agent/capture/ringbuf.py reads): (records, bytes) stepped over."""
    m = ring._prod_map
    prod = ringbuf._POS.unpack_from(m, 0)[0]
    cons = ring._cons
    n = size = 0
    while cons < prod:
        (hdr,) = ringbuf._HDR.unpack_from(m, ring._data_off + (cons & ring._mask))
        if hdr & ringbuf.BUSY:
            break
        k = hdr & ~(ringbuf.BUSY | ringbuf.DISCARD)
        cons += (k + 8 + 7) & ~7
        n += 1
        size += k
    ring._cons = cons
    ringbuf._POS.pack_into(ring._cons_map, 0, cons)
    return n, size


def empty_programs(bpf: Any, prefix: str = "") -> tuple[Any, list[str]]:
    """The agent's programs (`bpf`, loaded) detached, and one program that returns at once
    attached to each tracepoint they were on (those starting with `prefix`): the new BPF
    object, which keeps them attached while it lives, and the tracepoints."""
    from bcc import BPF

    tps = sorted(tp.decode() for tp in bpf.tracepoint_fds if tp.decode().startswith(prefix))
    bpf.cleanup()
    if not tps:
        raise SystemExit(f"bench: the agent attached no tracepoint {prefix}*")
    empty = BPF(text="int empty(void *ctx) { return 0; }")
    for tp in tps:
        empty.attach_tracepoint(tp=tp, fn_name="empty")
    return empty, tps


def floor(kernel: Any) -> int:
    """The agent's tracepoints, each with a program that returns at once, until SIGINT."""
    uprobes = len(kernel.bpf.uprobe_fds)
    _empty, tps = empty_programs(kernel.bpf)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("sits-trace: tracing; kernel only", file=sys.stderr, flush=True)  # overhead.TRACE_READY
    stop.wait()  # the programs go with the process
    print(f"floor: empty programs on {len(tps)} tracepoints ({uprobes} uprobes left out)",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
