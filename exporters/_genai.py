"""Time to first token and time per output token of model-serving spans, as histograms per
service, model and operation (OTel GenAI semconv: gen_ai.server.time_to_first_token and
gen_ai.server.time_per_output_token; here from the span attributes agent/tracing/genai.py sets).
"""

from __future__ import annotations

import bisect
import threading

from sits_trace.agent.model import Span

from ._red import HistogramData, LabelLimiter, span_weight

# OTel GenAI semconv advisory buckets (seconds)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LABELS = ("service_name", "gen_ai_request_model", "gen_ai_operation_name")
# metric -> (span attribute in ms, buckets)
METRICS = {
    "gen_ai.server.time_to_first_token": ("sits.gen_ai.time_to_first_token_ms", TTFT_BUCKETS_S),
    "gen_ai.server.time_per_output_token": ("sits.gen_ai.time_per_output_token_ms",
                                            TPOT_BUCKETS_S),
}


class GenAiAggregator:
    """Thread-safe; SERVER spans only (the node serving the model is the one we stand on)."""

    def __init__(self, max_label_sets: int = 1000) -> None:
        self._lock = threading.Lock()
        self._limit = LabelLimiter(max_label_sets)
        self._data: dict[str, dict[tuple[str, str, str], HistogramData]] = {m: {} for m in METRICS}

    def observe(self, span: Span, service: str) -> None:
        a = span.attributes
        op = a.get("gen_ai.operation.name")
        if span.kind != "SERVER" or not isinstance(op, str):
            return
        model = str(a.get("gen_ai.request.model", "") or a.get("gen_ai.response.model", ""))
        w = span_weight(span)
        with self._lock:
            key4 = self._limit.admit((service, model, op, ""))
            key = (key4[0], key4[1] if key4[2] != "_other" else "_other", op)
            for metric, (attr, buckets) in METRICS.items():
                v = a.get(attr)
                if not isinstance(v, (int, float)):
                    continue
                seconds = float(v) / 1000
                h = self._data[metric].get(key)
                if h is None:
                    n = len(buckets) + 1
                    h = self._data[metric][key] = HistogramData([0] * n, exemplars=[None] * n)
                h.buckets[bisect.bisect_left(buckets, seconds)] += w
                h.sum += seconds * w
                h.count += w

    def snapshot(self, metric: str) -> dict[tuple[str, str, str], HistogramData]:
        with self._lock:
            return {k: HistogramData(list(v.buckets), v.sum, v.count, list(v.exemplars))
                    for k, v in self._data[metric].items()}
