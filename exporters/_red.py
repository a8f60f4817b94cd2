"""RED metrics of HTTP spans: duration histograms per service/method/route/status.

Shared by the Prometheus exporter (aggregated here, read at scrape time) and the
OTLP exporter (label sets only). Cardinality is bounded: routes come from
``http.route`` or, failing that, a template of ``url.path`` (ids become ``{id}``);
past ``max_label_sets`` distinct sets per metric a new set's route is ``_other``.
"""

from __future__ import annotations

import bisect
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sits_trace.agent.model import Span

log = logging.getLogger(__name__)

# OTel semconv advisory buckets for http.*.request.duration, plus 30 s and 60 s for LLM calls
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0, 30.0, 60.0)
LABELS = ("service_name", "http_request_method", "http_route", "http_response_status_code")
OTHER_ROUTE = "_other"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS",
                           "TRACE", "PATCH"})
METRIC_OF_KIND = {"SERVER": "http.server.request.duration",
                  "CLIENT": "http.client.request.duration"}

_ID_SEGMENT = re.compile(
    r"^(?:\d+|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
    r"|(?=[^/]*\d)[0-9a-fA-F]{12,}|(?=[^/]*\d)[A-Za-z0-9_\-.=~]{24,})$")
_MAX_SEGMENTS = 8

LabelSet = tuple[str, str, str, str]


def path_template(path: str) -> str:
    """A low-cardinality form of a URL path: /users/42/orders/9f1c... -> /users/{id}/orders/{id}."""
    path = path.split("?", 1)[0].split("#", 1)[0] or "/"
    segs = path.split("/")
    out = ["{id}" if _ID_SEGMENT.match(s) else s for s in segs[:_MAX_SEGMENTS + 1]]
    if len(segs) > _MAX_SEGMENTS + 1:
        out.append("{rest}")
    return "/".join(out)


def span_weight(span: Span) -> int:
    """How many requests the span stands for: 2**n when the kernel shed load and captured
    one exchange in 2**n (agent/capture/shedding.py), so RED rates stay true; 1 otherwise."""
    p = span.attributes.get("sampling.probability")
    if isinstance(p, float) and 0 < p < 1:
        return max(1, round(1 / p))
    return 1


def span_labels(span: Span, service: str) -> LabelSet:
    a = span.attributes
    method = str(a.get("http.request.method", "")).upper()
    route = a.get("http.route")
    if not isinstance(route, str) or not route:
        route = path_template(str(a.get("url.path", "") or "/"))
    status = a.get("http.response.status_code")
    return (service, method if method in KNOWN_METHODS else "_OTHER", route,
            "" if status is None else str(status))


class LabelLimiter:
    """Admits at most `limit` distinct label sets; later new ones get route `_other`."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[LabelSet] = set()
        self.overflowed = 0  # spans whose route was folded into _other

    def admit(self, labels: LabelSet) -> LabelSet:
        if labels in self._seen:
            return labels
        if len(self._seen) < self._limit:
            self._seen.add(labels)
            return labels
        self.overflowed += 1
        return (labels[0], labels[1], OTHER_ROUTE, labels[3])


# the last span seen in a bucket: (trace_id, seconds, end time in Unix seconds)
Exemplar = tuple[str, float, float]


@dataclass(slots=True)
class HistogramData:
    buckets: list[int]  # count per bucket, the last one is +Inf (not cumulative)
    sum: float = 0.0
    count: int = 0
    exemplars: list[Exemplar | None] = field(default_factory=list)  # per bucket: links to traces
    min: float = math.inf  # seconds, of the spans observed (OTLP's min and max)
    max: float = -math.inf


class RedAggregator:
    """Thread-safe duration histograms of server and client spans, keyed by label set.

    Shared by Prometheus /metrics and OTLP (exporters/otlp.py exports its snapshots): a span
    costs a label lookup, a bucket and a few additions; a span's labels are worked out
    (route templates: a regex per path segment) once per distinct raw fields, not per span."""

    def __init__(self, max_label_sets: int = 1000,
                 buckets: tuple[float, ...] = DURATION_BUCKETS_S) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._limiters = {m: LabelLimiter(max_label_sets) for m in METRIC_OF_KIND.values()}
        self._data: dict[str, dict[LabelSet, HistogramData]] = {m: {} for m in METRIC_OF_KIND.values()}
        # (kind, service, method, route, path, status) as the span has them -> the histogram
        # they land in, and the limiter to count a span against when its labels were folded
        # into _other (None when admitted): span_labels, the limiter and the label set's
        # lookup once per distinct raw fields, not per span; bounded (paths can all differ).
        # Exact: a limiter's admitted sets only grow, so its answer for a set never changes.
        self._slots: dict[tuple[object, ...], tuple[HistogramData, LabelLimiter | None]] = {}
        self._max_cached = 4 * max_label_sets
        self.skipped = 0  # spans that could not be observed (odd attributes)

    def observe(self, span: Span, service: str) -> None:
        self.observe_many((span,), lambda _s: service)

    def observe_many(self, spans: Iterable[Span], service_of: Callable[[Span], str]) -> None:
        """Spans (a batch), each under its service's name, under one lock."""
        buckets = self.buckets
        with self._lock:
            for span in spans:
                try:
                    self._observe(span, service_of, buckets)
                except Exception:  # an odd span is skipped and counted, the rest go on
                    self.skipped += 1
                    log.debug("RED: span skipped", exc_info=True)

    def _observe(self, span: Span, service_of: Callable[[Span], str],
                 buckets: tuple[float, ...]) -> None:
        get = span.attributes.get
        service = service_of(span)
        raw = (span.kind, service, get("http.request.method"), get("http.route"),
               get("url.path"), get("http.response.status_code"))
        slot = self._slots.get(raw)
        if slot is None:
            metric = METRIC_OF_KIND.get(span.kind)
            if metric is None:
                return
            # the limiter's admit() counts this span if it folds its labels
            h = self._slot(raw, span, service, metric, len(buckets) + 1)[0]
        else:
            h, folded = slot
            if folded is not None:
                folded.overflowed += 1  # as admit() does for each span it folds
        seconds = max(span.end_time_unix_nano - span.start_time_unix_nano, 0) / 1e9
        i = bisect.bisect_left(buckets, seconds)
        w = span_weight(span) if "sampling.probability" in span.attributes else 1
        h.buckets[i] += w
        h.exemplars[i] = (span.trace_id, seconds, span.end_time_unix_nano / 1e9)
        h.sum += seconds * w
        h.count += w
        if seconds < h.min:
            h.min = seconds
        if seconds > h.max:
            h.max = seconds

    def _slot(self, raw: tuple[object, ...], span: Span, service: str, metric: str,
              n: int) -> tuple[HistogramData, LabelLimiter | None]:
        limiter = self._limiters[metric]
        labels = span_labels(span, service)
        admitted = limiter.admit(labels)
        data = self._data[metric]
        h = data.get(admitted)
        if h is None:
            h = data[admitted] = HistogramData([0] * n, exemplars=[None] * n)
        slot = (h, limiter if admitted is not labels else None)
        if len(self._slots) >= self._max_cached:
            self._slots.clear()
        self._slots[raw] = slot
        return slot

    def snapshot(self, metric: str) -> dict[LabelSet, HistogramData]:
        with self._lock:
            return {k: HistogramData(list(v.buckets), v.sum, v.count, list(v.exemplars),
                                     v.min, v.max)
                    for k, v in self._data[metric].items()}

    def overflowed(self, metric: str) -> int:
        with self._lock:
            return self._limiters[metric].overflowed
