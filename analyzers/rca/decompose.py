"""Per-request latency decomposition: how many milliseconds of the increase each cause explains.

Every request span carries its own signals (run-queue wait, retransmits and RTT of its
connection, CUDA sync and copy time); the window's mean of each component minus the baseline's
mean is what that cause explains of the mean latency increase. Causes without a per-span
signal are estimated from the window as a whole: the outgoing calls the service made
(CLIENT spans of the same processes: slow_dependency), a size model fitted on the baseline
(request_mix_shift), the node's memory stall time (host_memory_pressure), and what is left
when the arrival rate rose (server_queueing). Everything is column arithmetic on the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import causes as C
from .slo import COLUMN

if TYPE_CHECKING:
    import pandas as pd

TCP_RTO_MIN_MS = 200.0  # include/net/tcp.h TCP_RTO_MIN: the least a timed-out segment costs


@dataclass(slots=True)
class Decomposition:
    metric: str  # duration_ms | ttft_ms | tbt_ms
    baseline_ms: float  # mean of the metric, baseline
    observed_ms: float  # mean of the metric, window
    explained_ms: dict[str, float] = field(default_factory=dict)  # cause -> ms per request
    signals: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (base, obs)

    @property
    def excess_ms(self) -> float:
        return self.observed_ms - self.baseline_ms


def _col(df: pd.DataFrame, name: str) -> np.ndarray:
    out: np.ndarray = np.nan_to_num(df[name].to_numpy(dtype=float), nan=0.0)
    return out


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if len(x) else 0.0


def _per_unit(df: pd.DataFrame, metric: str) -> np.ndarray:
    """Components are in ms per request; time between chunks divides them over the gaps."""
    if metric != "tbt_ms":
        return np.ones(len(df))
    return 1.0 / np.maximum(_col(df, "chunks") - 1.0, 1.0)


def components(df: pd.DataFrame, metric: str) -> dict[str, np.ndarray]:
    """Per-span ms of each span-level cause."""
    dur = _col(df, "dur_ms")
    scale = _per_unit(df, metric)
    srtt = _col(df, "srtt_ms")
    loss = np.minimum(_col(df, "retrans") * (TCP_RTO_MIN_MS + srtt), dur)
    delay = srtt * _col(df, "client")  # a CLIENT exchange waits at least one round trip
    return {
        C.CPU_STARVATION: _col(df, "runq_ms") * scale,
        C.NETWORK_LOSS: loss * scale,
        C.NETWORK_DELAY: delay * scale,
        C.PCIE_CONTENTION: _col(df, "cuda_copy_ms") * scale,
        C.GPU_COMPUTE_CONTENTION: _col(df, "cuda_sync_ms") * scale,
    }


def dependency_ms(req: pd.DataFrame, deps: pd.DataFrame, calls_per_request: float) -> float:
    """Time in outgoing calls per request: the mean duration of the CLIENT spans of the
    serving processes, less the caller's own run-queue wait inside each (a starved caller
    reads the answer late; that wait is in the SERVER span's runq_ms, cpu_starvation's term,
    and counted once), times the calls a request makes (counted over baseline and window
    together: a window's own ratio is noisy at its edges)."""
    if not len(req) or not len(deps):
        return 0.0
    callee = np.maximum(_col(deps, "dur_ms") - _col(deps, "runq_ms"), 0.0)
    return float(np.mean(callee)) * calls_per_request


def size_model(base: pd.DataFrame, metric: str) -> np.ndarray | None:
    """Least squares metric ~ 1 + chunks + request kB + response kB on the baseline;
    None when the baseline is too small or its sizes do not vary."""
    y = base[COLUMN[metric]].to_numpy(dtype=float)
    x = _size_matrix(base)
    ok = ~np.isnan(y)
    if ok.sum() < 10 or float(np.ptp(x[ok][:, 1:], axis=0).max(initial=0.0)) <= 0:
        return None
    beta: np.ndarray = np.linalg.lstsq(x[ok], y[ok], rcond=None)[0]
    beta[1:] = np.maximum(beta[1:], 0.0)  # bigger never makes a request faster
    return beta


def _size_matrix(df: pd.DataFrame) -> np.ndarray:
    return np.column_stack([np.ones(len(df)), _col(df, "chunks"), _col(df, "req_bytes") / 1e3,
                            _col(df, "resp_bytes") / 1e3])


MIX_MIN_SHIFT = 0.1  # |log ratio| of mean chunks or request size below this: no mix shift


def mix_shifted(win: pd.DataFrame, base: pd.DataFrame) -> bool:
    """Whether the requests' sizes moved at all (the size model's noise is not a shift)."""
    for c in ("chunks", "req_bytes", "resp_bytes"):
        w, b = float(np.mean(_col(win, c))), float(np.mean(_col(base, c)))
        if w > 0 and b > 0 and abs(np.log(w / b)) > MIX_MIN_SHIFT:
            return True
    return False


def mix_shift_ms(win: pd.DataFrame, base: pd.DataFrame, metric: str) -> float:
    beta = size_model(base, metric)
    if beta is None or not len(win) or not mix_shifted(win, base):
        return 0.0
    return float(np.mean(_size_matrix(win) @ beta) - np.mean(_size_matrix(base) @ beta))


def concurrency(df: pd.DataFrame) -> float:
    """Mean requests in flight when each request started (sorted starts/ends, searchsorted)."""
    if not len(df):
        return 0.0
    s = np.sort(df["start_ns"].to_numpy())
    e = np.sort(df["end_ns"].to_numpy())
    return float(np.mean(np.searchsorted(s, s, side="right") - np.searchsorted(e, s, side="right")))


def decompose(win: pd.DataFrame, base: pd.DataFrame, metric: str, *,
              deps_win: pd.DataFrame | None = None, deps_base: pd.DataFrame | None = None,
              win_s: float = 10.0, base_s: float = 10.0,
              psi_mem: tuple[float, float] = (0.0, 0.0),
              arrivals: tuple[float, float] | None = None) -> Decomposition:
    col = COLUMN[metric]
    yw, yb = win[col].to_numpy(dtype=float), base[col].to_numpy(dtype=float)
    d = Decomposition(metric, float(np.nanmean(yb)) if np.any(~np.isnan(yb)) else 0.0,
                      float(np.nanmean(yw)) if np.any(~np.isnan(yw)) else 0.0)
    cw, cb = components(win, metric), components(base, metric)
    for cause, v in cw.items():
        d.explained_ms[cause] = _mean(v) - _mean(cb[cause])
    empty = win.iloc[:0]
    dep_w = deps_win if deps_win is not None else empty
    dep_b = deps_base if deps_base is not None else empty
    calls = min(50.0, (len(dep_w) + len(dep_b)) / max(len(win) + len(base), 1))
    dw, db = dependency_ms(win, dep_w, calls), dependency_ms(base, dep_b, calls)
    d.explained_ms[C.SLOW_DEPENDENCY] = (dw - db) * (1.0 if metric != "tbt_ms" else 0.0)
    d.explained_ms[C.REQUEST_MIX_SHIFT] = mix_shift_ms(win, base, metric)
    d.explained_ms[C.HOST_MEMORY_PRESSURE] = d.observed_ms * max(0.0, psi_mem[1] - psi_mem[0])
    _signals(d, win, base, win_s, base_s, (dw, db))
    d.signals["psi_memory_some"] = psi_mem
    if arrivals is not None:
        # requests that began in the window (the engine counts those that outlasted it too)
        # against the baseline's per window: what rank.arrivals_rose reads before `requests`
        d.signals["arrivals"] = arrivals
    return d


def _signals(d: Decomposition, win: pd.DataFrame, base: pd.DataFrame, win_s: float,
             base_s: float, dep: tuple[float, float]) -> None:
    def pair(name: str, f: str = "mean") -> tuple[float, float]:
        b, w = base[name].to_numpy(dtype=float), win[name].to_numpy(dtype=float)
        fn = np.nanmean if f == "mean" else np.nansum
        vb = float(fn(b)) if np.any(~np.isnan(b)) else 0.0
        vw = float(fn(w)) if np.any(~np.isnan(w)) else 0.0
        return vb, vw

    d.signals["requests_per_s"] = (len(base) / max(base_s, 1e-9), len(win) / max(win_s, 1e-9))
    # the window's requests against what the baseline's rate would have brought in it: a
    # Poisson count's chance rise is told from a load rise by it (rank.arrivals_rose)
    d.signals["requests"] = (len(base) * win_s / max(base_s, 1e-9), float(len(win)))
    d.signals["in_flight"] = (concurrency(base), concurrency(win))
    for name in ("runq_ms", "srtt_ms", "chunks", "req_bytes", "resp_bytes", "cuda_sync_ms",
                 "cuda_copy_ms", "error", "gpu_sm_clock_mhz"):
        d.signals[name] = pair(name)
    rb, rw = pair("retrans", "sum")
    d.signals["retransmits_per_request"] = (rb / max(len(base), 1), rw / max(len(win), 1))
    d.signals["dependency_ms_per_request"] = (dep[1], dep[0])
