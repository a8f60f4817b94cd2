"""Live RCA under a real fault: the bench workload (streamed completions, Azure-trace request
sizes) traced by `sits-trace rca --json`, and a `stress-ng --cpu` competitor started in the
server's session (autogroup scheduling: only then does it compete). The first verdict on a
window the fault covers from its start must name cpu_starvation and a stress-ng process as
the culprit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .harness import SITS, free_port, have, wait_port

pytestmark = pytest.mark.bpf
BENCH = Path(__file__).resolve().parents[2] / "bench" / "rca_runs.py"
# request sizes from the repository's excerpt of the Azure trace: a clean clone has no
# ../shared/data (the load generator exited at once there, and no verdict came: CI's
# "no verdicts in the full suite" of stop 15)
TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "azure" / "conv_first_120.csv"


def _tree(pid: int) -> set[int]:
    out = {pid}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = Path(f"/proc/{pid}/task/{t}/children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out |= _tree(int(k))
    return out


class _Rca:
    def __init__(self, *args: str) -> None:
        self.verdicts: list[dict[str, Any]] = []
        self.stdout_lines: list[str] = []
        self.err: list[str] = []
        self.proc = subprocess.Popen([SITS, "rca", "--json", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._errs, daemon=True).start()
        end = time.monotonic() + 90
        while not any("judging" in e for e in self.err):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("rca did not start: " + "".join(self.err))
            time.sleep(0.1)

    def _out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            self.verdicts.append(json.loads(line))  # stdout: JSON verdicts and nothing else

    def _errs(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=30)


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(BENCH), *args])


@pytest.mark.skipif(not have("stress-ng"), reason="needs stress-ng")
def test_cpu_competitor_in_the_servers_session_is_named(tmp_path: Path) -> None:
    port, dep_port = free_port(), free_port()
    procs = [_spawn("dep", "--port", str(dep_port)),
             _spawn("serve", "--port", str(port), "--dep-port", str(dep_port))]
    control = tmp_path / "control.json"
    control.write_text('{"rate_mult": 1.0, "mix": "normal"}')
    stress: subprocess.Popen[bytes] | None = None
    rca = None
    try:
        wait_port(dep_port)
        wait_port(port)
        rca = _Rca("-p", str(procs[1].pid), "--window", "2", "--duration", "80")
        procs.append(_spawn("load", "--port", str(port), "--rate", "8", "--seed", "5",
                            "--control", str(control), "--trace", str(TRACE)))
        time.sleep(24)  # the baseline: a dozen normal windows
        t_fault = time.time_ns()
        stress = subprocess.Popen(["stress-ng", "--cpu", "3", "--timeout", "60"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        culprits = _tree(stress.pid)
        time.sleep(11)
        stress.send_signal(signal.SIGINT)
        stress.wait(10)
        t_end = time.time_ns()
        time.sleep(3)
    finally:
        if stress is not None and stress.poll() is None:
            stress.kill()
        if rca is not None:
            rca.stop()
        for p in procs:
            p.terminate()
            p.wait(5)
    assert rca is not None
    during = [v for v in rca.verdicts
              if v["window"]["end_unix_nano"] > t_fault and v["window"]["start_unix_nano"] < t_end]
    assert during, f"no verdict during the fault; all: {rca.verdicts}"
    # judged: the first window the competitor ran through. A window that straddles the
    # fault's start judges a mix of before and after: printed, not judged (project CI once
    # had ~1 s of the competitor in a 2-s window, a TTFT p95 of 106 ms against 10.9, and
    # named the request mix, whose output sizes had risen 14% in it, over a run-queue wait
    # the quiet half diluted: 0.33 -> 1.30 ms)
    for v in during:
        if v["window"]["start_unix_nano"] < t_fault:
            print("straddling the fault's start:", json.dumps(v["causes"][:2]))
    whole = [v for v in during if v["window"]["start_unix_nano"] >= t_fault]
    assert whole, f"no verdict on a window inside the fault; during: {during}"
    first = whole[0]
    top = first["causes"][0]
    print("first verdict in the fault:", json.dumps(first["causes"][:2]))
    assert top["cause"] == "cpu_starvation", json.dumps(first)
    assert top["culprit"] is not None and top["culprit"]["pid"] in culprits, json.dumps(first)
    assert top["explained_ms"] > 0
    # verdicts come within 2 s of the end of the window they judge
    lag = (first["time_unix_nano"] - first["window"]["end_unix_nano"]) / 1e9
    assert 0 <= lag <= 2.0
    before = [v for v in rca.verdicts if v["window"]["end_unix_nano"] <= t_fault]
    assert len(before) <= 2, f"false alarms before the fault: {before}"


@pytest.mark.parametrize(("cause", "link"), [("network_delay", {"delay_ms": 40.0}),
                                             ("network_loss", {"loss": 0.08})])
def test_network_fault_between_client_and_server_is_named(tmp_path: Path, cause: str,
                                                          link: dict[str, float]) -> None:
    """The load generator in a client netns, the server in the root netns, joined by
    bench/faults' TUN relay; both traced. The client's verdict names the link's fault and the
    server across it."""
    sys.path.insert(0, str(BENCH.parents[1]))
    from bench.faults.netns import Topology

    control = tmp_path / "control.json"
    control.write_text('{"rate_mult": 1.0, "mix": "normal"}')
    with Topology(server_in_root=True, seed=3) as topo:
        host, port, dep_port = topo.ip_of("server"), free_port(), free_port()
        procs = [_spawn("dep", "--port", str(dep_port)),
                 _spawn("serve", "--port", str(port), "--dep-port", str(dep_port),
                        "--host", host)]
        rca = None
        try:
            wait_port(dep_port)
            time.sleep(1.0)
            load = topo.popen("client", [sys.executable, str(BENCH), "load", "--port", str(port),
                                         "--rate", "6", "--seed", "3", "--control", str(control),
                                         "--host", host, "--trace", str(TRACE)])
            # 5-s windows, as bench/rca_eval.py judges network runs: at 6 requests a second a
            # 2-s window's p95 is its slowest request or two, and CI saw a loss verdict
            # led by request_mix_shift on 8 spans
            rca = _Rca("-p", str(procs[1].pid), "-p", str(load.pid), "--window", "5",
                       "--duration", "80")
            time.sleep(30)
            t_fault = topo.set_link(**link)
            time.sleep(15)
            t_end = topo.set_link()
            time.sleep(3)
        finally:
            if rca is not None:
                rca.stop()
            for p in procs:
                p.terminate()
                p.wait(5)
    assert rca is not None
    # the first client verdict on a window mostly inside the fault (one that ends just after
    # the link changed holds requests from before it, as bench/rca_eval.py counts)
    during = [v for v in rca.verdicts if v["kind"] == "CLIENT"
              and t_fault <= (v["window"]["start_unix_nano"] + v["window"]["end_unix_nano"]) // 2
              < t_end]
    assert during, f"no client verdict during the fault; all: {rca.verdicts}"
    top = during[0]["causes"][0]
    assert top["cause"] == cause, json.dumps(during[0])
    assert top["culprit"] == {"peer": host}, json.dumps(during[0])


@pytest.mark.skipif(not have("stress-ng"), reason="needs stress-ng")
def test_memory_competitor_in_the_servers_cgroup_is_named(tmp_path: Path) -> None:
    """The bench server reads its per-token work from 256 MiB of mmap'd "weights" and runs in
    a memory cgroup of its own (a pod's limit); a stress-ng holding 512 MiB in that cgroup,
    under a limit that leaves room only by reclaiming 6% of the weights' page cache, makes
    it fault them back from disk (bench/rca_runs.py run --mem does the same). The verdict
    that covers the fault names host_memory_pressure and the competitor."""
    sys.path.insert(0, str(BENCH.parents[1]))
    from bench.faults.competitors import MemoryCgroup, start_memory_squeeze
    from bench.rca_runs import make_weights

    weights = make_weights(tmp_path / "weights", 256 << 20)
    port, dep_port = free_port(), free_port()
    control = tmp_path / "control.json"
    control.write_text('{"rate_mult": 1.0, "mix": "normal"}')
    cg = MemoryCgroup()
    procs = [_spawn("dep", "--port", str(dep_port))]
    comp = rca = None
    try:
        procs.append(subprocess.Popen(  # noqa: PLW1509 (no threads in this process fork here)
            [sys.executable, str(BENCH), "serve", "--port", str(port), "--dep-port",
             str(dep_port), "--weights", str(weights)], preexec_fn=cg.join))
        wait_port(dep_port)
        wait_port(port, timeout=60)  # it reads the weights in first
        rca = _Rca("-p", str(procs[1].pid), "--window", "5", "--duration", "80")
        procs.append(_spawn("load", "--port", str(port), "--rate", "5", "--seed", "21",
                            "--control", str(control), "--trace", str(TRACE)))
        time.sleep(30)  # the baseline: six normal windows
        comp = start_memory_squeeze(cg, int(0.06 * (256 << 20)), duration_s=60)
        t_fault = time.time_ns()
        culprits = set(comp.culprit()["pids"])  # type: ignore[call-overload]
        time.sleep(15)
        comp.stop()
        t_end = time.time_ns()
        time.sleep(3)
    finally:
        if comp is not None:
            comp.stop()
        if rca is not None:
            rca.stop()
        for p in procs:
            p.terminate()
            p.wait(5)
        cg.remove()
    assert rca is not None
    during = [v for v in rca.verdicts
              if t_fault <= (v["window"]["start_unix_nano"] + v["window"]["end_unix_nano"]) // 2
              < t_end]
    assert during, f"no verdict during the fault; all: {rca.verdicts}"
    top = during[0]["causes"][0]
    print("first verdict in the fault:", json.dumps(during[0]["causes"][:2]))
    assert top["cause"] == "host_memory_pressure", json.dumps(during[0])
    assert top["culprit"] is not None and top["culprit"]["pid"] in culprits, json.dumps(during[0])
    before = [v for v in rca.verdicts if v["window"]["end_unix_nano"] <= t_fault]
    assert len(before) <= 1, f"false alarms before the fault: {before}"
