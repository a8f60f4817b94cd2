"""The whole-process run-queue wait the RCA reads for a local dependency (taskstats' TGID
query through pyroute2) against /proc/<pid>/schedstat, on a thread-per-request process whose
threads exit between samples, competing with CPU spinners in this test's session (autogroup)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from sits_trace.analyzers.rca.procs import ProcSampler, TaskWaits

pytestmark = pytest.mark.bpf  # root: taskstats answers CAP_NET_ADMIN only

CHILD = """
import threading, time
def work():
    t = time.perf_counter()
    while time.perf_counter() - t < 0.003:
        pass
while True:
    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads: th.start()
    for th in threads: th.join()
    time.sleep(0.002)
"""
SPIN = "while True: pass"


def _main_thread_wait(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def test_whole_process_wait_counts_threads_that_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(3)]
    try:
        time.sleep(0.5)
        waits = TaskWaits()
        sampler = ProcSampler(watch=lambda: {child.pid}, task_waits=waits)
        a = sampler.snapshot()
        main_a = _main_thread_wait(child.pid)
        time.sleep(2.0)
        b = sampler.snapshot()
        main_b = _main_thread_wait(child.pid)
        assert waits.failed is None, waits.failed
        whole = b.task_wait[child.pid] - a.task_wait[child.pid]
        main = main_b - main_a
        print(f"2 s beside 3 spinners: every thread waited {whole * 1e3:.0f} ms, "
              f"the main thread {main * 1e3:.0f} ms")
        assert whole > 0.1  # 4 threads of 3 ms each cycle, 5 runnable on 2 CPUs
        assert whole > 3 * main
        # the sampler's delta carries it per second
        from sits_trace.analyzers.rca.procs import delta

        d = delta(a, b)
        assert d.task_wait_per_s[child.pid] == pytest.approx(whole / d.seconds, rel=1e-6)
    finally:
        for p in [child, *spinners]:
            p.kill()
            p.wait()
    # a process that is gone: no value, and the reader stays on for the others
    assert waits.wait_s(child.pid) is None
    assert waits.failed is None
    assert waits.wait_s(1) is not None
    waits.close()
