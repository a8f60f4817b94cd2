"""SCHED_DEADLINE reservations (analyzers/control/deadline.py) against a real competitor: a
served process whose handler thread wakes every 20 ms and works ~2 ms, starved by a
`stress-ng --cpu 3` in its own session (autogroup: only then does it compete); the reservation
of its busy thread brings the handler's latency back, and revert gives back what it had."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from sits_trace.analyzers.control.deadline import SCHED_DEADLINE, DeadlineReserver

from .harness import have

pytestmark = pytest.mark.bpf  # root: sched_setattr(SCHED_DEADLINE) needs CAP_SYS_NICE

VICTIM = r"""
import os, subprocess, sys, threading, time
def handler():
    nxt = time.perf_counter()
    while True:
        nxt += 0.02
        time.sleep(max(0.0, nxt - time.perf_counter()))
        t0 = time.perf_counter()
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.002:  # 2 ms of CPU: the request's work
            pass
        # the request's latency: how late it started plus how long its work took
        print(f"{time.time():.4f} {(t0 - nxt + time.perf_counter() - t0) * 1e3:.3f}", flush=True)
        if os.path.exists(sys.argv[1]):  # asked to fork while reserved (RESET_ON_FORK)
            os.unlink(sys.argv[1])
            print("fork", subprocess.run(["true"]).returncode, flush=True)
threading.Thread(target=handler, daemon=True).start()
time.sleep(3600)
"""


class _Victim:
    def __init__(self, flag: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", VICTIM, flag],
                                     stdout=subprocess.PIPE, text=True)
        self.rows: list[tuple[float, float]] = []
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            parts = line.split()
            if len(parts) == 2 and parts[0] != "fork":
                self.rows.append((float(parts[0]), float(parts[1])))

    def p95(self, t0: float, t1: float) -> float:
        v = [ms for t, ms in self.rows if t0 <= t < t1]
        assert len(v) > 20, (t0, t1, len(v))
        return float(np.percentile(v, 95))


def _quiet_baseline(v: _Victim, tries: int = 5, seconds: float = 3.0,
                    quiet_ms: float = 3.0) -> tuple[float, float, list[float]]:
    """The handler's p95 with no competitor, measured when the machine is quiet enough to
    judge against: 2 ms of work starting more than 1 ms late at p95 means something else
    competes (a CI run once read 4.95 ms here, then 8.2 starved, and failed the competitor
    check while the reservation itself worked). Measure again, up to `tries` windows; the
    last window is the baseline whatever it reads, and every try is in the messages."""
    bases: list[float] = []
    for _ in range(tries):
        t0 = time.time()
        time.sleep(seconds)
        t1 = time.time()
        bases.append(round(v.p95(t0, t1), 2))
        if bases[-1] <= quiet_ms:
            break
    return t0, t1, bases


def _policies(pid: int) -> dict[int, int]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(t)] = os.sched_getscheduler(int(t)) & ~os.SCHED_RESET_ON_FORK
        except OSError:
            continue
    return out


@pytest.mark.skipif(not have("stress-ng"), reason="needs stress-ng")
def test_reservation_gives_a_starved_handler_its_latency_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    flag = tmp_path / "fork-now"
    v = _Victim(str(flag))
    res = DeadlineReserver(state_path=tmp_path / "state.json")
    stress = None
    try:
        time.sleep(1.0)
        _, t_fault, bases = _quiet_baseline(v)
        stress = subprocess.Popen(["stress-ng", "--cpu", "3", "--timeout", "60"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(4.0)
        t_plan = time.time()
        r = res.plan("cpu_starvation", v.proc.pid, "victim")
        assert len(r.runtime_ns) == 1, r.to_json()  # the handler; the idle main thread is not
        res.apply(r)
        t_res = time.time()
        assert _policies(v.proc.pid)[next(iter(r.runtime_ns))] == SCHED_DEADLINE
        flag.write_text("")  # a reserved thread forks: allowed (children start normal)
        time.sleep(4.0)
        t_end = time.time()
        res.revert(v.proc.pid)
        assert set(_policies(v.proc.pid).values()) == {os.SCHED_OTHER}
        assert not (tmp_path / "state.json").exists() or \
            (tmp_path / "state.json").read_text() == "[]"
    finally:
        if stress is not None:
            stress.kill()
        res.revert_all()
        v.proc.kill()
    base, starved = bases[-1], v.p95(t_fault + 1, t_plan)
    reserved = v.p95(t_res + 0.5, t_end)
    got = r.to_json()  # what the kernel's admission control let it have (it may halve)
    print(f"p95 ms: baseline {base:.2f} (tries {bases}), starved {starved:.2f}, reserved {reserved:.2f}; {got}")
    assert starved > 2 * base, (bases, starved)  # the competitor bit
    assert reserved < starved / 2, (base, starved, reserved, got)
    assert reserved < 1.5 * base + 1.0, (base, starved, reserved, got)
    assert any(line.startswith("fork 0") for line in v.lines), v.lines[-5:]


def _dl_total_bw() -> float | None:
    """The root domain's admitted deadline bandwidth in CPUs (debugfs; mounted if need be)."""
    path = Path("/sys/kernel/debug/sched/debug")
    if not path.exists():
        subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"], check=False,
                       capture_output=True)
    try:
        for line in path.read_text().splitlines():
            if "dl_bw->total_bw" in line:
                return int(line.split(":")[1]) / 2**20
    except (OSError, ValueError):
        return None
    return None


def test_undoing_a_reservation_gives_its_bandwidth_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Reserve and undo ten times on a thread that is mostly asleep: the kernel's admitted
    deadline bandwidth is where it was. Leaving SCHED_DEADLINE directly leaked each
    reservation's bandwidth on this VM's kernel (0.1 CPU per undo, measured: after a few
    dozen, admission refused everything; the xfail this test file carried until then)."""
    before = _dl_total_bw()
    assert before is not None, "no /sys/kernel/debug/sched/debug (debugfs)"
    v = _Victim(str(tmp_path / "never"))
    res = DeadlineReserver(state_path=tmp_path / "state.json", sample_s=0.3)
    try:
        time.sleep(1.0)
        r = res.plan("cpu_starvation", v.proc.pid, "victim")
        for _ in range(10):
            res.apply(res.plan("cpu_starvation", v.proc.pid, "victim") if _ else r)
            res.revert(v.proc.pid)
            time.sleep(0.05)
        time.sleep(0.5)  # past every 0-lag time
        after = _dl_total_bw()
    finally:
        res.revert_all()
        v.proc.kill()
    assert after is not None
    print(f"admitted deadline bandwidth: {before:.4f} CPU before, {after:.4f} after 10 undos")
    assert abs(after - before) < 0.001, (before, after, r.to_json())
