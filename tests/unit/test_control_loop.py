"""The control loop on a fake cgroup tree and a fake /proc: modes, actions, undo, metrics."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
from sits_trace.agent.config import ConfigError, ControlConfig, load
from sits_trace.agent.model import Span
from sits_trace.analyzers.control.actuators import CgroupCpuActuator, CpuHierarchy
from sits_trace.analyzers.control.board import DecisionBoard
from sits_trace.analyzers.control.latency import LatencyTable, p95
from sits_trace.analyzers.control.loop import ControlLoop
from sits_trace.analyzers.control.verdicts import PushedVerdicts
from sits_trace.analyzers.control.window import IntervalStats, StaticWindow
from sits_trace.exporters.otlp_logs import ActionLog

VICTIM = "/user.slice/victim"
THROTTLE = "/user.slice/sits-trace-throttle-42"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fake_node(tmp: Path) -> tuple[Path, Path]:
    proc, cg = tmp / "proc", tmp / "cg"
    for pid, comm, ppid in ((42, "stress-ng", 1), (43, "stress-ng-cpu", 42), (7, "llm", 1)):
        d = proc / str(pid)
        d.mkdir(parents=True)
        # flags 4194560 = PF_... without PF_KTHREAD; utime/stime fields 14, 15
        (d / "stat").write_text(f"{pid} ({comm}) R {ppid} {pid} {pid} 0 -1 4194560 "
                                "0 0 0 0 100 50 0 0 20 0 1 0 1 1 1\n")
        (d / "cgroup").write_text(f"0::{VICTIM}\n")
        (d / "task" / str(pid)).mkdir(parents=True)
        (d / "task" / str(pid) / "schedstat").write_text("0 0 0\n")
    (cg / VICTIM.lstrip("/")).mkdir(parents=True)
    (cg / "user.slice" / "cgroup.subtree_control").write_text("cpu memory")
    (cg / VICTIM.lstrip("/") / "cgroup.procs").write_text("42\n43\n7\n")
    return proc, cg


def schedstat(tmp: Path, pid: int, run_ns: int, wait_ns: int) -> None:
    (tmp / "proc" / str(pid) / "task" / str(pid) / "schedstat").write_text(
        f"{run_ns} {wait_ns} 1\n")


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def verdict(cause: str = "cpu_starvation", pid: int = 42, breach: bool = True,
            service: str = "llm", score: float = 0.9) -> dict[str, Any]:
    return {"time_unix_nano": 1, "service": service, "route": "/v1/completions",
            "breach": breach, "causes": [{"cause": cause, "score": score,
                                          "culprit": {"pid": pid, "name": "stress-ng"}}]}


RECORDS: dict[int, list[dict[str, Any]]] = {}


def make(tmp: Path, mode: str, **kw: Any) -> tuple[ControlLoop, PushedVerdicts, Clock, Path]:
    proc, cg = fake_node(tmp)
    opts = ControlConfig(mode=mode, service="llm", slo_ms=100.0, clear_after_s=5.0,
                         copy_budget_bytes_per_s=1e9, **kw)
    act = CgroupCpuActuator(CpuHierarchy(cg, 2), proc_root=proc, remove_dir=shutil.rmtree,
                            state_path=tmp / "state.json")
    pushed = PushedVerdicts()
    clock = Clock()
    records: list[dict[str, Any]] = []
    loop = ControlLoop(opts, DecisionBoard(), actuator=act, verdicts=pushed, clock=clock,
                       on_action=[records.append])
    RECORDS[id(loop)] = records
    return loop, pushed, clock, cg


def feed(loop: ControlLoop, ms: float, n: int = 50) -> None:
    for _ in range(n):
        loop.observe_latency("llm", ms)


@pytest.mark.parametrize("mode", ["observe", "advise"])
def test_observe_and_advise_touch_nothing(tmp_path: Path, mode: str) -> None:
    loop, pushed, clock, cg = make(tmp_path, mode)
    before = tree_digest(cg)
    for _ in range(3):
        pushed.push(verdict())
        feed(loop, 300)
        loop.tick()
        clock.t += 1
    loop.stop()
    assert tree_digest(cg) == before
    assert not (tmp_path / "state.json").exists()
    d, version = loop.board.snapshot()
    if mode == "observe":
        assert version == 0 and d["batch_window_ms"] is None and d["cpu_actions"] == []
    else:
        assert d["batch_window_ms"] is not None
    assert ("cpu_throttle", "cpu_starvation", "false") in loop.counts


def test_advise_lists_the_action_unapplied_and_drops_it_when_no_longer_named(
        tmp_path: Path) -> None:
    loop, pushed, clock, _ = make(tmp_path, "advise")
    pushed.push(verdict())
    loop.tick()
    (a,) = loop.board.snapshot()[0]["cpu_actions"]
    assert (a["pid"], a["applied"], a["cause"]) == (42, False, "cpu_starvation")
    clock.t += 6
    loop.tick()
    assert loop.board.snapshot()[0]["cpu_actions"] == []


def test_act_throttles_culprit_and_descendants(tmp_path: Path) -> None:
    loop, pushed, _, cg = make(tmp_path, "act")
    pushed.push(verdict())
    loop.tick()
    d = cg / THROTTLE.lstrip("/")
    assert (d / "cpu.max").read_text() == "25000 100000"
    assert (d / "cpu.weight").read_text() == "10"
    assert (d / "cgroup.procs").read_text() == "43"  # the last pid moved in: 42, then 43
    (a,) = loop.board.snapshot()[0]["cpu_actions"]
    assert a["applied"] is True and a["pids"] == [42, 43]
    assert any(r["kind"] == "cpu_throttle" and r["applied"] for r in RECORDS[id(loop)])


def test_act_undoes_when_the_culprit_stops_competing(tmp_path: Path) -> None:
    loop, pushed, clock, cg = make(tmp_path, "act")
    d = cg / THROTTLE.lstrip("/")
    pushed.push(verdict())
    loop.tick()
    (d / "cgroup.procs").write_text("42\n43\n")
    for i in range(1, 9):  # 0.25 CPU cap; it wants 0.05 CPU (run + wait): under half the cap
        if not d.exists():
            break
        schedstat(tmp_path, 42, run_ns=i * 30_000_000, wait_ns=i * 20_000_000)
        clock.t += 1
        loop.tick()
    assert not d.exists() and clock.t == 1006  # first rate at 1001, then low for 5 s
    assert (cg / VICTIM.lstrip("/") / "cgroup.procs").read_text() == "43"  # moved back
    assert loop.board.snapshot()[0]["cpu_actions"] == []
    restore = [r for r in RECORDS[id(loop)] if r["kind"] == "cpu_restore"]
    assert restore and "under half" in restore[0]["reason"]


def test_act_keeps_the_throttle_while_the_culprit_uses_its_cap(tmp_path: Path) -> None:
    loop, pushed, clock, cg = make(tmp_path, "act")
    d = cg / THROTTLE.lstrip("/")
    pushed.push(verdict())
    loop.tick()
    (d / "cgroup.procs").write_text("42\n43\n")
    for i in range(1, 11):  # on a CPU 0.05 s a second (held back), runnable 1.9 s: it wants 2
        schedstat(tmp_path, 42, run_ns=i * 50_000_000, wait_ns=i * 1_900_000_000)
        clock.t += 1
        loop.tick()
    assert d.exists() and loop.actuator is not None and 42 in loop.actuator.active


def test_act_undoes_when_the_culprit_exits_and_on_stop(tmp_path: Path) -> None:
    loop, pushed, clock, cg = make(tmp_path, "act")
    pushed.push(verdict())
    loop.tick()
    d = cg / THROTTLE.lstrip("/")
    (d / "cgroup.procs").write_text("")  # all gone
    clock.t += 1
    loop.tick()
    assert not d.exists()
    pushed.push(verdict(pid=43))
    loop.tick()
    d43 = cg / "user.slice" / "sits-trace-throttle-43"
    assert d43.exists()
    loop.stop()
    assert not d43.exists() and loop.board.snapshot()[0]["cpu_actions"] == []


def test_state_file_lets_the_next_agent_undo(tmp_path: Path) -> None:
    loop, pushed, _, cg = make(tmp_path, "act")
    pushed.push(verdict())
    loop.tick()  # then the agent dies without stop()
    assert (tmp_path / "state.json").read_text().count('"pid": 42') == 1
    nxt = CgroupCpuActuator(CpuHierarchy(cg, 2), proc_root=tmp_path / "proc",
                            remove_dir=shutil.rmtree, state_path=tmp_path / "state.json")
    assert nxt.revert_stale() == 1
    assert not (cg / THROTTLE.lstrip("/")).exists()


def test_bounds_protected_weak_and_non_breach_verdicts(tmp_path: Path) -> None:
    loop, pushed, _, cg = make(tmp_path, "act")
    loop.observe_span(Span("0" * 32, "1" * 16, None, "GET", "SERVER", 0, 5_000_000,
                           {"process.executable.name": "llm", "process.pid": 7}))
    pushed.push(verdict(pid=7))  # the served process itself
    pushed.push(verdict(pid=1))
    pushed.push(verdict(pid=99999))  # no such process
    pushed.push(verdict(score=0.1))  # too weak
    pushed.push(verdict(breach=False))
    pushed.push(verdict(cause="network_delay"))
    loop.tick()
    assert not any(p.name.startswith("sits-trace-throttle") for p in cg.rglob("*"))
    assert loop.counts[("cpu_throttle_refused", "cpu_starvation", "false")] == 3


def test_gpu_causes_ask_for_priority_and_copy_budget_then_clear(tmp_path: Path) -> None:
    loop, pushed, clock, _ = make(tmp_path, "advise")
    pushed.push(verdict(cause="pcie_contention"))
    loop.tick()
    d = loop.board.snapshot()[0]
    assert d["stream_priority"] == -1 and d["copy_budget_bytes_per_s"] == 1e9
    clock.t += 6
    loop.tick()
    d = loop.board.snapshot()[0]
    assert d["stream_priority"] is None and d["copy_budget_bytes_per_s"] is None


def test_window_follows_latency_and_the_verdict(tmp_path: Path) -> None:
    loop, pushed, clock, _ = make(tmp_path, "advise", window_ms=50.0)
    loop.board.report("llm", queue_depth=40, batch_size=3)
    feed(loop, 300)
    pushed.push(verdict(cause="server_queueing"))
    loop.tick()
    grown = loop.board.snapshot()[0]["batch_window_ms"]
    assert grown > 50  # backlog: bigger batches
    moved = [r for r in RECORDS[id(loop)] if r["kind"] == "batch_window"][-1]
    assert moved["window_ms"] == grown and "backlog" in moved["reason"]  # says why
    clock.t += 1
    loop.board.report("llm", queue_depth=40, batch_size=3)
    feed(loop, 300)
    pushed.push(verdict(cause="network_delay", pid=0))
    loop.tick()
    assert loop.board.snapshot()[0]["batch_window_ms"] <= grown  # never grows for network


def test_the_servers_arrival_count_reaches_the_controller(tmp_path: Path) -> None:
    seen = []

    class Spy(StaticWindow):
        def step(self, stats: IntervalStats, cause: str | None) -> float:
            seen.append(stats.arrivals)
            return self.window_ms

    loop, _, clock, _ = make(tmp_path, "advise", window_ms=50.0)
    loop.controller = Spy(50.0)
    for count in (1000, 1040, 1100):
        loop.board.report("llm", queue_depth=0, batch_size=1, arrivals=count)
        feed(loop, 30)
        loop.tick()
        clock.t += 1
    assert seen == [None, 40, 60]


def test_metrics_and_otlp_records(tmp_path: Path) -> None:
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    mem = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
    otlp = ActionLog(mem)
    loop, pushed, _, _ = make(tmp_path, "act")
    loop._on_action.append(otlp)
    pushed.push(verdict())
    feed(loop, 50)
    loop.tick()
    names = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in loop.metric_samples()}
    key = ("sits_control_actions_total",
           (("applied", "true"), ("cause", "cpu_starvation"), ("kind", "cpu_throttle")))
    assert names[key] == 1.0
    assert names[("sits_control_cpu_actions_active", ())] == 1.0
    otlp.force_flush()
    recs = [r.log_record for r in mem.get_finished_logs()]
    throttle = [r for r in recs if r.event_name == "sits.control.cpu_throttle"]
    assert throttle and throttle[0].attributes is not None
    assert throttle[0].attributes["sits.control.pid"] == 42
    loop.stop()


def test_control_config_keys(tmp_path: Path) -> None:
    assert load(env={}).control.mode == "advise"
    cfg = load(env={"SITS_CONTROL_MODE": "act", "SITS_CONTROL_STREAM_PRIORITY": "-2"})
    assert (cfg.control.mode, cfg.control.stream_priority) == ("act", -2)
    for key, val, msg in (("mode", "auto", "control.mode"),
                          ("controller", "pid", "control.controller"),
                          ("window_ms", "600", "control.window_ms"),
                          ("cpu_fraction", "0.01", "control.cpu_fraction")):
        with pytest.raises(ConfigError, match=msg):
            load(env={f"SITS_CONTROL_{key.upper()}": val})


def test_the_agent_tees_spans_to_the_loop_and_exports_its_metrics() -> None:
    from sits_trace.agent.config import Config
    from sits_trace.agent.daemon import Agent

    cfg = Config()
    cfg.control = ControlConfig(mode="observe", socket_path="", service="llm")
    seen: list[Span] = []
    agent = Agent(cfg, seen.append)
    assert agent.control is not None
    span = Span("0" * 32, "1" * 16, None, "GET", "SERVER", 0, 7_000_000,
                {"process.executable.name": "llm", "process.pid": 7})
    agent.sink(span)
    assert seen == [span]  # the exporters still get every span
    agent.control.loop.tick()
    assert agent.control.loop.last_p95_ms == 7.0
    names = {s.name for s in agent.metric_samples()}
    assert {"sits_control_mode", "sits_control_latency_p95_seconds"} <= names
    cfg.control = ControlConfig(enabled=False)
    assert Agent(cfg, seen.append).control is None
    cfg.control = ControlConfig(socket_path="")  # the defaults: advise, plans CPU actions
    assert Agent(cfg, seen.append).control is not None


def test_latency_table_takes_server_spans_by_service_with_their_pids() -> None:
    """The loop's per-span input (compiled with the hot path): SERVER spans only, under the
    executable's name, else the pid, else "?"; durations in ms; only int pids kept."""
    def span(kind: str, ms: float, **attrs: Any) -> Span:
        return Span("0" * 32, "1" * 16, None, "GET", kind, 1_000, 1_000 + int(ms * 1e6),
                    attrs)
    t = LatencyTable()
    t.add_spans([span("SERVER", 5, **{"process.executable.name": "llm", "process.pid": 7}),
                 span("CLIENT", 9, **{"process.executable.name": "llm", "process.pid": 7}),
                 span("SERVER", 2.5, **{"process.executable.name": "llm", "process.pid": 8}),
                 span("SERVER", 1, **{"process.pid": 42}),
                 span("SERVER", 3, **{"process.pid": "x"}),
                 span("SERVER", 4)])
    t.add("llm", 7.0)
    assert t.busiest() == "llm"
    assert t.pids("llm") == {7, 8} and t.pids("42") == {42} and t.pids("x") == set()
    assert t.take("llm") == [5.0, 2.5, 7.0]
    assert t.take("llm") == []
    assert t.take("42") == [1.0] and t.take("x") == [3.0] and t.take("?") == [4.0]
    assert p95([]) is None and p95([float(i) for i in range(1, 101)]) == 95.0
