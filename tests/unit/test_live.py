"""The live view: per-route numbers from spans, percentiles, the slowest spans, filters."""

from __future__ import annotations

import json

from sits_trace.agent.model import Span
from sits_trace.agent.top import Filter, render_text, sort_routes, sparkline
from sits_trace.analyzers.live import OTHER_ROUTE, LiveView, node_view

NOW = 1_700_000_100 * 10**9


def span(path: str, ms: float, *, end_s: float = 99.5, status: int = 200, pid: int = 7,
         ttft: float | None = None, prob: float | None = None, trace: str = "ab" * 16) -> Span:
    end = 1_700_000_000 * 10**9 + int(end_s * 1e9)
    attrs: dict[str, str | int | float | bool] = {
        "url.path": path + "?q=1", "server.port": 8000, "process.pid": pid,
        "process.executable.name": "server", "http.response.status_code": status}
    if ttft is not None:
        attrs["sits.time_to_first_chunk_ms"] = ttft
    if prob is not None:
        attrs["sampling.probability"] = prob
    return Span(trace, "cd" * 8, None, "GET", "SERVER", end - int(ms * 1e6), end, attrs,
                "ERROR" if status >= 500 else "UNSET")


def view(**kw: object) -> LiveView:
    return LiveView(clock_ns=lambda: NOW, **kw)  # type: ignore[arg-type]


def test_rate_errors_and_percentiles_per_route() -> None:
    v = view(window_s=10)
    for i in range(100):
        v.add(span("/a", float(i + 1), end_s=95 + i * 0.04, status=500 if i < 5 else 200))
    v.add(span("/b", 3.0))
    routes = {r["route"]: r for r in v.routes()}
    a = routes["/a"]
    assert a["count"] == 100 and a["rate_per_s"] == 10.0
    assert a["error_rate"] == 0.05
    assert a["latency_p50_ms"] == 50.5 and 99 < a["latency_p99_ms"] < 100
    assert a["ttft_p50_ms"] is None
    assert [s["duration_ms"] for s in a["slowest"]] == [100.0, 99.0, 98.0, 97.0, 96.0]
    assert routes["/b"]["count"] == 1 and a["pids"] == [7]


def test_window_leaves_old_spans_out() -> None:
    v = view(window_s=10)
    v.add(span("/a", 1000.0, end_s=50))  # 50 s ago
    v.add(span("/a", 2.0, end_s=99))
    (a,) = v.routes()
    assert a["count"] == 1 and a["latency_p99_ms"] == 2.0 and a["rate_per_s"] == 0.1
    assert a["rate_history"][-2] == 1.0 and a["rate_history"][-51] == 1.0


def test_ttft_only_from_streamed_and_sampling_reweights_rate() -> None:
    v = view(window_s=10)
    v.add(span("/s", 50.0, ttft=4.0, prob=0.25))
    v.add(span("/s", 60.0))
    (s,) = v.routes()
    assert s["ttft_p50_ms"] == 4.0 and s["ttft_p99_ms"] == 4.0
    assert s["rate_per_s"] == 0.5  # 4 + 1 exchanges in 10 s


def test_routes_are_bounded() -> None:
    v = view(max_routes=3)
    for i in range(10):
        v.add(span(f"/item/{i}", 1.0))
    names = sorted(r["route"] for r in v.routes())
    assert len(names) == 4 and OTHER_ROUTE in names
    assert next(r for r in v.routes() if r["route"] == OTHER_ROUTE)["count"] == 7


def test_spans_of_one_route_meet_whatever_their_query_strings_and_the_lookup_is_bounded() -> None:
    """The view finds a span's route from its raw fields and keeps that lookup; paths that
    differ only after '?' are one route, and a flood of distinct ones neither adds routes
    nor grows the lookup past its bound."""
    v = view(max_routes=3)
    for i in range(1000):
        s = span("/a", 1.0, pid=7 + i % 2)
        s.attributes["url.path"] = f"/a?id={i}"
        v.add(s)
    v.add_many([span("/b", 2.0), span("/a", 3.0, status=503)])
    routes = {r["route"]: r for r in v.routes()}
    assert set(routes) == {"/a", "/b"}
    assert routes["/a"]["count"] == 1001 and routes["/a"]["pids"] == [7, 8]
    assert routes["/a"]["error_rate"] == 1 / 1001 and routes["/b"]["count"] == 1
    assert len(v._by_raw) <= 4 * 3


def test_snapshot_is_json_and_carries_slowest_attributes() -> None:
    v = view()
    v.add(span("/a", 5.0, trace="0af7651916cd43dd8448eb211c80319c"))
    v.verdicts.append({"cause": "cpu_contention", "route": "/a"})
    snap = json.loads(json.dumps(v.snapshot(row={("gpu_util_pct", "gpu0"): 80.0,
                                                 ("tcp_retransmits_per_s", "node"): 2.0,
                                                 ("cpu_runq_delay_s_per_s", "pid7"): 0.25,
                                                 ("cpu_runq_mean_wait_us", "pid7"): 40.0},
                                            agent_stats={"tracer": {"spans": 1}})))
    assert snap["routes"][0]["slowest"][0]["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert snap["routes"][0]["slowest"][0]["attributes"]["process.pid"] == 7
    assert snap["gpus"] == {"gpu0": {"gpu_util_pct": 80.0}}
    assert snap["node"]["tcp_retransmits_per_s"] == 2.0
    assert snap["node"]["cpu_runq_delay_s_per_s"] == 0.25
    assert snap["verdicts"] == [{"cause": "cpu_contention", "route": "/a"}]
    assert snap["actions"] == []


def test_node_view_sums_processes() -> None:
    n = node_view({("cpu_runq_delay_s_per_s", "pid1"): 0.5, ("cpu_runq_delay_s_per_s", "pid2"): 0.25,
                   ("cpu_runq_mean_wait_us", "pid1"): 10.0, ("cpu_runq_mean_wait_us", "pid2"): 30.0})
    assert n == {"cpu_runq_delay_s_per_s": 0.75, "cpu_runq_processes": 2.0,
                 "cpu_runq_worst_mean_wait_us": 30.0}


def test_filter_words() -> None:
    r = {"service": "nginx", "route": "/v1/chat", "port": 443, "pids": [10, 11]}
    assert Filter("pid:11").matches(r) and not Filter("pid:1").matches(r)
    assert Filter("port:443").matches(r) and not Filter("port:44").matches(r)
    assert Filter("route:chat service:ngi").matches(r)
    assert not Filter("route:chat service:vllm").matches(r)
    assert Filter("V1").matches(r) and Filter("").matches(r)


def test_render_text_filters_and_sorts() -> None:
    v = view()
    for _ in range(3):
        v.add(span("/fast", 1.0))
    v.add(span("/slow", 900.0, pid=8))
    snap = v.snapshot()
    text = render_text(snap)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("SERVICE"))
    assert "/fast" in lines[head + 1] and "/slow" in lines[head + 2]  # by rate
    by_p99 = render_text(snap, sort_key="latency_p99_ms").splitlines()
    assert "/slow" in by_p99[head + 1]
    only = render_text(snap, Filter("pid:8"))
    assert "/slow" in only and "/fast" not in only
    assert "no GPU signals" in text and "VERDICTS  none yet" in text


def test_sort_none_last_and_sparkline() -> None:
    rows = [{"x": None}, {"x": 2.0}, {"x": 1.0}]
    assert [r["x"] for r in sort_routes(rows, "x", True)] == [2.0, 1.0, None]
    assert sparkline([0, 1, 2, 4]) == " ▂▄█"
    assert len(sparkline([1.0] * 60, 20)) == 20
