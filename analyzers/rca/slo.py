"""Service level objectives and degradation detection over one window of spans.

An objective is written `<metric>_p<NN> = target` (metric: duration_ms, ttft_ms, tbt_ms; NN the
percentile) or `error_rate = fraction`, per service and optionally per route (config [[slo]]).
Without objectives, a window is degraded when its p95 duration (or TTFT, time between chunks)
rises well above the service's own recent windows, when the bulk of its requests does (mean and
median: a fault that adds the same few ms to every request hides in a noisy tail), or when its
error rate jumps.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

METRICS = ("duration_ms", "ttft_ms", "tbt_ms")
COLUMN = {"duration_ms": "dur_ms", "ttft_ms": "ttft_ms", "tbt_ms": "tbt_ms"}
_KEY = re.compile(r"^(duration_ms|ttft_ms|tbt_ms)_p(\d{1,2}(?:\.\d+)?)$")


@dataclass(frozen=True, slots=True)
class Objective:
    name: str  # "ttft_ms_p95", "error_rate"
    metric: str  # a METRICS entry or "error_rate"
    percentile: float  # 0 for error_rate
    target: float


@dataclass(frozen=True, slots=True)
class Slo:
    service: str
    route: str | None
    objectives: tuple[Objective, ...]

    def applies(self, service: str, route: str | None) -> bool:
        return self.service == service and (self.route is None or self.route == route)


@dataclass(frozen=True, slots=True)
class Breach:
    objective: str
    observed: float
    target: float
    baseline: float | None = None  # degradation: the baseline the target came from

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"objective": self.objective, "observed": round(self.observed, 3),
                               "target": round(self.target, 3)}
        if self.baseline is not None:
            out["baseline"] = round(self.baseline, 3)
        return out


def parse_objective(key: str, value: float) -> Objective | None:
    """`ttft_ms_p95` -> Objective; None when the key is not an objective."""
    if key == "error_rate":
        return Objective(key, key, 0.0, float(value))
    m = _KEY.match(key)
    if m is None:
        return None
    pct = float(m.group(2))
    if not 0 < pct < 100:
        return None
    return Objective(key, m.group(1), pct, float(value))


def parse_slos(entries: Sequence[Mapping[str, Any]]) -> list[Slo]:
    """[[slo]] tables (already validated by the config) as Slo objects."""
    out: list[Slo] = []
    for e in entries:
        objs = [o for k, v in e.items() if k not in ("service", "route")
                for o in [parse_objective(k, float(v))] if o is not None]
        out.append(Slo(str(e["service"]), e.get("route") or None, tuple(objs)))
    return out


def observe(df: pd.DataFrame, metric: str, percentile: float) -> float:
    """The window's value of one objective's metric (NaN when no span carries it)."""
    if metric == "error_rate":
        w = df["weight"].to_numpy()
        return float(np.sum(df["error"].to_numpy() * w) / np.sum(w)) if len(df) else np.nan
    v = df[COLUMN[metric]].to_numpy()
    v = v[~np.isnan(v)]
    return float(np.percentile(v, percentile)) if len(v) else np.nan


def slo_breaches(df: pd.DataFrame, slo: Slo) -> list[Breach]:
    out: list[Breach] = []
    for o in slo.objectives:
        x = observe(df, o.metric, o.percentile)
        if not math.isnan(x) and x > o.target:
            out.append(Breach(o.name, x, o.target))
    return out


@dataclass(frozen=True, slots=True)
class DegradationRule:
    ratio: float = 1.5  # p95 at least this many times the baseline's
    min_increase_ms: float = 2.0  # and at least this much higher
    mad_k: float = 4.0  # and above the baseline windows' median + k * MAD
    error_increase: float = 0.05  # error rate up by this fraction (and >= 3 errors)


def _mean(df: pd.DataFrame, metric: str) -> float:
    v = df[COLUMN[metric]].to_numpy(dtype=float)
    v = v[~np.isnan(v)]
    return float(np.mean(v)) if len(v) else math.nan


def window_stats(df: pd.DataFrame) -> dict[str, float]:
    """The numbers a window contributes to its service's baseline."""
    out = {f"{m}_p95": observe(df, m, 95) for m in METRICS}
    out.update({f"{m}_p50": observe(df, m, 50) for m in METRICS})
    out.update({f"{m}_mean": _mean(df, m) for m in METRICS})
    out["error_rate"] = observe(df, "error_rate", 0)
    return out


def degradation(df: pd.DataFrame, history: Sequence[Mapping[str, float]],
                rule: DegradationRule) -> list[Breach]:
    """Breaches of the window against the median of the earlier windows' stats: a p95 above
    the rule's target whose mean also rose by half the ratio (the bulk moved, not one
    request); a mean above the rule's target (against the earlier means) whose median also
    rose by half the ratio (a shift of every request, which a noisy p95 can hide: a slower
    dependency doubled the mean TTFT while its p95 rose 1.4x); or an error-rate jump."""
    now = window_stats(df)
    out: list[Breach] = []
    for key, x in now.items():
        if key.endswith("_p50"):
            continue
        past = np.array([h[key] for h in history if not math.isnan(h.get(key, math.nan))])
        if math.isnan(x) or len(past) < 3:
            continue
        base = float(np.median(past))
        mad = float(np.median(np.abs(past - base)))
        if key == "error_rate":
            errors = float(np.sum(df["error"].to_numpy()))
            target = base + rule.error_increase
            if x > target and errors >= 3:
                out.append(Breach("degradation:" + key, x, target, base))
            continue
        target = max(base * rule.ratio, base + rule.min_increase_ms, base + rule.mad_k * mad)
        if x > target and _bulk_moved(key, now, history, rule):
            out.append(Breach("degradation:" + key, x, target, base))
    if len(out) > 1:  # a tail breach says more than the bulk's of the same metric
        tails = {b.objective.removesuffix("_p95") for b in out if b.objective.endswith("_p95")}
        out = [b for b in out if b.objective.removesuffix("_mean") not in tails]
    return out


def _bulk_moved(key: str, now: Mapping[str, float], history: Sequence[Mapping[str, float]],
                rule: DegradationRule) -> bool:
    """p95: its mean rose by half the ratio; mean: its median did."""
    mkey = key.replace("_p95", "_mean") if key.endswith("_p95") else key.replace("_mean", "_p50")
    past = [h[mkey] for h in history if not math.isnan(h.get(mkey, math.nan))]
    if not past or math.isnan(now.get(mkey, math.nan)):
        return True
    return now[mkey] > float(np.median(past)) * (1 + (rule.ratio - 1) / 2)
