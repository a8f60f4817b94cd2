"""The fault-injection harness imposes real faults: the kernel's TCP and scheduler see them.

Root only (network namespaces, TUN, cgroups); no BPF. Each test is bounded to seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, TUN, cgroups)"),
    pytest.mark.timeout(120),
]

pyroute2 = pytest.importorskip("pyroute2")

from bench.faults.competitors import (
    children,
    schedstat,
    start_cpu_competitor,
    start_memory_competitor,
)
from bench.faults.measure import http_transfer, measure_rtt
from bench.faults.netns import Topology, leftovers, list_ours

ROOT = Path(__file__).resolve().parents[2]
needs_stress = pytest.mark.skipif(shutil.which("stress-ng") is None, reason="needs stress-ng")


def test_rtt_is_base_plus_twice_the_one_way_delay() -> None:
    with Topology() as topo:
        base = measure_rtt(topo, 0.0, samples=10)
        slow = measure_rtt(topo, 25.0, samples=10)
        back = measure_rtt(topo, 0.0, samples=10)
    assert base.app_rtt_ms_median < 5.0
    assert slow.app_rtt_ms_min >= 50.0  # never faster than the imposed delay
    assert slow.app_rtt_ms_median == pytest.approx(base.app_rtt_ms_median + 50.0, abs=8.0)
    assert slow.kernel_srtt_ms == pytest.approx(50.0, abs=10.0)  # TCP's own estimate
    assert back.app_rtt_ms_median < 5.0  # normal -> fault -> normal


def test_loss_makes_tcp_retransmit_and_http_still_completes() -> None:
    with Topology(seed=7) as topo:
        clean = http_transfer(topo, 0.0, 2 << 20)
        lossy = http_transfer(topo, 0.05, 2 << 20)
    for r in (clean, lossy):
        assert r.curl_ok and r.bytes_received == r.bytes_expected
    assert clean.relay_dropped == 0
    assert lossy.relay_dropped > 20  # ~5% of ~1500 data packets plus acks
    # the download's sender is the server: its netns counts the retransmitted segments
    assert lossy.retrans_segs_server >= 10
    assert lossy.retrans_segs_server > clean.retrans_segs_server


def test_teardown_leaves_nothing_even_on_error() -> None:
    topo = Topology(server_in_root=True)
    with pytest.raises(RuntimeError, match="boom"), topo:
        proc = topo.popen("client", ["sleep", "60"])
        assert len(leftovers(topo.tag)) == 2  # the client netns and the root-netns TUN
        raise RuntimeError("boom")
    assert leftovers(topo.tag) == []
    assert proc.poll() is not None
    topo.close()  # idempotent
    assert all(topo.tag not in n for n in list_ours())


def test_parallel_topologies_do_not_collide() -> None:
    with Topology() as a, Topology() as b:
        assert a.client_ns != b.client_ns and a.server_ns != b.server_ns
        a.set_link(delay_ms=20.0)
        assert measure_rtt(b, 0.0, samples=5).app_rtt_ms_median < 5.0
        assert measure_rtt(a, 20.0, samples=5).app_rtt_ms_median >= 40.0


def _wait_rate(pid: int, seconds: float) -> tuple[float, float]:
    """(run-queue wait, on-CPU) seconds per second of `pid` over `seconds`."""
    run0, wait0, _ = schedstat(pid)
    time.sleep(seconds)
    run1, wait1, _ = schedstat(pid)
    return (wait1 - wait0) / 1e9 / seconds, (run1 - run0) / 1e9 / seconds


@needs_stress
def test_cpu_competitor_delays_a_victim_in_its_scheduling_group() -> None:
    # the victim has its own session, hence its own autogroup: a naive competitor would not bite
    victim = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)
        base_wait, base_run = _wait_rate(victim.pid, 1.5)
        comp = start_cpu_competitor(victim.pid, intensity=1.0, duration_s=10)
        try:
            assert comp.culprit()["name"] == "stress-ng"
            assert len(children(comp.pid)) >= 1
            hit_wait, hit_run = _wait_rate(victim.pid, 1.5)
        finally:
            comp.stop()
        cgroup_after = Path(f"/proc/{victim.pid}/cgroup").read_text()
    finally:
        victim.kill()
        victim.wait()
    # a loaded machine already queues the victim a lot, so the wait can only grow so far
    assert hit_wait > base_wait + 0.05, (comp.placement, base_wait, hit_wait)
    assert hit_run < base_run * 0.8, (comp.placement, base_run, hit_run)
    assert "sits-fault" not in cgroup_after  # moved back where it was
    assert comp.popen.poll() is not None


@needs_stress
def test_memory_competitor_holds_a_bounded_share() -> None:
    comp = start_memory_competitor(intensity=0.02, duration_s=10)
    try:
        want = int(comp.detail["bytes"])  # type: ignore[call-overload]
        deadline, rss = time.monotonic() + 5, 0
        while time.monotonic() < deadline and rss < want // 2:
            rss = sum(_rss(p) for p in children(comp.pid))
            time.sleep(0.1)
    finally:
        comp.stop()
    assert rss >= want // 2
    assert comp.culprit()["pid"] == comp.pid


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_cli_applies_and_labels_a_delay_fault(tmp_path: Path) -> None:
    labels = tmp_path / "labels.json"
    before = set(list_ours())
    t0 = time.time_ns()
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/faults/inject.py"),
         "--server-cmd", f"{sys.executable} -m http.server 8080 --bind {{server_ip}}",
         "--port", "8080", "--fault", "network_delay:ms=30", "--at", "1", "--for", "1.5",
         "--duration", "3", "--labels", str(labels), "--seed", "3"],
        check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "apply  network_delay" in out.stdout and "remove network_delay" in out.stdout
    doc = json.loads(labels.read_text())
    (f,) = doc["faults"]
    assert f["cause"] == "network_delay" and f["intensity"] == 30.0 and f["seed"] == 3
    assert f["culprit"]["peer"] == doc["client_ip"]
    assert t0 < f["start_ns"] < f["end_ns"]
    assert (f["end_ns"] - f["start_ns"]) / 1e9 == pytest.approx(1.5, abs=0.3)
    assert set(list_ours()) == before


def test_cli_rejects_a_bad_fault_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/faults/inject.py"), "--server-cmd", "true",
         "--fault", "network_delay:jitter_ms=3", "--at", "0", "--for", "1"],
        check=False, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "inject: network_delay:jitter_ms=3: give the intensity as network_delay:ms=<number>")
