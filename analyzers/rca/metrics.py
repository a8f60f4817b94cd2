"""Verdicts as metrics, read at scrape time through the agent's metric samples:

  sits_rca_verdicts_total{service,cause}         verdicts whose top cause was `cause`
  sits_rca_top_cause{service,route,cause}        1 for the top cause of the service's latest
                                                 verdict while it is fresh (2 windows), else
                                                 absent
  sits_rca_top_cause_score{service,route,cause}  that cause's score
  sits_rca_explained_ms{service,route,cause}     the milliseconds per request it explains
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sits_trace.agent.model import MetricSample

from .verdict import Verdict


class VerdictMetrics:
    def __init__(self, fresh_s: float = 20.0, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._latest: dict[tuple[str, str], Verdict] = {}
        self._fresh_ns = int(fresh_s * 1e9)
        self._clock = clock_ns
        self._lock = threading.Lock()

    def observe(self, v: Verdict) -> None:
        top = v.top()
        cause = top.cause if top is not None else "unknown"
        with self._lock:
            key = (v.service, cause)
            self._counts[key] = self._counts.get(key, 0) + 1
            self._latest[(v.service, v.route or "")] = v

    def samples(self) -> list[MetricSample]:
        now = self._clock()
        out: list[MetricSample] = []
        with self._lock:
            for (svc, cause), n in sorted(self._counts.items()):
                out.append(MetricSample("sits_rca_verdicts_total",
                                        {"service": svc, "cause": cause}, float(n)))
            for (svc, route), v in sorted(self._latest.items()):
                top = v.top()
                if top is None or now - v.time_unix_nano > self._fresh_ns:
                    continue
                labels = {"service": svc, "route": route, "cause": top.cause}
                out.append(MetricSample("sits_rca_top_cause", labels, 1.0))
                out.append(MetricSample("sits_rca_top_cause_score", labels, top.score))
                out.append(MetricSample("sits_rca_explained_ms", labels, top.explained_ms))
        return out
