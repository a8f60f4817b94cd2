"""Rank the columns of a metric table as root-cause candidates, and score rankings.

Given a window of samples before a fault (normal) and one during it (anomalous),
each method gives every metric column a score; the highest score is the most
likely root cause.

- `baro` and `nsigma` follow RCAEval (Pham et al., ASE 2024, "Root Cause Analysis
  for Microservices based on Causal Inference: How Far Are We?"): fit a scaler on
  the normal window (BARO: median and inter-quartile range, the RobustScaler;
  NSigma: mean and standard deviation), scale the anomalous window and score the
  column by its largest scaled value, signed: a column that only drops scores low.
  Data is read as RCAEval reads it: time column dropped, NaN/inf forward-filled
  then zero, columns constant inside either window dropped, `*_mem` columns divided
  by 1e6 (bytes to MB). A zero spread is replaced by 1 as scikit-learn does, so
  such a column's score is in its own units; that is why the MB reading matters.
- `sits` (ours) is a unit-free robust shift score. Centre: the normal median.
  Spread: the larger of the normal IQR/1.349 (a standard deviation for Gaussian
  data) and 1% of the normal level |median|, so a 4 KiB wobble on a 260 MB
  resident set is not an 800-sigma event and bytes or MB rank the same; falls back
  to the normal standard deviation, then to 1% of the anomalous peak, when the
  normal window is flat at zero. Score: the 90th percentile of the scaled
  anomalous window (a rise that lasts, not one glitching sample), or half the
  scaled 10th-percentile drop when that is larger: drops count, but a resource
  fault shows as a rise and a drop of the same size ranks below it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pandas as pd

from .tables import TIME_COLUMN, Case, check_same_columns, load_table

__all__ = [
    "METHODS",
    "Accuracy",
    "Ranking",
    "SitsParams",
    "candidate_columns",
    "evaluate",
    "load_table",
    "mean_accuracy",
    "rank_random",
    "rank_table",
    "service_of",
    "service_rank",
]

Ranking = list[tuple[str, float]]
FloatArray = npt.NDArray[np.float64]

METHODS = ("sits", "baro", "nsigma")


@dataclass(frozen=True)
class SitsParams:
    """Knobs of the sits score (the defaults are what the CLI and docs use)."""

    level_floor: float = 0.01  # spread >= this share of the normal |median|
    quantile: float = 0.9  # rise = this quantile of the scaled anomalous window
    drop_weight: float = 0.5  # a drop counts this much of a rise of the same size


_EPS = float(np.finfo(np.float64).eps)


def rank_table(
    normal: pd.DataFrame,
    anomalous: pd.DataFrame,
    method: str = "sits",
    *,
    mem_mb: bool = True,
    signed: bool = True,
    sits: SitsParams = SitsParams(),
) -> Ranking:
    """Score every metric column; best candidate first, ties in column order.

    For baro and nsigma only (ablations): mem_mb=False skips RCAEval's bytes-to-MB
    reading of `*_mem` columns, signed=False scores the largest |scaled value|;
    sits sets the sits method's knobs.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    n, a = prepare_windows(normal, anomalous)
    if method == "sits":
        moving = _moving_columns(n, a)
        return _sorted(moving, sits_scores(_values(n[moving]), _values(a[moving]), sits))
    n, a = _rcaeval_reading(n, a, mem_mb)
    scores = scaled_max(_values(n), _values(a), robust=method == "baro", signed=signed)
    return _sorted(n.columns, scores)


def prepare_windows(
    normal: pd.DataFrame, anomalous: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Same columns in the same order, no time column, NaN/inf forward-filled then 0."""
    check_same_columns(normal, anomalous)
    for name, df in (("normal", normal), ("anomalous", anomalous)):
        if len(df) == 0:
            raise ValueError(f"the {name} table has no rows")
    cols = [c for c in normal.columns if str(c).lower() != TIME_COLUMN]
    if not cols:
        raise ValueError("no metric columns besides 'time'")
    both = pd.concat([normal[cols], anomalous[cols]], ignore_index=True).astype(float)
    both = both.replace([np.inf, -np.inf], np.nan).ffill().fillna(0.0)
    return both.iloc[: len(normal)], both.iloc[len(normal) :]


def _moving_columns(n: pd.DataFrame, a: pd.DataFrame) -> list[str]:
    both = pd.concat([n, a])
    return [str(c) for c in both.columns if both[c].nunique() > 1]


def _values(df: pd.DataFrame) -> FloatArray:
    out: FloatArray = df.to_numpy(dtype=np.float64)
    return out


def _rcaeval_reading(
    n: pd.DataFrame, a: pd.DataFrame, mem_mb: bool
) -> tuple[pd.DataFrame, pd.DataFrame]:
    keep = [c for c in n.columns if n[c].nunique() > 1 and a[c].nunique() > 1]
    n, a = n[keep].copy(), a[keep].copy()
    if mem_mb:
        mem = [c for c in keep if str(c).endswith("_mem")]
        n[mem], a[mem] = n[mem] / 1e6, a[mem] / 1e6
    return n, a


def scaled_max(
    normal: FloatArray, anomalous: FloatArray, *, robust: bool, signed: bool = True
) -> FloatArray:
    """Per column: max of the anomalous window scaled by the normal window's fit."""
    if robust:
        centre = np.median(normal, axis=0)
        q75, q25 = np.percentile(normal, [75, 25], axis=0)
        scale = q75 - q25
    else:
        centre, scale = normal.mean(axis=0), normal.std(axis=0)
    scale = np.where(scale < 10 * _EPS, 1.0, scale)
    z = (anomalous - centre) / scale
    result: FloatArray = (z if signed else np.abs(z)).max(axis=0, initial=-np.inf)
    return result


def sits_scores(
    normal: FloatArray, anomalous: FloatArray, params: SitsParams = SitsParams()
) -> FloatArray:
    """The unit-free, direction-aware robust shift score described in the module doc.

    Columns flat over both windows carry no signal; rank_table leaves them out.
    """
    centre = np.median(normal, axis=0)
    q75, q25 = np.percentile(normal, [75, 25], axis=0)
    floor = params.level_floor
    scale = np.maximum((q75 - q25) / 1.349, floor * np.abs(centre))
    scale = np.where(scale > 0, scale, normal.std(axis=0))
    scale = np.where(scale > 0, scale, floor * np.abs(anomalous).max(axis=0))
    z = (anomalous - centre) / np.where(scale > 0, scale, 1.0)
    rise = np.quantile(z, params.quantile, axis=0)
    drop = -np.quantile(z, 1.0 - params.quantile, axis=0)
    score: FloatArray = np.maximum(rise, params.drop_weight * drop)
    return score


def candidate_columns(normal: pd.DataFrame, anomalous: pd.DataFrame) -> list[str]:
    """The metric columns that move at all over the two windows."""
    return _moving_columns(*prepare_windows(normal, anomalous))


def rank_random(columns: Sequence[str], rng: np.random.Generator) -> Ranking:
    """The columns in a random order, scored len..1 (the chance baseline)."""
    order = rng.permutation(len(columns))
    return [(str(columns[i]), float(len(columns) - pos)) for pos, i in enumerate(order)]


def _sorted(columns: Iterable[object], scores: FloatArray) -> Ranking:
    pairs = [(str(c), float(s)) for c, s in zip(columns, scores, strict=True)]
    return sorted(pairs, key=lambda p: -p[1])


def service_of(metric: str, *, fold_db: bool = False) -> str:
    """`carts-db_mem` -> `carts-db` (or `carts` with fold_db, as RCAEval's evaluation)."""
    service = metric.split("_", 1)[0]
    return service.removesuffix("-db") if fold_db else service


def service_rank(ranking: Ranking, service: str, *, fold_db: bool = False) -> int | None:
    """1-based rank of the service's best-ranked metric; None if it has none."""
    seen: list[str] = []
    for metric, _ in ranking:
        s = service_of(metric, fold_db=fold_db)
        if s not in seen:
            seen.append(s)
        if s == service:
            return len(seen)
    return None


@dataclass(frozen=True)
class Accuracy:
    """AC@1..AC@5 over a set of cases: the share whose root cause is in the top k."""

    ac: tuple[float, ...]
    cases: int

    @property
    def avg5(self) -> float:
        return sum(self.ac[:5]) / 5

    def at(self, k: int) -> float:
        return self.ac[k - 1]


def accuracy(ranks: Sequence[int | None], k_max: int = 5) -> Accuracy:
    """AC@k for k = 1..k_max from each case's rank of the true root cause."""
    if not ranks:
        raise ValueError("no cases to score")
    hits = [sum(1 for r in ranks if r is not None and r <= k) for k in range(1, k_max + 1)]
    return Accuracy(ac=tuple(h / len(ranks) for h in hits), cases=len(ranks))


def mean_accuracy(runs: Sequence[Accuracy]) -> Accuracy:
    """AC@k averaged over repeated runs on the same cases (e.g. random draws)."""
    if not runs:
        raise ValueError("no runs to average")
    ac = tuple(float(np.mean([r.ac[i] for r in runs])) for i in range(len(runs[0].ac)))
    return Accuracy(ac=ac, cases=runs[0].cases)


def evaluate(
    cases: Iterable[Case], ranker: Callable[[Case], Ranking], *, fold_db: bool = False
) -> dict[str, Accuracy]:
    """Service-level accuracy per fault type (and `all`) of ranker over the cases."""
    by_fault: dict[str, list[int | None]] = {}
    for case in cases:
        r = service_rank(ranker(case), case.service, fold_db=fold_db)
        by_fault.setdefault(case.fault, []).append(r)
    out = {fault: accuracy(ranks) for fault, ranks in sorted(by_fault.items())}
    out["all"] = accuracy([r for ranks in by_fault.values() for r in ranks])
    return out
