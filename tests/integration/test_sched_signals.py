"""bpf/sched.c against /proc/<tid>/schedstat, under `stress-ng --cpu 4` on this 2-core VM.

/proc/<tid>/schedstat's second field (sched_info.run_delay) and third (pcount, times run on a
CPU) count the same waits as sched.c does (runnable -> on a CPU), from the scheduler's clock.
Threads are compared while blocked, when neither counter can move.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sits_trace.agent.capture import loader, probes
from sits_trace.agent.capture.bpfmaps import BccMaps
from sits_trace.agent.capture.events import DataEvent, decode
from sits_trace.agent.model import (
    Chunk,
    ConnInfo,
    Direction,
    Exchange,
    Role,
    Span,
)
from sits_trace.agent.signals import node as nodesignals
from sits_trace.agent.signals.sched import SchedSignals
from sits_trace.agent.tracing.http1 import HttpConnParser

# SPIN threads hash (GIL released) for SECONDS once told to, then block, and one more does the
# same with a 1-us nap after each hash (a sleep that often ends before the thread has left its
# CPU: its wakeup must not start a wait); a server thread answers
# each request after hashing for 0.3 s, printing its schedstat just after the read and just
# before the write
WORKLOAD = r'''
import ctypes, hashlib, socket, sys, threading, time
SPIN, SECONDS = int(sys.argv[1]), float(sys.argv[2])
go, done = threading.Event(), threading.Event()
buf = b"x" * (1 << 20)
def schedstat():
    return open("/proc/thread-self/schedstat").read().split()
def spin(nap):
    if nap:  # timer slack 1 ns: a nap's timer can fire before the thread has left its CPU
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
    go.wait()
    end = time.monotonic() + SECONDS
    while time.monotonic() < end:
        hashlib.sha256(buf).digest()
        if nap:
            time.sleep(1e-6)
    done.wait()
tids = []
for i in range(SPIN + 1):  # the last one naps 1 us after each hash
    t = threading.Thread(target=spin, args=(i == SPIN,), daemon=True); t.start()
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
def serve():
    while True:
        c, _ = srv.accept()
        req = c.recv(4096)
        a = schedstat()
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            hashlib.sha256(buf).digest()
        b = schedstat()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        print("served", threading.get_native_id(), int(b[1]) - int(a[1]), flush=True)
        c.close()
threading.Thread(target=serve, daemon=True).start()
time.sleep(0.2)
print("port", srv.getsockname()[1], flush=True)
for line in sys.stdin:
    if line.strip() == "go":
        go.set()
        time.sleep(SECONDS + 0.3)
        print("spun", flush=True)
'''

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(shutil.which("stress-ng") is None, reason="needs stress-ng")]


def tid_bit(kernel: loader.Kernel, tid: int) -> bool:
    raw = BccMaps(kernel.bpf).lookup("runq_tid_bits", (tid >> 6).to_bytes(4, "little"))
    return raw is not None and bool(int.from_bytes(raw, "little") >> (tid & 63) & 1)


def schedstat(pid: int, tid: int) -> tuple[int, int]:
    f = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    return int(f[1]), int(f[2])


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    script = tmp_path_factory.mktemp("sched") / "workload.py"
    script.write_text(WORKLOAD)
    p = subprocess.Popen([sys.executable, str(script), "2", "1.5"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        p.port = int(p.stdout.readline().split()[1])  # type: ignore[attr-defined]
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def kernel(workload: subprocess.Popen[str]) -> Iterator[loader.Kernel]:
    add = nodesignals.load_additions(nodesignals.NodeSignalConfig(tcp=False),
                                     probes.tracefs_root())
    opts = nodesignals.extend_options(
        loader.LoadOptions(tls=False, target_pids=[workload.pid], ringbuf_pages=256), add)
    k = loader.load(opts)
    try:
        yield k
    finally:
        k.bpf.cleanup()


@pytest.fixture()
def stress() -> Iterator[None]:
    p = subprocess.Popen(["stress-ng", "--cpu", "4", "--timeout", "20s", "--quiet"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    try:
        yield
    finally:
        p.terminate()  # stress-ng stops its workers on SIGTERM
        p.wait(timeout=10)


def readline(p: subprocess.Popen[str], want: str) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith(want), line
    return line


def test_runq_delay_equals_schedstat(workload: subprocess.Popen[str], kernel: loader.Kernel,
                                     stress: None) -> None:
    sig = SchedSignals(BccMaps(kernel.bpf))
    pid = workload.pid
    sig.track_process(pid)  # its threads are all blocked now: tracked from a clean start
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    # sched.c's programs look at threads whose bit is set (bpf/events.h runq_tid_bits)
    assert all(tid_bit(kernel, t) for t in tids)
    before = {t: schedstat(pid, t) for t in tids}
    ours0 = {t: sig.thread(t) for t in tids}
    assert all(c is not None and c.tgid == pid for c in ours0.values())
    assert workload.stdin is not None
    workload.stdin.write("go\n")
    workload.stdin.flush()
    readline(workload, "spun")  # spinners blocked again, main thread in readline
    time.sleep(0.05)
    after = {t: schedstat(pid, t) for t in tids}
    ours1 = {t: sig.thread(t) for t in tids}
    print("misses", {k: v for k, v in nodesignals.program_misses(kernel).items() if "sched" in k})
    total_ref = total_ours = count_ref = count_ours = 0
    for t in tids:
        c0, c1 = ours0[t], ours1[t]
        assert c0 is not None and c1 is not None
        d_ref, n_ref = after[t][0] - before[t][0], after[t][1] - before[t][1]
        d_ours, n_ours = c1.delay_ns - c0.delay_ns, c1.count - c0.count
        untimed = c1.untimed - c0.untimed
        print(f"tid {t}: schedstat run_delay {d_ref / 1e6:.3f} ms over {n_ref} runs, "
              f"sched.c {d_ours / 1e6:.3f} ms over {n_ours} waits (+{untimed} untimed)")
        total_ref += d_ref
        total_ours += d_ours
        count_ref += n_ref
        count_ours += n_ours
        # the same waits; each measured from a different clock read (the scheduler's rq
        # clock, ours bpf_ktime_get_ns at the tracepoint): a few microseconds apart per wait
        # a few waits go unseen: sched.c counted 128 of 129, 142 of 144, 130 of 133 on this
        # VM, with no program misses and no untimed arrivals reported; the cause is not
        # pinned down (issue 4's note). Bound it at 5% of the runs (seen: up to 2.3%), and
        # never more waits than schedstat.
        missing = n_ref - (n_ours + untimed)
        assert 0 <= missing <= max(1, n_ref // 20), (n_ours, untimed, n_ref)
        # rq clock vs bpf_ktime_get_ns, read at different points: up to ~20 us a wait on this VM
        assert abs(d_ours - d_ref) <= 0.01 * d_ref + 20_000 * n_ref + 50_000_000 * (untimed + missing)
    assert total_ref > 100_000_000, "stress-ng should have kept the spinners waiting"
    # stress-ng's workers waited as much, untraced: not one of their threads is tracked
    others = [t for p in subprocess.run(["pgrep", "-x", "stress-ng"], capture_output=True,
                                        text=True).stdout.split()
              for t in map(int, os.listdir(f"/proc/{p}/task"))]
    assert others
    assert not any(tid_bit(kernel, t) or sig.thread(t) is not None for t in others)
    s = sig.sample()
    proc = s.procs[pid]
    print(f"process: {proc.delay_s_per_s:.3f} s/s waiting, {proc.waits_per_s:.0f} waits/s, "
          f"mean {proc.mean_wait_us:.0f} us, hist {proc.hist_log2_us}")
    # the histogram and the per-thread counters are separate maps, read one after the other
    # while the process runs; seen here once: 263 in the histogram against 265 counted
    hist_total = sum(proc.hist_log2_us)
    assert abs(hist_total - round(proc.waits_per_s * s.interval_s)) <= 3
    assert hist_total >= count_ours - 3


def test_span_runq_delay_from_data_events(workload: subprocess.Popen[str],
                                          kernel: loader.Kernel, stress: None) -> None:
    sig = SchedSignals(BccMaps(kernel.bpf))
    ring = loader.RingSource(kernel)
    with socket.create_connection(("127.0.0.1", workload.port)) as c:  # type: ignore[attr-defined]
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        c.recv(4096)
    served = readline(workload, "served").split()
    tid, ref_ns = int(served[1]), int(served[2])
    evs = [ev for r in ring.read(100) for ev in [decode(r)] if isinstance(ev, DataEvent)]
    for _ in range(20):
        evs += [ev for r in ring.read(50) for ev in [decode(r)] if isinstance(ev, DataEvent)]
    assert evs, "no EV_DATA from the traced server"
    req = next(e for e in evs if e.direction == Direction.INGRESS)
    resp = [e for e in evs if e.direction == Direction.EGRESS][-1]
    assert req.tid == resp.tid == tid
    # through the HTTP parser, as the tracer feeds it: it keeps the counters at the
    # exchange's first read and last write
    info = ConnInfo(conn_id=req.conn_id, pid=workload.pid, fd=req.fd, role=Role.SERVER)
    out: list[Exchange] = []
    parser = HttpConnParser(info, out.append)
    for ev in evs:
        if ev.conn_id == req.conn_id:
            parser.feed(Chunk(ev.direction, ev.ts_enter_ns, ev.ts_exit_ns, ev.payload,
                              ev.length, ev.tail, ev.tid, ev.runq_us))
    assert len(out) == 1
    ex = out[0]
    assert ex.request.start_ns == req.ts_exit_ns
    assert ex.response is not None and ex.response.end_ns == resp.ts_exit_ns
    span = Span("0" * 32, "0" * 16, None, "GET /", "SERVER", 0, 0)
    sig.annotate(ex, span)
    ours_us = span.attributes["sits.cpu.runq_delay_us"]
    print(f"span: sits.cpu.runq_delay_us={ours_us}, the thread's own schedstat between its "
          f"read and its write: {ref_ns / 1e3:.0f} us")
    assert span.attributes["sits.cpu.runq_delay_exact"] is True
    assert span.attributes["sits.cpu.runq_threads"] == 1
    assert isinstance(ours_us, int) and ours_us > 10_000  # it hashed 0.3 s under stress-ng
    # the thread read schedstat a few microseconds after recv and before send: only a wait
    # that ended inside those gaps separates the two (rare); allow one scheduler slice
    assert abs(ours_us * 1000 - ref_ns) <= 0.05 * ref_ns + 3_000_000

