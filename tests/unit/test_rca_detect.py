"""Degradation detection without objectives (analyzers/rca/slo.py): the tail, the bulk, errors."""

from __future__ import annotations

import numpy as np
import pandas as pd
from sits_trace.analyzers.rca.slo import DegradationRule, degradation, window_stats

RULE = DegradationRule()


def _window(rng: np.random.Generator, shift_ms: float = 0.0, n: int = 20,
            outlier_ms: float = 0.0) -> pd.DataFrame:
    """TTFT: ~15 ms for most requests and a heavy, noisy tail (a request in ten waits for a
    batch slot, 30-60 ms); `shift_ms` added to every request, `outlier_ms` to one."""
    ttft = rng.uniform(10, 20, n) + np.where(rng.random(n) < 0.1, rng.uniform(20, 45, n), 0)
    ttft = ttft + shift_ms
    ttft[0] += outlier_ms
    return pd.DataFrame({"dur_ms": ttft + 100.0, "ttft_ms": ttft, "tbt_ms": np.full(n, 5.0),
                         "error": np.zeros(n), "weight": np.ones(n)})


def _history(rng: np.random.Generator) -> list[dict[str, float]]:
    return [window_stats(_window(rng)) for _ in range(12)]


def test_every_request_slower_is_a_breach_of_the_mean_when_the_tail_hides_it() -> None:
    """A slower dependency adds ~18 ms to every request: the mean doubles, the noisy p95
    stays inside its own spread in most windows (the p95 rule alone missed such faults on
    held-out runs); every window is caught by one rule or the other."""
    by: dict[str, int] = {}
    for seed in range(20):
        rng = np.random.default_rng(seed)
        hist = _history(rng)
        found = degradation(_window(rng, shift_ms=18.0), hist, RULE)
        assert found, seed
        for b in found:
            by[b.objective] = by.get(b.objective, 0) + 1
            if b.objective.endswith("_mean"):
                assert b.observed > 1.5 * (b.baseline or 0.0)
    assert by.get("degradation:ttft_ms_mean", 0) >= 15, by


def test_one_slow_request_is_not_the_bulk() -> None:
    """One request 600 ms slower doubles a 20-request window's mean; its median did not move:
    no mean breach (a p95 breach needs the mean to move as well, and it did: but one request
    of 20 is the 95th percentile's neighbour, not above it)."""
    rng = np.random.default_rng(4)
    hist = _history(rng)
    found = degradation(_window(rng, outlier_ms=600.0), hist, RULE)
    assert not [b for b in found if b.objective.endswith("_mean")]


def test_normal_windows_raise_nothing() -> None:
    rng = np.random.default_rng(5)
    hist = _history(rng)
    assert sum(bool(degradation(_window(rng), hist, RULE)) for _ in range(200)) <= 2


def test_a_tail_breach_is_named_before_the_bulk_of_the_same_metric() -> None:
    rng = np.random.default_rng(6)
    hist = _history(rng)
    found = degradation(_window(rng, shift_ms=120.0), hist, RULE)
    names = {b.objective for b in found}
    assert "degradation:ttft_ms_p95" in names and "degradation:ttft_ms_mean" not in names
