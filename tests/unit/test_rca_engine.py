"""The RCA engine on synthetic span streams: detection, decomposition, culprits, the verdict's
JSON form. No root, no kernel: spans and /proc snapshots are built here."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
from sits_trace.agent.model import Span
from sits_trace.analyzers.rca import VOCABULARY, RcaEngine, RcaSettings, parse_slos
from sits_trace.analyzers.rca.procs import ProcSnapshot
from sits_trace.analyzers.rca.verdict import Verdict

T0 = 1_700_000_000_000_000_000
SEC = 1_000_000_000
VICTIM, OTHER, HOG, DEP = 100, 200, 300, 400

Attrs = Callable[[np.random.Generator, bool], dict[str, float | str]]


def _span(start: int, dur_ms: float, attrs: dict[str, float | str], kind: str = "SERVER",
          error: bool = False) -> Span:
    a: dict[str, str | bool | int | float] = {"process.pid": VICTIM,
                                              "process.executable.name": "srv",
                                              "url.path": "/v1/completions",
                                              "network.peer.address": "10.0.0.9"}
    a.update(attrs)
    return Span("a" * 32, "b" * 16, None, "POST", kind, start, start + int(dur_ms * 1e6), a,
                "ERROR" if error else "UNSET")


def _run(extra: Attrs, *, seconds: int = 40, fault_at: int = 30, rate: int = 40,
         hog_cores: float = 0.0, slos: list[dict[str, object]] | None = None,
         deps: bool = False, dep_ms: Callable[[bool], float] | None = None,
         dep_runq_s: float = 0.0, local_dep: bool = False,
         dep_wait_us: Callable[[bool], float] | None = None,
         dep_whole_wait_s: float | None = None) -> list[Verdict]:
    """A server answering `rate` requests a second in ~5 ms; from `fault_at` the fault: `extra`
    adds attributes (and its own latency via "dur_ms")."""
    rng = np.random.default_rng(7)
    eng = RcaEngine(RcaSettings(window_s=2), parse_slos(slos or []), model=None,
                    exclude_pids=set(),
                    peer_pids=(lambda p: {DEP} if p == "10.0.0.50:9000" else set())
                    if local_dep else None)
    cpu = {VICTIM: 0.0, OTHER: 0.0, HOG: 0.0, DEP: 0.0}
    runq = whole = 0.0
    out: list[Verdict] = []
    for sec in range(seconds):
        fault = sec >= fault_at
        spans = []
        for i in range(rate):
            start = T0 + sec * SEC + i * (SEC // rate)
            a = extra(rng, fault)
            dur = 5.0 + float(rng.uniform(0, 1)) + float(a.pop("dur_ms", 0.0))
            spans.append(_span(start, dur, a))
            if deps and dep_ms is not None:
                d = dep_ms(fault)
                da: dict[str, float | str] = {"server.address": "10.0.0.50", "server.port": 9000}
                if dep_wait_us is not None:  # the caller's own run-queue wait inside the call
                    da["sits.cpu.runq_delay_us"] = dep_wait_us(fault)
                spans.append(_span(start + 100_000, d, da, kind="CLIENT"))
        for s in spans:
            out += eng.advance(s.end_time_unix_nano)
            eng.add(s)
        cpu[VICTIM] += 0.3
        cpu[OTHER] += 0.05
        cpu[HOG] += hog_cores if fault else 0.01
        cpu[DEP] += 0.02
        runq += dep_runq_s if fault else 0.0001  # the dependency's wait for a CPU, this second
        # every thread's wait (taskstats), for the processes the engine asks to watch
        whole += (dep_whole_wait_s or 0.0) if fault else 0.0001
        watched = {p: whole for p in eng.watched_pids() if dep_whole_wait_s is not None}
        eng.add_procs(ProcSnapshot(T0 + (sec + 1) * SEC,
                                   {p: (f"p{p}", c, 50.0, 0.0, 0.0, p, runq if p == DEP else 0.0)
                                    for p, c in cpu.items()}, {}, watched))
    out += eng.advance(T0 + (seconds + 5) * SEC)
    return out


def _quiet(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
    return {"sits.cpu.runq_delay_us": float(rng.uniform(0, 100))}


def test_no_fault_no_verdict() -> None:
    assert _run(_quiet) == []


def test_cpu_competitor_is_top_cause_with_culprit() -> None:
    def runq(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        us = float(rng.uniform(8000, 12000)) if fault else float(rng.uniform(0, 100))
        return {"sits.cpu.runq_delay_us": us, "dur_ms": us / 1000}

    vs = _run(runq, hog_cores=1.6)
    assert vs, "a 10 ms run-queue wait on 5 ms requests must be detected"
    top = vs[0].causes[0]
    assert top.cause == "cpu_starvation"
    assert top.culprit == {"pid": HOG, "name": f"p{HOG}"}
    assert 8.0 < top.explained_ms < 12.0
    assert any(e.signal == "runq_ms" and e.observed > 8 for e in top.evidence)


def test_runq_without_competitor_but_more_arrivals_is_queueing() -> None:
    eng_rate = 40

    def runq(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        us = float(rng.uniform(8000, 12000)) if fault else float(rng.uniform(0, 100))
        return {"sits.cpu.runq_delay_us": us, "dur_ms": us / 1000}

    vs = _run(runq, rate=eng_rate)
    assert vs and vs[0].causes[0].cause == "cpu_starvation"  # no arrival rise: still the CPU
    assert vs[0].causes[0].culprit is None  # ... but nobody to blame


def test_retransmits_name_network_loss_and_peer() -> None:
    def loss(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        r = int(rng.random() < 0.3) if fault else 0
        return {"sits.tcp.retransmits": r, "sits.tcp.srtt_us": 100, "dur_ms": 200.0 * r,
                "network.peer.address": "10.0.0.7" if r else "10.0.0.9"}

    vs = _run(loss)
    assert vs and vs[0].causes[0].cause == "network_loss"
    assert vs[0].causes[0].culprit == {"peer": "10.0.0.7"}


def test_slow_outgoing_calls_name_slow_dependency() -> None:
    def dep(fault: bool) -> float:
        return 30.0 if fault else 1.0

    def slow(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        return {"dur_ms": 29.0 if fault else 0.0}

    vs = _run(slow, deps=True, dep_ms=dep)
    assert vs and vs[0].causes[0].cause == "slow_dependency"
    assert vs[0].causes[0].culprit == {"peer": "10.0.0.50:9000"}
    assert vs[0].causes[0].explained_ms == pytest.approx(29.0, abs=1.0)


def _slow_dep(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
    return {"dur_ms": 29.0 if fault else 0.0}


def _dep(fault: bool) -> float:
    return 30.0 if fault else 1.0


def test_local_dependency_starved_by_a_competitor_is_cpu_starvation() -> None:
    """The dependency runs on this node and waited 0.6 s a second for a CPU while a hog took
    1.6 cores: at 40 requests a second, 15 ms of each request's 29 ms are that wait."""
    vs = _run(_slow_dep, deps=True, dep_ms=_dep, hog_cores=1.6, dep_runq_s=0.6, local_dep=True)
    assert vs and vs[0].causes[0].cause == "cpu_starvation", vs[0].causes
    top = vs[0].causes[0]
    assert top.culprit == {"pid": HOG, "name": f"p{HOG}"}
    ev = {e.signal: e for e in top.evidence}
    assert ev["dependency_runq_ms_per_s"].observed == pytest.approx(600.0, rel=0.05)
    assert top.explained_ms == pytest.approx(15.0, abs=1.0)
    dep = {c.cause: c for c in vs[0].causes}["slow_dependency"]
    assert dep.explained_ms == pytest.approx(14.0, abs=1.0)  # the rest stays the dependency's


def test_a_thread_per_request_dependency_is_judged_on_every_threads_wait() -> None:
    """Its main thread (accept) waited as before; the request threads, gone by the next
    snapshot, waited 0.6 s a second: the engine watches the local callee it saw in CLIENT
    spans, and the whole process's wait (taskstats) moves 15 ms to cpu_starvation."""
    vs = _run(_slow_dep, deps=True, dep_ms=_dep, hog_cores=1.6, dep_runq_s=0.0001,
              local_dep=True, dep_whole_wait_s=0.6)
    assert vs and vs[0].causes[0].cause == "cpu_starvation", vs[0].causes
    ev = {e.signal: e for e in vs[0].causes[0].evidence}
    assert ev["dependency_runq_ms_per_s"].observed == pytest.approx(600.0, rel=0.05)
    assert vs[0].causes[0].explained_ms == pytest.approx(15.0, abs=1.0)
    # a fault early enough that the baseline reaches back before the watch began (the
    # engine looks up its callees once their first window closes): counted from the first
    # snapshot that has the wait (CI: the baseline fell back to the main thread's wait)
    vs = _run(_slow_dep, deps=True, dep_ms=_dep, hog_cores=1.6, dep_runq_s=0.0001,
              local_dep=True, dep_whole_wait_s=0.6, seconds=24, fault_at=14)
    assert vs and vs[0].causes[0].cause == "cpu_starvation", vs[0].causes
    # the main thread alone (no whole-process wait): the dependency stays the cause
    vs = _run(_slow_dep, deps=True, dep_ms=_dep, hog_cores=1.6, dep_runq_s=0.0001,
              local_dep=True)
    assert vs and vs[0].causes[0].cause == "slow_dependency", vs[0].causes


def test_a_starved_caller_reading_its_answer_late_is_not_a_slow_dependency() -> None:
    """The calls took 20 ms longer, all of it the caller waiting for a CPU (the CLIENT spans'
    runq_delay_us; the SERVER spans carry it too): cpu_starvation, the dependency explains
    nothing."""
    def starved(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        return {"sits.cpu.runq_delay_us": 20_000.0 if fault else 50.0,
                "dur_ms": 20.0 if fault else 0.0}

    vs = _run(starved, deps=True, dep_ms=lambda f: 21.0 if f else 1.0, hog_cores=1.6,
              dep_wait_us=lambda f: 20_000.0 if f else 0.0)
    assert vs and vs[0].causes[0].cause == "cpu_starvation", vs[0].causes
    dep = {c.cause: c for c in vs[0].causes}.get("slow_dependency")
    assert dep is None or abs(dep.explained_ms) < 1.0
    assert vs[0].causes[0].explained_ms == pytest.approx(20.0, abs=1.0)


@pytest.mark.parametrize(("hog", "runq", "local"), [(1.6, 0.0001, True), (0.0, 0.6, True),
                                                    (1.6, 0.6, False)])
def test_dependency_stays_slow_dependency_unless_starved_here(hog: float, runq: float,
                                                              local: bool) -> None:
    """No rise in its CPU wait, no competitor (its own load), or not on this node: the
    dependency is what is slow."""
    vs = _run(_slow_dep, deps=True, dep_ms=_dep, hog_cores=hog, dep_runq_s=runq, local_dep=local)
    assert vs and vs[0].causes[0].cause == "slow_dependency", vs[0].causes
    assert vs[0].causes[0].culprit == {"peer": "10.0.0.50:9000"}


def test_longer_outputs_name_request_mix_shift() -> None:
    def mix(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        chunks = int(rng.integers(20, 40) if fault else rng.integers(2, 10))
        return {"sits.stream.chunks": chunks, "dur_ms": 2.0 * chunks}

    vs = _run(mix)
    assert vs and vs[0].causes[0].cause == "request_mix_shift"


def test_slo_breach_names_objective_and_target() -> None:
    def slow(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        return {"dur_ms": 50.0 if fault else 0.0}

    vs = _run(slow, slos=[{"service": "srv", "duration_ms_p95": 20.0}])
    assert vs
    b = vs[0].breach
    assert b.objective == "duration_ms_p95" and b.target == 20.0 and b.observed > 50


def test_verdict_json_has_the_documented_keys_and_vocabulary() -> None:
    def runq(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        us = 10000.0 if fault else 50.0
        return {"sits.cpu.runq_delay_us": us, "dur_ms": us / 1000}

    vs = _run(runq, hog_cores=1.5)
    d = json.loads(json.dumps(vs[0].to_json()))
    assert {"time_unix_nano", "service", "route", "breach", "causes"} <= set(d)
    assert d["service"] == "srv" and d["route"] is None
    assert {"objective", "observed", "target"} <= set(d["breach"])
    for c in d["causes"]:
        assert set(c) == {"cause", "score", "culprit", "evidence", "explained_ms"}
        assert c["cause"] in VOCABULARY
        for e in c["evidence"]:
            assert set(e) == {"signal", "baseline", "observed"}


def test_verdict_comes_within_a_grace_of_the_window_end() -> None:
    def runq(rng: np.random.Generator, fault: bool) -> dict[str, float | str]:
        us = 10000.0 if fault else 50.0
        return {"sits.cpu.runq_delay_us": us, "dur_ms": us / 1000}

    vs = _run(runq, hog_cores=1.5)
    lag = (vs[0].time_unix_nano - vs[0].window_end_unix_nano) / 1e9
    assert 0 <= lag <= 2.0
    assert vs[0].window_start_unix_nano <= T0 + 30 * SEC < vs[0].window_end_unix_nano + 2 * SEC


def _stall_run(stall: tuple[float, float], *, rate: int = 20, surge: float = 1.0,
               service_ms: float = 5.0, stall_psi: float = 0.5,
               seconds: int = 40) -> list[Verdict]:
    """A one-at-a-time server (`service_ms` a request) stalls over `stall` (seconds) on memory: what
    arrives meanwhile waits and is answered back to back when it ends, so the window after
    sees more completions than arrivals. Pressure stall information says memory. `surge`
    multiplies the arrivals from the stall's start instead (a load rise, the queue real)."""
    eng = RcaEngine(RcaSettings(window_s=2), [], model=None, exclude_pids=set())
    s0, s1 = int(stall[0] * SEC), int(stall[1] * SEC)
    free = 0  # when the server can take the next request (ns since T0)
    spans: list[Span] = []
    t = 0.0
    while t < seconds:
        at = int(t * SEC)
        begin = max(at, free, s1 if s0 <= at < s1 and surge == 1.0 else 0)
        free = begin + int(service_ms * 1e6)
        spans.append(_span(T0 + at, (free - at) / 1e6, {}))
        t += 1.0 / (rate * (surge if at >= s0 else 1.0))
    spans.sort(key=lambda s: s.end_time_unix_nano)
    out: list[Verdict] = []
    psi = 0.0
    nxt = 1
    for s in spans:
        while T0 + nxt * SEC <= s.end_time_unix_nano:
            if s0 <= nxt * SEC <= max(s1, s0 + 2 * SEC):
                psi += stall_psi  # of each second, stalled on memory (reclaim, faults)
            eng.add_procs(ProcSnapshot(T0 + nxt * SEC, {VICTIM: ("srv", 0.3 * nxt, 50.0,
                                                                 0.0, 0.0, VICTIM, 0.0)},
                                       {"memory_some": psi}))
            nxt += 1
        out += eng.advance(s.end_time_unix_nano)
        eng.add(s)
    return out + eng.advance(T0 + (seconds + 5) * SEC)


def test_a_stall_that_drains_into_the_window_is_not_a_load_rise() -> None:
    """Requests that arrived during a memory stall begun before the window are answered in it:
    60 completions against the baseline's 40, 40 arrivals. Counted by completion, that was a
    load rise and the wait went to server_queueing (a live CI run of the memory test)."""
    vs = _stall_run((29.0, 30.5))
    assert vs, "a 1.5-s stall must be detected"
    first = vs[0]
    assert first.window_start_unix_nano == T0 + 30 * SEC  # the drain's window
    assert first.features["log_rate"] > 0.3  # completions rose ...
    top = first.causes[0]
    assert top.cause == "host_memory_pressure", [(c.cause, c.score) for c in first.causes]


def test_arrivals_that_outlast_their_window_still_count_as_a_load_rise() -> None:
    """Three times the arrivals on a server that answers 25 a second: the queue grows and
    most of the window's 120 arrivals end after it (its completions: 50 against the
    baseline's 40, no more than chance); counted where they began, those the grace period
    shows make the rise. Some memory pressure too (5% of each second): the queue is still
    the arrivals'."""
    vs = _stall_run((30.0, 30.0), rate=20, surge=3.0, service_ms=40.0, stall_psi=0.05)
    assert vs and vs[0].window_start_unix_nano == T0 + 30 * SEC
    assert vs[0].causes[0].cause == "server_queueing", [(c.cause, c.score) for c in vs[0].causes]
    arrived = [e for e in vs[0].causes[0].evidence if e.signal == "arrivals"]
    assert arrived and arrived[0].observed > 1.4 * arrived[0].baseline, arrived
