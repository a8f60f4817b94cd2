"""The live view: per-route RED numbers of the last seconds, for `sits-trace top` and the API.

`LiveView.add(span)` is a span sink (cheap: a few appends under a lock); `snapshot()` does the
arithmetic (numpy percentiles) when someone asks. Per route it keeps a bounded ring of recent
samples (for percentiles and the slowest spans, with every attribute) and per-second request and
error counts (rate, error rate, the sparkline). Routes are keyed by service, route, kind and server
port; past `max_routes` a service's new routes share the route "_other".

`verdicts` and `actions` are the hook of the later stages: the RCA appends what it concluded and
the controller what it did (plain dicts); the snapshot shows the newest of each.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from sits_trace.agent.model import Row, Span
from sits_trace.agent.sinks import BatchSink, tee

SpanSink = Callable[[Span], None]
OTHER_ROUTE = "_other"


class RouteKey(NamedTuple):
    service: str
    route: str
    kind: str  # SERVER | CLIENT
    port: int  # server.port (the service's own port for SERVER spans, the peer's for CLIENT)


class _Sample(NamedTuple):
    end_ns: int  # Unix ns
    duration_ms: float
    error: bool
    ttft_ms: float  # nan when the response was not streamed
    span: Span


@dataclass(slots=True)
class _Route:
    spans: collections.deque[Span]  # the newest, for percentiles and the slowest
    # per-second (second, weighted requests, weighted errors), newest last
    seconds: collections.deque[list[float]]
    pids: set[int] = field(default_factory=set)


def route_key(span: Span, service_name: str = "") -> RouteKey:
    a = span.attributes
    route = a.get("http.route") or str(a.get("url.path", "")).split("?", 1)[0] or "/"
    service = service_name or str(a.get("process.executable.name", "")) or "unknown"
    return RouteKey(service, str(route), span.kind, int(a.get("server.port", 0) or 0))


def _raw_key(span: Span) -> tuple[object, ...]:
    """What route_key is computed from, as the span has it (no string made)."""
    get = span.attributes.get
    return (get("http.route"), get("url.path"), get("process.executable.name"),
            span.kind, get("server.port"))


def is_error(span: Span) -> bool:
    return bool(span.status_code == "ERROR")


def _weight(span: Span) -> float:
    """How many exchanges this span stands for (the kernel sheds load by sampling)."""
    p = span.attributes.get("sampling.probability")
    return 1.0 / float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0 else 1.0


def _sample(span: Span) -> _Sample:
    ttft = span.attributes.get("sits.gen_ai.time_to_first_token_ms",
                               span.attributes.get("sits.time_to_first_chunk_ms"))
    return _Sample(span.end_time_unix_nano,
                   (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6, is_error(span),
                   float(ttft) if isinstance(ttft, (int, float)) else math.nan, span)


class LiveView:
    def __init__(self, *, window_s: float = 30.0, slowest: int = 5, ring: int = 2048,
                 history_s: int = 60, max_routes: int = 500, service_name: str = "",
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.window_s = window_s
        self.slowest = slowest
        self.ring = ring
        self.history_s = history_s
        self.max_routes = max_routes
        self.service_name = service_name
        self._clock = clock_ns
        self._routes: dict[RouteKey, _Route] = {}
        # a span's raw route fields -> its route: route_key's strings made once per distinct
        # fields, not per span; bounded (paths with query strings can be all different)
        self._by_raw: dict[tuple[object, ...], _Route] = {}
        self._lock = threading.Lock()
        self.spans_seen = 0
        self.verdicts: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.actions: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)

    # ---- the sink side: per span a route lookup, an append and a counter; the numbers
    # (durations, percentiles) are worked out when someone reads ----

    def add(self, span: Span) -> None:
        with self._lock:
            self._add(span)

    def add_many(self, spans: list[Span]) -> None:
        """`add` for a tracer's batch of spans, under one lock."""
        with self._lock:
            for span in spans:
                self._add(span)

    def _add(self, span: Span) -> None:
        """One span into its route; the caller holds the lock."""
        self.spans_seen += 1
        raw = _raw_key(span)
        r = self._by_raw.get(raw)
        if r is None:
            r = self._route(route_key(span, self.service_name))
            if len(self._by_raw) >= 4 * self.max_routes:
                self._by_raw.clear()
            self._by_raw[raw] = r
        r.spans.append(span)
        sec = span.end_time_unix_nano // 1_000_000_000
        w = 1.0 if "sampling.probability" not in span.attributes else _weight(span)
        err = w if span.status_code == "ERROR" else 0.0
        seconds = r.seconds
        if seconds and seconds[-1][0] == sec:
            last = seconds[-1]
            last[1] += w
            last[2] += err
        elif not seconds or seconds[-1][0] < sec:
            seconds.append([float(sec), w, err])
        pid = span.attributes.get("process.pid")
        if type(pid) is int:
            r.pids.add(pid)

    def _route(self, key: RouteKey) -> _Route:
        r = self._routes.get(key)
        if r is None:
            if len(self._routes) >= self.max_routes:
                key = key._replace(route=OTHER_ROUTE)
                r = self._routes.get(key)
            if r is None:
                r = _Route(collections.deque(maxlen=self.ring),
                           collections.deque(maxlen=self.history_s))
                self._routes[key] = r
        return r

    def tee(self, sink: SpanSink) -> BatchSink:
        """A sink that feeds this view, then `sink` (a span, or a tracer's batch of them)."""
        return tee(self.add, self.add_many, sink)

    # ---- the reader side ----

    def routes(self, now_ns: int | None = None, slowest: bool = True) -> list[dict[str, Any]]:
        """Each route's numbers; `slowest=False` leaves the slowest spans out (a cheaper
        answer for a view that refreshes every second)."""
        now = self._clock() if now_ns is None else now_ns
        with self._lock:
            copies = [(k, list(r.spans), [list(s) for s in r.seconds], sorted(r.pids))
                      for k, r in self._routes.items()]
        return [self._route_view(k, [_sample(sp) for sp in spans], secs, pids, now, slowest)
                for k, spans, secs, pids in copies]

    def _route_view(self, key: RouteKey, samples: list[_Sample], seconds: list[list[float]],
                    pids: list[int], now: int, slowest: bool) -> dict[str, Any]:
        since = now - int(self.window_s * 1e9)
        recent = [s for s in samples if s.end_ns >= since]
        now_s = now // 1_000_000_000
        in_window = [s for s in seconds if s[0] > now_s - self.window_s]
        reqs = sum(s[1] for s in in_window)
        errs = sum(s[2] for s in in_window)
        history = {int(s[0]): s[1] for s in seconds}
        out: dict[str, Any] = {
            "service": key.service, "route": key.route, "kind": key.kind, "port": key.port,
            "pids": pids, "count": len(recent), "rate_per_s": reqs / self.window_s,
            "error_rate": errs / reqs if reqs else 0.0,
            "rate_history": [history.get(int(now_s) - self.history_s + 1 + i, 0.0)
                             for i in range(self.history_s)],
        }
        out.update(_percentiles("latency", [s.duration_ms for s in recent]))
        out.update(_percentiles("ttft", [s.ttft_ms for s in recent if not math.isnan(s.ttft_ms)]))
        n = self.slowest if slowest else 0
        slow = sorted(recent, key=lambda s: s.duration_ms, reverse=True)[:n] if n else []
        out["slowest"] = [s.span.to_json() | {"duration_ms": s.duration_ms} for s in slow]
        return out

    def snapshot(self, *, row: Row | None = None, agent_stats: Mapping[str, Any] | None = None,
                 now_ns: int | None = None, slowest: bool = True) -> dict[str, Any]:
        """Everything `sits-trace top` shows, as plain JSON-able data."""
        now = self._clock() if now_ns is None else now_ns
        routes = self.routes(now, slowest)
        routes.sort(key=lambda r: (-r["rate_per_s"], r["service"], r["route"]))
        return {
            "time_unix": now / 1e9, "window_s": self.window_s, "spans_seen": self.spans_seen,
            "routes": routes, "gpus": gpu_strip(row or {}), "node": node_view(row or {}),
            "agent": dict(agent_stats or {}), "verdicts": list(self.verdicts)[-20:],
            "actions": list(self.actions)[-20:],
        }


def _percentiles(prefix: str, values: Iterable[float]) -> dict[str, float | None]:
    arr = np.fromiter(values, dtype=float)
    if not arr.size:
        return {f"{prefix}_p50_ms": None, f"{prefix}_p95_ms": None, f"{prefix}_p99_ms": None}
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {f"{prefix}_p50_ms": float(p50), f"{prefix}_p95_ms": float(p95),
            f"{prefix}_p99_ms": float(p99)}


def gpu_strip(row: Row) -> dict[str, dict[str, float]]:
    """Per GPU entity ("gpu0", ...): its signals of the newest feature-frame row."""
    out: dict[str, dict[str, float]] = {}
    for (sig, ent), v in row.items():
        if ent.startswith("gpu"):
            out.setdefault(ent, {})[sig] = v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0][3:] or 0)))


def node_view(row: Row) -> dict[str, float]:
    """The node's own numbers: TCP rates, run-queue delay summed over the traced processes
    (seconds waited per second) and the worst process's mean wait, CUDA node totals."""
    out: dict[str, float] = {}
    runq, worst, procs = 0.0, 0.0, 0
    for (sig, ent), v in row.items():
        if ent == "node":
            out[sig] = v
        elif sig == "cpu_runq_delay_s_per_s":
            runq += v
            procs += 1
        elif sig == "cpu_runq_mean_wait_us":
            worst = max(worst, v)
    if procs:
        out["cpu_runq_delay_s_per_s"] = runq
        out["cpu_runq_worst_mean_wait_us"] = worst
        out["cpu_runq_processes"] = float(procs)
    return dict(sorted(out.items()))
