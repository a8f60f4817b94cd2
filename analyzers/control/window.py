"""Batch-window controllers: each turns one interval's latency and load into the next window.

A dynamic batcher holds the first queued request up to the window, then runs what it has
(or runs early when the batch is full). A longer window makes larger batches: more requests
per second of compute, more waiting per request. The controllers:

  StaticWindow    a fixed window (the baselines' sweep: 5, 10, 20, 50, 100 ms).
  PublishedRule   the published rule: EWMA-smoothed P95 against the target; shrink 20% when
                  it is above 1.2x target, grow 15% when it is below 0.7x target and
                  throughput rose more than 10% since the last interval; bounds 10..500 ms.
  Aimd            Clipper-style AIMD: add a fixed step while P95 meets the target, cut 10%
                  when it does not.
  VerdictWindow   ours: the RCA's cause gates the direction (never grow for a cause a larger
                  batch cannot fix: network, CPU, GPU, memory; shrink for queueing only when
                  the batcher's wait is the bottleneck, grow when a backlog shows capacity is),
                  and what it learns online decides whether waiting pays at all: batch size
                  against window, latency against batch size. A window that buys no larger
                  batches (continuous batching) is pure latency and goes to its floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .verdicts import NOT_BATCHING


@dataclass(frozen=True)
class Bounds:
    lo_ms: float = 10.0
    hi_ms: float = 500.0

    def clip(self, w: float) -> float:
        return min(self.hi_ms, max(self.lo_ms, w))


@dataclass(frozen=True)
class IntervalStats:
    """What one control interval saw of one service."""

    duration_s: float
    completed: int  # requests that finished in the interval
    p95_ms: float | None  # None when none finished
    batch_size: float | None = None  # mean batch size the server reported
    queue_depth: float | None = None  # mean queue depth the server reported
    arrivals: int | None = None  # requests that arrived, when known

    @property
    def throughput_rps(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def arrival_rps(self) -> float | None:
        if self.arrivals is None or self.duration_s <= 0:
            return None
        return self.arrivals / self.duration_s


class WindowController(Protocol):
    name: str
    window_ms: float

    def step(self, stats: IntervalStats, cause: str | None) -> float:
        """The window for the next interval, given this one and the RCA's top cause."""
        ...


class StaticWindow:
    def __init__(self, window_ms: float) -> None:
        self.name = f"static-{window_ms:g}ms"
        self.window_ms = window_ms

    def step(self, stats: IntervalStats, cause: str | None) -> float:
        return self.window_ms


class PublishedRule:
    def __init__(self, target_ms: float, window_ms: float = 20.0, bounds: Bounds = Bounds(),
                 alpha: float = 0.3) -> None:
        self.name = "published-rule"
        self.target_ms = target_ms
        self.bounds = bounds
        self.window_ms = bounds.clip(window_ms)
        self.alpha = alpha
        self.ewma_ms: float | None = None
        self._last_rps: float | None = None

    def step(self, stats: IntervalStats, cause: str | None) -> float:
        if stats.p95_ms is None:
            return self.window_ms
        self.ewma_ms = _ewma(self.ewma_ms, stats.p95_ms, self.alpha)
        rps, last = stats.throughput_rps, self._last_rps
        self._last_rps = rps
        if self.ewma_ms > 1.2 * self.target_ms:
            self.window_ms = self.bounds.clip(self.window_ms * 0.8)
        elif self.ewma_ms < 0.7 * self.target_ms and last is not None and rps > 1.1 * last:
            self.window_ms = self.bounds.clip(self.window_ms * 1.15)
        return self.window_ms


class Aimd:
    def __init__(self, target_ms: float, window_ms: float = 20.0, bounds: Bounds = Bounds(),
                 step_ms: float = 5.0, cut: float = 0.9) -> None:
        self.name = "aimd"
        self.target_ms = target_ms
        self.bounds = bounds
        self.window_ms = bounds.clip(window_ms)
        self.step_ms = step_ms
        self.cut = cut

    def step(self, stats: IntervalStats, cause: str | None) -> float:
        if stats.p95_ms is None:
            return self.window_ms
        if stats.p95_ms > self.target_ms:
            self.window_ms = self.bounds.clip(self.window_ms * self.cut)
        else:
            self.window_ms = self.bounds.clip(self.window_ms + self.step_ms)
        return self.window_ms


class OnlineFit:
    """Online least squares y = a + b*x with forgetting: old points fade, so a new regime
    (request mix, load) is learnt again within tens of intervals."""

    def __init__(self, forget: float = 0.95, min_points: int = 6, min_var: float = 0.25) -> None:
        self.forget = forget
        self.min_points = min_points
        self.min_var = min_var  # x must spread at least this much (variance) to give a slope
        self.n = 0
        self._s = [0.0] * 5  # weighted sums of 1, x, y, x*x, x*y

    def add(self, x: float, y: float) -> None:
        f, s = self.forget, self._s
        self._s = [f * s[0] + 1, f * s[1] + x, f * s[2] + y, f * s[3] + x * x, f * s[4] + x * y]
        self.n += 1

    def coef(self) -> tuple[float, float] | None:
        """(a, b), or None until enough points with enough spread in x."""
        w, sx, sy, sxx, sxy = self._s
        if self.n < self.min_points or w <= 0:
            return None
        var = sxx / w - (sx / w) ** 2
        if var < self.min_var:
            return None
        b = (sxy / w - (sx / w) * (sy / w)) / var
        return sy / w - b * sx / w, b

    def reset(self) -> None:
        self.n = 0
        self._s = [0.0] * 5


class BatchLatencyModel(OnlineFit):
    """Latency beyond the window against batch size: ms = a + b*size (a, b >= 0).

    Fed only from intervals without a backlog (queueing would bias the slope)."""

    def coef(self) -> tuple[float, float] | None:
        c = super().coef()
        return None if c is None else (max(0.0, c[0]), max(0.0, c[1]))


class VerdictWindow:
    """Ours: the cause decides the direction; what it learns decides whether waiting pays.

    Two online fits: latency beyond the window against batch size (the cost of a batch),
    and batch size against the window (does waiting longer make batches larger at all?
    under continuous batching it does not). A window that does not buy larger batches is
    pure latency: it goes to its floor. One that does is grown under a backlog and, under
    light load, set to the largest window the latency budget allows. Until it can tell, the
    window takes the headroom the budget leaves, so that a load step finds spare capacity.
    It never grows past `max_share` of the target.
    """

    def __init__(self, target_ms: float, window_ms: float = 20.0, bounds: Bounds = Bounds(),
                 alpha: float = 0.5, budget: float = 0.7, pays_share: float = 0.3,
                 hold_load: float = 0.8, max_share: float = 0.8,
                 rising: float = 1.3, verdict_ttl: int = 240) -> None:
        self.name = "ours"
        self.target_ms = target_ms
        self.bounds = bounds
        self.window_ms = bounds.clip(window_ms)
        self.alpha = alpha
        self.budget = budget  # share of the target the window may take when load is light
        # waiting pays when at least this share of the requests that arrive during a longer
        # window join the batch (a window batcher: all of them; continuous batching: none)
        self.pays_share = pays_share
        self.hold_load = hold_load  # a short window is remembered while load stays above this share
        # never grown past this share of the target: a window that long makes the first request
        # of every batch miss the target however much it adds to capacity
        self.max_share = max_share
        # P95 beyond the window while calm (no backlog, P95 within the target), EWMA
        self.overhead_ms: float | None = None
        self.load: float | None = None  # requests/s, slow EWMA: what the window was set for
        self.rising = rising  # no shrink while the load is above this multiple of `load`
        self.model = BatchLatencyModel()
        # batch size against the requests expected within the window (window x arrival rate):
        # spread in that, not in milliseconds, tells whether waiting buys batch size
        self.sizes = OnlineFit(min_var=0.05)
        self.ewma_ms: float | None = None
        self.short: tuple[float, float] | None = None  # (window, rps) a backlog was seen at
        self.grown_in_backlog = False  # the window grew during the backlog now going on
        self.gathered: float | None = None  # batch size / (1 + arrivals in a window), EWMA
        self._last_queue: float | None = None
        self._pressed = False  # this interval found capacity short
        self.verdict_ttl = verdict_ttl
        self._verdict: tuple[bool, int] | None = None  # the sizes fit's last answer, at step n
        self._steps = 0
        self.last_reason = "start"

    def batching_pays(self) -> bool | None:
        """Does a longer window make larger batches? From the fit once the window (times the
        load) has varied enough; the fit's last answer for `verdict_ttl` intervals after its
        spread has faded (a window at its floor varies no more: without the memory it would
        probe again); before that, False when batches are far larger than what a window
        gathers (continuous batching, or a queue that fills batches by itself), else None."""
        c = self.sizes.coef()
        if c is not None:
            return c[1] >= self.pays_share
        if self._verdict is not None and self._steps - self._verdict[1] <= self.verdict_ttl:
            return self._verdict[0]
        if self.gathered is not None and self.gathered > 2.0:
            return False
        return None

    def step(self, stats: IntervalStats, cause: str | None) -> float:
        self._steps += 1
        if stats.p95_ms is None:
            self.last_reason = "idle"
            return self.window_ms
        if cause == "request_mix_shift":
            self.model.reset()  # the sizes changed: what was learnt no longer holds
            self.sizes.reset()
            self.gathered = None
            self._verdict = None
        self.ewma_ms = _ewma(self.ewma_ms, stats.p95_ms, self.alpha)
        backlog = _backlog(stats)
        rate = stats.arrival_rps or stats.throughput_rps
        if stats.batch_size is not None:
            expected = self.window_ms * rate / 1000.0  # arrivals within one window
            self.sizes.add(expected, stats.batch_size)
            c = self.sizes.coef()
            if c is not None:
                self._verdict = (c[1] >= self.pays_share, self._steps)
            self.gathered = _ewma(self.gathered, stats.batch_size / (1.0 + expected), 0.3)
            if not backlog:
                self.model.add(stats.batch_size, max(0.0, stats.p95_ms - self.window_ms))
        if not backlog and stats.p95_ms <= self.target_ms:  # calm: what the server adds
            self.overhead_ms = _ewma(self.overhead_ms, max(0.0, stats.p95_ms - self.window_ms),
                                     self.alpha)
        self._pressed = False
        proposal, self.last_reason = self._propose(stats, backlog, rate)
        proposal = self._hold(proposal, backlog, rate)
        if proposal < self.window_ms and self.batching_pays() is not False and self._rising(rate):
            # the latency rose with the load: a shorter window would take capacity away just
            # when the load needs more of it
            proposal = self.window_ms
            self.last_reason += f"; held: the load is rising (x{rate / (self.load or rate):.1f})"
        self.load = _ewma(self.load, rate, 0.1)
        cap = self.max_share * self.target_ms
        if proposal > max(self.window_ms, cap):
            proposal = max(self.window_ms, cap)
            self.last_reason += f"; capped at {cap:.0f} ms ({self.max_share:g} x the target)"
        self._last_queue = stats.queue_depth
        if not self._pressed:
            self.grown_in_backlog = False
        if cause in NOT_BATCHING and proposal > self.window_ms:
            proposal = self.window_ms  # a bigger batch cannot fix it
            self.last_reason += f"; held ({cause})"
        self.window_ms = self.bounds.clip(proposal)
        return self.window_ms

    def _propose(self, s: IntervalStats, backlog: bool, rate: float) -> tuple[float, str]:
        assert s.p95_ms is not None and self.ewma_ms is not None
        w, t = self.window_ms, self.target_ms
        hot = s.p95_ms > t or self.ewma_ms > 0.9 * t
        pays = self.batching_pays()
        if hot and backlog:
            if pays is False:
                return w * 0.5, "backlog, but waiting does not make larger batches"
            return self._short_of_capacity(s, w, rate, "backlog")
        if self.ewma_ms > t:  # over the target (smoothed: one interval holds few requests)
            if pays is False:
                return w * 0.7, "wait-bound: the window is pure latency"
            if self._rising(rate):  # the load rose: queueing, capacity is short
                return self._short_of_capacity(s, w, rate, "the load rose")
            excess = self.ewma_ms - t
            if excess <= 0.5 * w or w > self.max_share * t:  # a shorter window takes it back
                return max(w * 0.7, w - 1.5 * excess), "wait-bound: the window is the bottleneck"
            # most of the excess is the server's: a shorter window would take back little
            # and, where waiting pays, add calls to what is queued
            return w, "over the target by more than the window could take back: hold"
        if pays is False:
            return w * 0.8, "waiting buys no larger batches: the window is pure latency"
        if pays is None:
            return self._headroom(w)
        # waiting pays: the window shrinks only when it makes requests miss (above); here it
        # grows to what the learnt model says the budget allows, or for a backlog
        fit = self._fit(rate)
        if fit is not None and fit > w:
            return fit, "model: the window that spends the latency budget"
        if backlog:
            return w * 1.2, "backlog building under the target"
        return w, "steady: within the target"

    def _rising(self, rate: float) -> bool:
        return self.load is not None and rate > self.rising * self.load

    def _short_of_capacity(self, s: IntervalStats, w: float, rate: float,
                           why: str) -> tuple[float, str]:
        """Capacity is short and larger batches add to it: grow, unless what is queued has
        stopped growing since the window last grew."""
        q, last = s.queue_depth, self._last_queue
        self._pressed = True
        if q is not None and last is not None and q <= 1.1 * last and self.grown_in_backlog:
            return w, f"{why}: no longer growing since the window grew: hold"
        self.grown_in_backlog = True
        # this window fell behind at this load (the slow average: one interval's rate is noisy)
        self.short = (w, self.load if self.load is not None else rate)
        deep = (q or 0.0) >= 4 * max(1.0, s.batch_size or 1.0)
        return w * (2.0 if deep else 1.5), f"{why}: capacity is short, larger batches"

    def _headroom(self, w: float) -> tuple[float, str]:
        """Before it can tell whether waiting pays: the window the latency budget leaves
        beyond what the server adds (the overhead). At light load that costs no request its
        target, and a load step then finds the batcher with spare capacity; a window at its
        floor would have none. A rising overhead with the window unchanged is queueing, which
        a shorter window does not cure (on a window batcher it makes it worse): hold, and
        shrink only a window that alone is past the budget."""
        budget = self.budget * self.target_ms
        room = budget - (self.overhead_ms or 0.0)
        if room > w:
            return min(room, w * 1.5), "headroom: the window the latency budget leaves"
        if w > budget:
            return max(budget, w / 1.5), "headroom: the window alone is past the budget"
        return w, "headroom spent: the latency beyond the window is not the window's"

    def _hold(self, proposal: float, backlog: bool, rate: float) -> float:
        """Remember the window a backlog was seen at: at that load a window that short did not
        keep up. Unless waiting is seen not to pay, do not shrink back to it (the shrink that
        a wait-bound P95 asks for would bring the backlog back: an oscillation). Forgotten
        when the load falls below `hold_load` of what it was then, or waiting is seen not to
        pay."""
        pays = self.batching_pays()
        if pays is False:
            self.short = None
            return proposal
        if backlog:
            return proposal
        load = self.load if self.load is not None else rate
        if self.short is not None and load < self.hold_load * self.short[1]:
            self.short = None
        if self.short is not None and proposal < 1.2 * self.short[0]:
            self.last_reason += f"; held above {self.short[0]:.0f} ms (a backlog there)"
            return max(proposal, min(self.window_ms, 1.2 * self.short[0]))
        return proposal

    def _fit(self, rate: float) -> float | None:
        """Largest window whose predicted P95 (window + a + b*size) stays within the budget."""
        coef, sizes = self.model.coef(), self.sizes.coef()
        if coef is None or sizes is None:
            return None
        a, b = coef
        best = None
        for w in _grid(self.bounds):
            size = max(1.0, sizes[0] + sizes[1] * w * rate / 1000.0)
            if w + a + b * size <= self.budget * self.target_ms:
                best = w
        if best is None:
            return None
        # move at most 1.5x per interval either way: the fit is noisy
        return min(self.window_ms * 1.5, max(self.window_ms / 1.5, best))


def _backlog(s: IntervalStats) -> bool:
    """More requests waiting than one batch takes, or arrivals outrunning completions."""
    if s.queue_depth is not None and s.queue_depth > max(1.0, s.batch_size or 1.0):
        return True
    rate = s.arrival_rps
    return rate is not None and rate > 1.1 * s.throughput_rps + 1.0


def _grid(bounds: Bounds, n: int = 40) -> list[float]:
    lo, hi = math.log(bounds.lo_ms), math.log(bounds.hi_ms)
    return [math.exp(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


def _ewma(prev: float | None, x: float, alpha: float) -> float:
    return x if prev is None else alpha * x + (1 - alpha) * prev


def make_controller(kind: str, target_ms: float, window_ms: float, bounds: Bounds) -> WindowController:
    """A controller by name: static, rule, aimd or ours ("verdict")."""
    if kind == "static":
        return StaticWindow(window_ms)
    if kind == "rule":
        return PublishedRule(target_ms, window_ms, bounds)
    if kind == "aimd":
        return Aimd(target_ms, window_ms, bounds)
    if kind in ("verdict", "ours"):
        return VerdictWindow(target_ms, window_ms, bounds)
    raise ValueError(f"unknown controller {kind!r} (static, rule, aimd, verdict)")
