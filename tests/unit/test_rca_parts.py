"""RCA building blocks: /proc parsing, SLO parsing and config checks, recordings, the model."""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from sits_trace.agent.config import ConfigError, load
from sits_trace.agent.model import Span
from sits_trace.analyzers.rca.model import LinearModel, scores, train
from sits_trace.analyzers.rca.procs import ProcSampler, ProcSnapshot, delta, parse_psi, parse_stat
from sits_trace.analyzers.rca.recording import RecordingError, Writer, read
from sits_trace.analyzers.rca.slo import parse_objective, parse_slos

STAT = ("4242 (stress ng (cpu)) R 1 4242 4200 0 -1 4194304 1500 0 7 0 250 50 0 0 20 0 1 0 "
        "100 1000000 2560 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0")


def test_parse_stat_reads_comm_with_spaces_and_fields() -> None:
    got = parse_stat(STAT)
    assert got is not None
    comm, cpu, rss_mb, majflt, minflt, session, runq = got
    assert comm == "stress ng (cpu)"
    assert cpu == pytest.approx(300 / 100)  # utime + stime ticks at 100 Hz
    assert rss_mb == pytest.approx(2560 * 4096 / 2**20)
    assert (majflt, minflt, session, runq) == (7.0, 1500.0, 4200, 0.0)
    assert parse_stat("garbage") is None


def test_parse_psi_total() -> None:
    text = "some avg10=1.00 avg60=0.50 avg300=0.10 total=2500000\nfull avg10=0 total=10\n"
    assert parse_psi(text) == 2.5


def test_sampler_on_a_fake_proc_tree(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "stat").write_text(STAT)
    (tmp_path / "self").mkdir()
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").write_text("some avg10=0 total=1000000\n")
    snap = ProcSampler(str(tmp_path), clock_ns=lambda: 5).snapshot()
    assert list(snap.procs) == [4242] and snap.t_ns == 5
    assert snap.psi == {"memory_some": 1.0}


def test_delta_is_per_second_and_new_processes_count_from_zero() -> None:
    a = ProcSnapshot(0, {1: ("a", 10.0, 100.0, 0.0, 0.0, 1, 0.0)}, {"memory_some": 1.0})
    b = ProcSnapshot(2_000_000_000, {1: ("a", 11.0, 300.0, 4.0, 0.0, 1, 0.0),
                                     2: ("b", 3.0, 50.0, 0.0, 0.0, 2, 0.0)}, {"memory_some": 1.5})
    d = delta(a, b)
    assert d.cpu_cores == {1: 0.5, 2: 1.5}
    assert d.rss_growth_mb[1] == 200.0 and d.majflt_per_s[1] == 2.0
    assert d.psi["memory_some"] == pytest.approx(0.25)
    assert d.session == {1: 1, 2: 2}
    gone = delta(b, ProcSnapshot(3_000_000_000, {2: ("b", 3.0, 50.0, 0.0, 0.0, 2, 0.0)}))
    assert gone.gone_rss_mb == {1: 300.0} and gone.comm[1] == "a" and 1 not in gone.rss_mb


def test_objectives_parse() -> None:
    o = parse_objective("ttft_ms_p95", 500)
    assert o is not None and (o.metric, o.percentile, o.target) == ("ttft_ms", 95.0, 500.0)
    assert parse_objective("latency_p95", 1) is None
    slo = parse_slos([{"service": "llm", "route": "/v1/chat", "error_rate": 0.01,
                       "duration_ms_p99": 3000}])[0]
    assert slo.route == "/v1/chat" and {x.name for x in slo.objectives} == {"error_rate",
                                                                            "duration_ms_p99"}


def test_config_slo_tables_and_errors(tmp_path: Path) -> None:
    ok = tmp_path / "ok.toml"
    ok.write_text('[rca]\nwindow_s = 5\n[[slo]]\nservice = "llm"\nttft_ms_p95 = 400\n')
    cfg = load(ok, env={})
    assert cfg.rca.window_s == 5 and cfg.slo == [{"service": "llm", "ttft_ms_p95": 400}]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[slo]]\nservice = "llm"\nlatency_p95 = 400\n')
    with pytest.raises(ConfigError, match=r"slo\[0\].latency_p95"):
        load(bad, env={})
    none = tmp_path / "none.toml"
    none.write_text('[[slo]]\nservice = "llm"\n')
    with pytest.raises(ConfigError, match="no objective"):
        load(none, env={})


def test_recording_round_trip_and_appended_labels(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl.gz"
    w = Writer(p, 5.0, 1, agent_pid=77)
    w.span(Span("a" * 32, "b" * 16, None, "GET", "SERVER", 10, 20, {"process.pid": 3}))
    w.procs(ProcSnapshot(15, {3: ("srv", 1.0, 2.0, 0.0, 0.0, 3, 0.0)}, {"cpu_some": 0.5}))
    w.frame(15, {("cpu_runq_delay_s_per_s", "pid3"): 0.25})
    w.close()
    with gzip.open(p, "at") as f:  # the fault runner appends labels as a second member
        f.write(json.dumps({"type": "label", "cause": "cpu_starvation"}) + "\n")
    r = read(p)
    assert r.meta["agent_pid"] == 77 and r.spans[0].attributes == {"process.pid": 3}
    assert r.procs[0].procs[3][0] == "srv" and r.frames[0][1] == {
        ("cpu_runq_delay_s_per_s", "pid3"): 0.25}
    assert r.labels == [{"type": "label", "cause": "cpu_starvation"}]
    junk = tmp_path / "junk.gz"
    junk.write_bytes(b"not gzip")
    with pytest.raises(RecordingError):
        read(junk)


def test_model_trains_round_trips_and_leaves_unseen_causes_to_rules() -> None:
    rng = np.random.default_rng(0)
    x = np.vstack([rng.normal([2, 0], 0.3, (40, 2)), rng.normal([0, 2], 0.3, (40, 2)),
                   rng.normal([-2, -2], 0.3, (40, 2))])
    y = ["cpu_starvation"] * 40 + ["slow_dependency"] * 40 + ["server_queueing"] * 40
    m = LinearModel.from_json(json.loads(json.dumps(train(x, y, ("a", "b"), "t", "cmd").to_json())))
    p = m.proba({"a": 2.0, "b": 0.0})
    assert max(p, key=lambda k: p[k]) == "cpu_starvation" and sum(p.values()) == pytest.approx(1)
    s = scores(m, {"a": 0.0, "b": 2.0}, {"pcie_contention": 0.4, "cpu_starvation": 0.9})
    assert s["pcie_contention"] == 0.4  # not a class of the model: the rules' share
    assert max(s, key=lambda k: s[k]) == "slow_dependency"
    # the model splits what the causes it never saw leave
    assert sum(s[c] for c in m.classes) == pytest.approx(0.6)


def test_a_model_that_never_saw_a_cause_does_not_outvote_the_rules_on_it() -> None:
    """mem-20 (bench/rca_runs.py run --mem): memory stalls filled the server's slots; the
    model, never trained on memory, was sure of server_queueing (1.0) against the rules' 0.99
    for host_memory_pressure. Its probabilities are conditional on a cause it knows: they
    share what the rules leave. `unknown` is no measured cause and leaves the model whole."""
    rng = np.random.default_rng(1)
    x = np.vstack([rng.normal([2, 0], 0.3, (40, 2)), rng.normal([-2, -2], 0.3, (40, 2))])
    y = ["cpu_starvation"] * 40 + ["server_queueing"] * 40
    m = train(x, y, ("a", "b"), "t", "cmd")
    s = scores(m, {"a": -2.0, "b": -2.0}, {"host_memory_pressure": 0.9, "server_queueing": 0.1})
    assert max(s, key=lambda k: s[k]) == "host_memory_pressure"
    assert s["server_queueing"] == pytest.approx(0.1, abs=0.01)
    s = scores(m, {"a": -2.0, "b": -2.0}, {"unknown": 0.5, "server_queueing": 0.5})
    assert s["unknown"] == 0.5 and sum(s[c] for c in m.classes) == pytest.approx(1.0)


def test_memory_stall_takes_the_wait_for_slots_it_caused() -> None:
    """The same arrivals, the server stalled on page faults: requests in flight grew and
    what no signal explains is the wait for slots the stall kept taken (memory, not
    server_queueing), even when the few requests that finished were a little larger."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import Decomposition

    d = Decomposition("ttft_ms", 9.0, 5300.0, {C.HOST_MEMORY_PRESSURE: 475.0})
    f = dict.fromkeys(rank.FEATURES, 0.0) | {"log_inflight": 0.7, "log_chunks": 0.19,
                                             "psi_mem_delta": 0.16}
    h = rank.heuristic(d, f)
    assert max(h, key=lambda c: h[c]) == C.HOST_MEMORY_PRESSURE and h[C.HOST_MEMORY_PRESSURE] > 0.9
    f["psi_mem_delta"] = 0.0  # no stall measured: memory keeps only its own share
    h = rank.heuristic(d, f)
    assert h.get(C.HOST_MEMORY_PRESSURE, 0.0) == pytest.approx(475 / (5300 - 9))
    assert max(h, key=lambda c: h[c]) == C.REQUEST_MIX_SHIFT  # the larger requests, then
    f["log_chunks"] = 0.0
    h = rank.heuristic(d, f)
    assert max(h, key=lambda c: h[c]) == C.SERVER_QUEUEING


def test_a_chance_rise_in_arrivals_is_no_load_rise() -> None:
    """CI at cf2dc7f, the live memory test: the stalled server's first fault window held 28
    requests where the baseline's 4.08/s brings 20.4 (its queue drained into the window);
    the rate rule gave the wait the stall caused (rest ~200 ms of 235) to server_queueing,
    0.88 against memory's 0.12. A rise within a Poisson count's chance is no load rise; the
    same rise over a window ten times as full is."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import Decomposition

    def rules(expected: float, seen: float) -> dict[str, float]:
        d = Decomposition("ttft_ms", 11.7, 246.4, {C.HOST_MEMORY_PRESSURE: 28.9,
                                                   C.CPU_STARVATION: 2.3},
                          {"requests": (expected, seen)})
        f = dict.fromkeys(rank.FEATURES, 0.0) | {"log_rate": math.log(seen / expected),
                                                 "log_inflight": 1.27, "psi_mem_delta": 0.117}
        return rank.heuristic(d, f)

    h = rules(20.4, 28.0)
    assert max(h, key=lambda c: h[c]) == C.HOST_MEMORY_PRESSURE, h
    h = rules(204.0, 280.0)  # z 5.3: the load rose
    assert max(h, key=lambda c: h[c]) == C.SERVER_QUEUEING, h


def test_the_unmeasured_wait_is_shown_on_the_cause_that_leads() -> None:
    """The verdict's ms per cause add up to the rise once: the wait no signal measures goes
    with the best ranked cause that can hold it, not with server_queueing in second place."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import decompose
    from sits_trace.analyzers.rca.spantable import empty_frame

    df = empty_frame()
    d = decompose(df, df, "ttft_ms")
    d.baseline_ms, d.observed_ms = 11.7, 246.4
    d.explained_ms |= {C.HOST_MEMORY_PRESSURE: 28.9, C.SLOW_DEPENDENCY: 4.4}
    ctx = rank.Context(set(), df, df, exclude_pids=set())
    got = {c.cause: c.explained_ms for c in rank.ranked(
        d, ctx, {C.HOST_MEMORY_PRESSURE: 0.9, C.SERVER_QUEUEING: 0.08, C.SLOW_DEPENDENCY: 0.02})}
    assert got[C.HOST_MEMORY_PRESSURE] == pytest.approx(246.4 - 11.7 - 4.4)
    assert got[C.SERVER_QUEUEING] == 0.0 and got[C.SLOW_DEPENDENCY] == pytest.approx(4.4)
    got = {c.cause: c.explained_ms for c in rank.ranked(
        d, ctx, {C.SERVER_QUEUEING: 0.9, C.HOST_MEMORY_PRESSURE: 0.1})}
    assert got[C.SERVER_QUEUEING] == pytest.approx(246.4 - 11.7 - 4.4 - 28.9)
    assert got[C.HOST_MEMORY_PRESSURE] == pytest.approx(28.9)


def test_a_cause_whose_own_term_explains_nothing_does_not_lead() -> None:
    """Dependency calls that got faster, no retransmits: neither slow_dependency nor
    network_loss leads, whatever the model says; with a positive term they may."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import Decomposition

    d = Decomposition("duration_ms", 79.0, 83.0, {C.SLOW_DEPENDENCY: -0.1,
                                                  C.REQUEST_MIX_SHIFT: 23.0})
    for cause in (C.SLOW_DEPENDENCY, C.NETWORK_LOSS):
        s = rank.consistent(d, {cause: 0.56, C.REQUEST_MIX_SHIFT: 0.40})
        assert max(s, key=lambda c: s[c]) == C.REQUEST_MIX_SHIFT, s
    d.explained_ms[C.SLOW_DEPENDENCY] = 3.0
    s = rank.consistent(d, {C.SLOW_DEPENDENCY: 0.56, C.REQUEST_MIX_SHIFT: 0.40})
    assert max(s, key=lambda c: s[c]) == C.SLOW_DEPENDENCY, s


def test_a_mix_shift_with_the_same_sizes_does_not_lead() -> None:
    """CI at 727277a, the live CPU test's first fault window: the model gave
    request_mix_shift 0.51 and cpu_starvation 0.45 while chunks, request and response bytes
    stayed within 2% of the baseline's. Same sizes and no term: the CPU leads; longer
    outputs (chunks x1.5) keep the mix shift in the lead."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import Decomposition

    sig = {"chunks": (15.93, 15.64), "req_bytes": (54.56, 54.64), "resp_bytes": (406.1, 397.3)}
    d = Decomposition("ttft_ms", 9.79, 16.37, {C.CPU_STARVATION: 2.77,
                                               C.REQUEST_MIX_SHIFT: -0.2}, dict(sig))
    model = {C.REQUEST_MIX_SHIFT: 0.512, C.CPU_STARVATION: 0.449, C.NETWORK_DELAY: 0.008}
    s = rank.consistent(d, model)
    assert max(s, key=lambda c: s[c]) == C.CPU_STARVATION, s
    d.signals["chunks"] = (15.93, 23.9)
    s = rank.consistent(d, model)
    assert max(s, key=lambda c: s[c]) == C.REQUEST_MIX_SHIFT, s


def test_a_mix_shift_whose_term_explains_less_than_the_cpu_does_not_lead() -> None:
    """CI at b509484, the live CPU test's first fault window: request_mix_shift 0.21 (chunks
    +9%, request bytes +0.6%, its term at most 0.25 ms) above cpu_starvation 0.10, whose
    run-queue term explained 1.6 ms with the stress-ng culprit. Sizes that did not grow by
    10% and a term below the CPU's: the CPU leads. With the requests 1.5x longer, or a mix
    term above the CPU's, the mix shift keeps its lead."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import Decomposition

    sig = {"chunks": (15.8571, 17.2857), "req_bytes": (54.5486, 54.8571),
           "resp_bytes": (404.2743, 439.4286)}
    model = {C.REQUEST_MIX_SHIFT: 0.2124, C.CPU_STARVATION: 0.1026, C.UNKNOWN: 0.0339}

    def top(mix_ms: float, chunks: float = 17.2857) -> str:
        d = Decomposition("ttft_ms", 11.47, 20.584, {C.CPU_STARVATION: 1.606,
                                                     C.REQUEST_MIX_SHIFT: mix_ms},
                          dict(sig, chunks=(15.8571, chunks)))
        s = rank.consistent(d, model)
        return max(s, key=lambda c: s[c])

    assert top(0.25) == C.CPU_STARVATION
    assert top(0.25, chunks=15.8571 * 1.5) == C.REQUEST_MIX_SHIFT
    assert top(2.0) == C.REQUEST_MIX_SHIFT

def test_weights_read_back_from_disk_are_a_memory_stall_by_the_io_stall() -> None:
    """mem-24: a competitor squeezed 10% of the server's mmap'd weights out; its major faults
    rose from 0 to ~250/s, TTFT p95 8.7 -> 28 ms, and the memory stall did not move (pages
    reclaimed before they were seen in use again are no refaults of the working set: their
    reads are plain I/O). Arrivals were up 23% by chance and server_queueing took it all.
    The I/O stall counts for memory when the server's own faults rose, not otherwise."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import decompose
    from sits_trace.analyzers.rca.spantable import empty_frame

    V, H = 4190010, 4190040
    psi = {"memory_some": 1.0, "io_some": 5.0}

    def snap(t: int, majflt: float, io: float, hog: bool) -> ProcSnapshot:
        procs = {V: ("srv", 0.0, 60.0, majflt, 0.0, V, 0.0)}
        if hog:
            procs[H] = ("stress-ng-vm", 0.1, 515.0, 0.0, 0.0, H, 0.0)
        return ProcSnapshot(t * 10**9, procs, psi | {"io_some": io})

    def verdict(win_faults: float, io: float) -> dict[str, float]:
        df = empty_frame()
        ctx = rank.Context({V}, df, df, proc_base=delta(snap(0, 0, 5.0, False),
                                                        snap(5, 0, 5.0, False)),
                           proc_win=delta(snap(5, 0, 5.0, True), snap(10, win_faults, 5.0 + io,
                                                                      True)),
                           exclude_pids=set())
        d = decompose(df, df, "ttft_ms")  # the signals' frame; then the window's means
        d.baseline_ms, d.observed_ms = 8.0, 13.4
        rank.memory_stall(d, ctx)
        f = rank.features(d, ctx) | {"log_rate": 0.205, "log_inflight": 0.23}
        return rank.heuristic(d, f)

    h = verdict(win_faults=1250, io=5 * 0.35)  # 250 faults/s, 35% of the time in I/O
    assert max(h, key=lambda c: h[c]) == C.HOST_MEMORY_PRESSURE, h
    h = verdict(win_faults=0, io=5 * 0.35)  # someone else's I/O: not the server's memory
    assert max(h, key=lambda c: h[c]) == C.SERVER_QUEUEING, h


def test_memory_culprit_counts_from_the_baseline_and_outlives_its_exit() -> None:
    """A competitor that took its memory inside the baseline interval (the judged window is
    a later one of the fault) grew by all it holds; one that exited before the window's last
    sample is still there in its first. A process started since, a little larger, is not it."""
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.spantable import empty_frame

    V, H, P = 4190010, 4190040, 4190050
    a = ProcSnapshot(0, {V: ("srv", 0.0, 60.0, 0.0, 0.0, V, 0.0)})
    b = ProcSnapshot(10**9, {V: ("srv", 0.1, 60.0, 0.0, 0.0, V, 0.0),
                             H: ("stress-ng-vm", 0.1, 515.0, 0.0, 0.0, H, 0.0)})
    c = ProcSnapshot(2 * 10**9, {V: ("srv", 0.2, 61.0, 90.0, 0.0, V, 0.0),
                                 P: ("python", 0.2, 26.0, 0.0, 0.0, P, 0.0)})
    df = empty_frame()
    ctx = rank.Context({V}, df, df, proc_win=delta(b, c), proc_base=delta(a, b),
                       exclude_pids=set())
    assert rank._rss_culprit(ctx)[:2] == ({"pid": H, "name": "stress-ng-vm"},
                                          pytest.approx(515 / 1024))


def test_verdict_metrics_count_and_expire() -> None:
    from sits_trace.analyzers.rca.metrics import VerdictMetrics
    from sits_trace.analyzers.rca.slo import Breach
    from sits_trace.analyzers.rca.verdict import CauseScore, Verdict

    now = [100 * 10**9]
    m = VerdictMetrics(fresh_s=20, clock_ns=lambda: now[0])
    v = Verdict(now[0], "llm", None, Breach("ttft_ms_p95", 900, 500),
                [CauseScore("cpu_starvation", 0.9, {"pid": 7, "name": "hog"}, [], 12.5)])
    m.observe(v)
    m.observe(v)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in m.samples()}
    assert got[("sits_rca_verdicts_total", (("cause", "cpu_starvation"), ("service", "llm")))] == 2
    top = (("cause", "cpu_starvation"), ("route", ""), ("service", "llm"))
    assert got[("sits_rca_top_cause", top)] == 1.0
    assert got[("sits_rca_explained_ms", top)] == 12.5
    now[0] += 21 * 10**9  # older than two windows: no current top cause, the count stays
    names = {s.name for s in m.samples()}
    assert names == {"sits_rca_verdicts_total"}


def test_cpu_culprit_prefers_a_process_of_the_victims_session() -> None:
    """Autogroup scheduling: a hog in another session barely competes; one in the server's
    session does, even when it uses a little less CPU."""
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import decompose
    from sits_trace.analyzers.rca.spantable import empty_frame

    V, F, N = 4190010, 4190020, 4190030  # no such processes: affinity unknown, shared
    a = ProcSnapshot(0, {V: ("srv", 0.0, 1.0, 0.0, 0.0, V, 0.0), F: ("far", 0.0, 1.0, 0.0, 0.0, F, 0.0),
                         N: ("near", 0.0, 1.0, 0.0, 0.0, V, 0.0)})
    b = ProcSnapshot(10**9, {V: ("srv", 0.3, 1.0, 0.0, 0.0, V, 0.0),
                             F: ("far", 0.9, 1.0, 0.0, 0.0, F, 0.0),
                             N: ("near", 0.7, 1.0, 0.0, 0.0, V, 0.0)})
    df = empty_frame()
    ctx = rank.Context({V}, df, df, proc_win=delta(a, b), exclude_pids=set())
    d = decompose(df, df, "duration_ms")
    cul, ev = rank.explain("cpu_starvation", d, ctx, rank.features(d, ctx))
    assert cul == {"pid": N, "name": "near"}
    assert ev[-1].observed == pytest.approx(0.7)


def test_ttft_is_the_first_token_not_a_chat_role_event() -> None:
    from sits_trace.analyzers.rca.spantable import COLUMNS, span_row

    attrs: dict[str, object] = {"sits.time_to_first_chunk_ms": 2.0,
                                "sits.time_to_last_chunk_ms": 92.0, "sits.stream.chunks": 10}
    row = dict(zip(COLUMNS, span_row(Span("a" * 32, "b" * 16, None, "POST", "SERVER", 0,
                                          10**8, dict(attrs)), "svc")))  # type: ignore[arg-type]
    assert row["ttft_ms"] == 2.0 and row["tbt_ms"] == 10.0
    attrs["sits.gen_ai.time_to_first_token_ms"] = 41.5  # after vLLM's role-only first event
    row = dict(zip(COLUMNS, span_row(Span("a" * 32, "b" * 16, None, "POST", "SERVER", 0,
                                          10**8, dict(attrs)), "svc")))  # type: ignore[arg-type]
    assert row["ttft_ms"] == 41.5 and row["tbt_ms"] == 10.0  # time between chunks unchanged


def test_local_pids_finds_the_listener_of_a_local_address_only() -> None:
    """A dependency's processes on this node, by socket diagnostics (pyroute2): this process
    listens; a remote address, a name and garbage find nobody."""
    import socket

    from sits_trace.analyzers.rca.listeners import local_pids

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert local_pids(f"127.0.0.1:{port}") == {os.getpid()}
        assert local_pids(f"localhost:{port}") == {os.getpid()}
        assert local_pids(f"198.51.100.200:{port}") == set()  # an address not on this node
        assert local_pids(f"dep.example:{port}") == set()
        assert local_pids("no port") == set()
    assert local_pids(f"127.0.0.1:{port}") == set()  # closed: nobody


def test_schedstat_wait_is_the_second_field() -> None:
    from sits_trace.analyzers.rca.procs import parse_schedstat

    assert parse_schedstat("123456 2500000000 17\n") == 2.5
    assert parse_schedstat("junk") == 0.0


def test_unknown_cannot_lead_a_cause_that_explains_more_than_is_left() -> None:
    """The live CI verdict: a TTFT rise of 128 ms, the link's round-trip time explained 66 ms,
    62 ms were left; the model scored unknown 0.48, network_delay 0.45. unknown drops below;
    with only 10 ms explained it keeps its lead, and so it does with nothing measured."""
    from sits_trace.analyzers.rca import causes as C
    from sits_trace.analyzers.rca import rank
    from sits_trace.analyzers.rca.decompose import Decomposition

    scores = {C.UNKNOWN: 0.48, C.NETWORK_DELAY: 0.45, C.REQUEST_MIX_SHIFT: 0.13}
    d = Decomposition("ttft_ms", 9.0, 137.0, {C.NETWORK_DELAY: 66.0, C.REQUEST_MIX_SHIFT: 0.5})
    out = rank.consistent(d, scores)
    assert max(out, key=lambda c: out[c]) == C.NETWORK_DELAY
    d = Decomposition("ttft_ms", 9.0, 137.0, {C.NETWORK_DELAY: 10.0})
    out = rank.consistent(d, scores)
    assert max(out, key=lambda c: out[c]) == C.UNKNOWN
    d = Decomposition("ttft_ms", 9.0, 137.0, {})
    out = rank.consistent(d, scores)
    assert out[C.UNKNOWN] == scores[C.UNKNOWN] and max(out, key=lambda c: out[c]) == C.UNKNOWN


def test_taskstats_failure_is_one_line_and_loses_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Without taskstats (no CAP_NET_ADMIN, no netlink) the sampler says so once and keeps
    sampling /proc; the watched processes simply have no whole-process wait."""
    from sits_trace.analyzers.rca.procs import TaskWaits

    class Refused(TaskWaits):
        def _open(self) -> object:
            raise PermissionError(1, "Operation not permitted")

    sampler = ProcSampler(watch=lambda: {os.getpid()}, task_waits=Refused())
    with caplog.at_level("WARNING"):
        snaps = [sampler.snapshot() for _ in range(3)]
    lines = [r.getMessage() for r in caplog.records if "taskstats" in r.getMessage()]
    assert len(lines) == 1 and "Operation not permitted" in lines[0], lines
    assert all(os.getpid() in s.procs and not s.task_wait for s in snaps)
