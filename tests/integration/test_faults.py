"""The fault-injection harness imposes real faults: the kernel's TCP and scheduler see them.

The `root` tests need root (network namespaces, TUN, cgroups), no BPF; each is bounded to
seconds. The schedule/label logic at the end runs anywhere, on a fake clock.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, TUN, cgroups)")

pyroute2 = pytest.importorskip("pyroute2")

from bench.faults.competitors import (
    CompetitorError,
    MemoryCgroup,
    children,
    choose_placement,
    memory_bytes,
    schedstat,
    start_cpu_competitor,
    start_memory_competitor,
    start_memory_squeeze,
)
from bench.faults.inject import Fault, FaultError, FaultRunner, check_schedule, parse_fault
from bench.faults.measure import http_transfer, measure_rtt
from bench.faults.netns import Topology, leftovers, list_ours
from bench.faults.relay import Direction, Link, LinkParams

ROOT = Path(__file__).resolve().parents[2]
needs_stress = pytest.mark.skipif(shutil.which("stress-ng") is None, reason="needs stress-ng")


@root
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


@root
def test_jitter_spreads_rtt_without_reordering() -> None:
    with Topology(seed=1) as topo:
        r = measure_rtt(topo, 20.0, samples=20, jitter_ms=10.0)
    assert r.app_rtt_ms_min >= 20.0  # two one-way delays of at least 10 ms each
    assert r.app_rtt_ms_max - r.app_rtt_ms_min > 5.0
    assert r.app_rtt_ms_max < 70.0


@root
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


@root
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


@root
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


@root
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


@root
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


_PAGER = r"""
import mmap, resource, sys
f = open(sys.argv[1], "rb")
mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
def sweep():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    pages = len(mm) // 4096  # every page, in a scattered order (a model's forward pass)
    sum(mm[i * 2654435761 % pages * 4096] for i in range(pages))
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before
print(sweep(), flush=True)
for _ in sys.stdin:
    print(sweep(), flush=True)
"""


@root
@needs_stress
def test_memory_squeeze_pushes_the_victims_page_cache_out(tmp_path: Path) -> None:
    """A victim whose working set is an mmap'd file, in its own memory cgroup: with room to
    spare it reads the file from memory; with a competitor in the cgroup under the squeezed
    limit, part of the file is reclaimed and read from disk again (major faults); afterwards
    the limit is lifted and the cgroup goes away."""
    weights = tmp_path / "weights"
    with weights.open("wb") as f:
        f.write(os.urandom(32 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    cg = MemoryCgroup()
    victim = subprocess.Popen([sys.executable, "-c", _PAGER, str(weights)], preexec_fn=cg.join,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert victim.stdin is not None and victim.stdout is not None
    try:
        first = int(victim.stdout.readline())  # read from disk: faults
        victim.stdin.write("\n")
        victim.stdin.flush()
        warm = int(victim.stdout.readline())  # all of it in memory now
        comp = start_memory_squeeze(cg, squeeze_bytes=4 << 20, hog_bytes=96 << 20,
                                    duration_s=30)
        limit_file = cg.path / ("memory.max" if cg.version == 2 else "memory.limit_in_bytes")
        limited = int(limit_file.read_text())
        deadline, held = time.monotonic() + 5, 0
        while time.monotonic() < deadline and held < 90 << 20:
            held = sum(_rss(p) for p in children(comp.pid))
            time.sleep(0.1)
        victim.stdin.write("\n")
        victim.stdin.flush()
        squeezed = int(victim.stdout.readline())
        comp.stop()
        lifted = limit_file.read_text().strip()
    finally:
        victim.kill()
        victim.wait()
        cg.remove()
    assert first > 0 and warm == 0, (first, warm)
    assert held >= 90 << 20  # the competitor holds its memory in the cgroup
    # 1024 of 8192 pages pushed out; each one read back costs a major fault (reading around
    # it pushes others out: more than 1024 of them)
    assert squeezed >= 200, (squeezed, limited, comp.detail)
    assert lifted in ("max", str(2**63 - 4096)) or int(lifted) > 1 << 60
    assert not cg.path.exists()
    assert comp.popen.poll() is not None


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@root
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


@root
def test_cli_stops_on_sigint_with_faults_removed_and_labels_written(tmp_path: Path) -> None:
    labels = tmp_path / "labels.json"
    before = set(list_ours())
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/faults/inject.py"), "--server-cmd", "sleep 300",
         "--fault", "network_loss:p=0.1", "--at", "0", "--for", "60", "--duration", "60",
         "--labels", str(labels)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "apply  network_loss" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    (f,) = json.loads(labels.read_text())["faults"]
    assert f["cause"] == "network_loss" and f["end_ns"] > f["start_ns"]
    assert set(list_ours()) == before


def test_cli_rejects_a_bad_fault_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/faults/inject.py"), "--server-cmd", "true",
         "--fault", "network_delay:jitter_ms=3", "--at", "0", "--for", "1"],
        check=False, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "inject: network_delay:jitter_ms=3: give the intensity as network_delay:ms=<number>")


# -- no root needed: the relay's decisions, the schedule, the labels, the placement ----------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, d: float) -> None:
        self.t += d

    def wall_ns(self) -> int:
        return int(self.t * 1e9)


def test_relay_delays_drops_by_seed_and_keeps_order_under_jitter() -> None:
    clock = FakeClock()
    runs = []
    for _ in range(2):
        link, d = Link(LinkParams(delay_ms=10, jitter_ms=8, loss=0.3), 42, clock), Direction(0, 1)
        for i in range(200):
            link.admit(d, bytes([i]))
        runs.append([p[0] for _, p in d.queue])
    assert runs[0] == runs[1]  # same seed, same fate
    assert 100 < len(runs[0]) < 180 and runs[0] == sorted(runs[0])  # ~30% lost, FIFO
    assert link.due(d) == []  # nothing before 2 ms
    clock.t += 0.0181
    assert len(link.due(d)) == len(runs[0])  # everything by delay + jitter


class Recorder:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.events: list[tuple[str, str, float]] = []

    def apply(self, fault: Fault) -> dict[str, object] | None:
        self.events.append(("apply", fault.kind, self.clock.t - 100.0))
        return {"pid": 1234, "name": "hog"}

    def remove(self, fault: Fault) -> None:
        self.events.append(("remove", fault.kind, self.clock.t - 100.0))


def test_runner_applies_and_removes_on_time_and_labels_what_happened() -> None:
    clock = FakeClock()
    rec = Recorder(clock)
    faults = [Fault("network_delay", 2.0, 3.0, 50.0),
              Fault("cpu_starvation", 4.0, 1.0, 1.0, culprit={"pid": 7, "name": "given"})]
    runner = FaultRunner(faults, {"network_delay": rec, "cpu_starvation": rec}, seed=9,
                         clock=clock, sleep=clock.sleep, wall_ns=clock.wall_ns)
    labels = runner.run(total_s=8.0)
    assert rec.events == [("apply", "network_delay", 2.0), ("apply", "cpu_starvation", 4.0),
                          ("remove", "network_delay", 5.0), ("remove", "cpu_starvation", 5.0)]
    assert clock.t == pytest.approx(108.0)
    d, c = labels
    assert (d.cause, d.culprit, d.seed) == ("network_delay", {"pid": 1234, "name": "hog"}, 9)
    assert (d.start_ns, d.end_ns) == (102 * 10**9, 105 * 10**9)
    assert c.culprit == {"pid": 7, "name": "given"}  # the caller's label wins


def test_runner_removes_active_faults_when_interrupted() -> None:
    clock = FakeClock()
    rec = Recorder(clock)

    def sleep(d: float) -> None:
        clock.sleep(d)
        if clock.t - 100.0 >= 3.0:
            raise KeyboardInterrupt

    runner = FaultRunner([Fault("network_loss", 1.0, 10.0, 0.05)], {"network_loss": rec},
                         clock=clock, sleep=sleep, wall_ns=clock.wall_ns)
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    assert [e[0] for e in rec.events] == ["apply", "remove"]
    assert runner.labels[0].end_ns is not None


def test_schedule_checks() -> None:
    check_schedule([Fault("network_delay", 0, 5, 10), Fault("network_loss", 1, 5, 0.1)])
    with pytest.raises(FaultError, match="overlap"):
        check_schedule([Fault("network_delay", 0, 5, 10), Fault("network_delay", 4, 5, 10)])
    with pytest.raises(FaultError, match="unknown fault kind"):
        Fault("disk_full", 0, 1, 1).validate()
    with pytest.raises(FaultError, match="no handler for server_queueing"):
        FaultRunner([Fault("server_queueing", 0, 1, 2)], {})
    f = parse_fault("network_delay:ms=50,jitter_ms=5", 10, 20)
    assert (f.kind, f.intensity, f.params, f.end_s) == ("network_delay", 50.0, {"jitter_ms": 5.0}, 30)


def test_memory_size_is_bounded() -> None:
    gib = 1 << 30
    assert memory_bytes(0.25, 20 * gib) == 5 * gib
    assert memory_bytes(0.9, 20 * gib) == 16 * gib  # at most reserve-limited and capped
    assert memory_bytes(0.9, 6 * gib) == 2 * gib  # 4 GiB stay available
    with pytest.raises(CompetitorError):
        memory_bytes(0.5, 4 * gib)
    with pytest.raises(CompetitorError):
        memory_bytes(1.0, 20 * gib)


def _fake_proc(tmp: Path, victim_cg: str, victim_ag: str, enabled: str = "1") -> Path:
    proc, cg = tmp / "proc", tmp / "cgcpu"
    (proc / "self").mkdir(parents=True)
    (proc / "42").mkdir()
    (proc / "sys/kernel").mkdir(parents=True)
    cg.mkdir()
    (proc / "self/mountinfo").write_text(
        f"32 31 0:29 / {cg} rw,relatime - cgroup cgroup rw,cpu\n")
    (proc / "42/cgroup").write_text(f"4:memory:/x\n1:cpu:{victim_cg}\n0::/\n")
    (proc / "42/autogroup").write_text(f"{victim_ag} nice 0\n")
    (proc / "self/autogroup").write_text("/autogroup-6 nice 0\n")
    (proc / "sys/kernel/sched_autogroup_enabled").write_text(enabled + "\n")
    return proc


def test_cpu_placement_follows_the_victims_scheduling_group(tmp_path: Path) -> None:
    p = _fake_proc(tmp_path / "a", "/svc", "/autogroup-9")
    assert choose_placement(42, p) == ("cgroup", tmp_path / "a/cgcpu/svc")
    p = _fake_proc(tmp_path / "b", "/", "/autogroup-6")
    assert choose_placement(42, p) == ("session", None)
    p = _fake_proc(tmp_path / "c", "/", "/autogroup-9")
    assert choose_placement(42, p) == ("cgroup-move", tmp_path / "c/cgcpu")
    p = _fake_proc(tmp_path / "d", "/", "/autogroup-9", enabled="0")
    assert choose_placement(42, p) == ("session", None)
