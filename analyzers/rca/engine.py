"""The live analysis: spans in, verdicts out, one window at a time.

    engine = RcaEngine(RcaSettings(window_s=10), slos)
    engine.add(span)                  # the agent's span sink (cheap: one row per span)
    engine.add_procs(sampler.snapshot())   # about once a second
    for v in engine.advance(time.time_ns()): ...   # closes windows that ended grace_s ago

A window is judged per service (its SERVER spans; a process with only CLIENT spans is judged
on those) and per configured route: against its SLOs when it has any, else against its own
recent normal windows. Windows without a breach become the baseline the next breach is
decomposed against.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import rank
from .decompose import decompose
from .model import LinearModel, scores
from .procs import ProcDelta, ProcSnapshot, delta, task_wait_rates
from .slo import Breach, DegradationRule, Slo, degradation, slo_breaches, window_stats
from .spantable import Row, empty_frame, service_of, span_row, to_frame
from .verdict import Verdict

if TYPE_CHECKING:
    import pandas as pd
    from sits_trace.agent.model import Span

WATCH_PEERS = 8  # callees per window looked up on this node (the busiest)
WATCH_REFRESH_NS = 30 * 10**9  # a callee's processes are looked up again after this
_METRIC_OF = {"duration_ms": "duration_ms", "ttft_ms": "ttft_ms", "tbt_ms": "tbt_ms"}


@dataclass(frozen=True, slots=True)
class RcaSettings:
    window_s: float = 10.0
    baseline_windows: int = 12  # normal windows kept as the baseline
    min_spans: int = 5  # fewer spans in a window: not judged
    grace_s: float = 0.5  # wait this long after a window's end for its last spans
    service_name: str = ""  # export.service_name: every span's service
    rule: DegradationRule = field(default_factory=DegradationRule)


@dataclass(slots=True)
class _Group:
    history: collections.deque[dict[str, float]]
    frames: collections.deque[tuple[int, int, pd.DataFrame, pd.DataFrame]]  # (t0, t1, req, deps)


class RcaEngine:
    def __init__(self, settings: RcaSettings, slos: Sequence[Slo] = (), *,
                 model: LinearModel | None = None,
                 frame: Callable[[], pd.DataFrame | None] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns,
                 exclude_pids: set[int] | None = None,
                 peer_pids: Callable[[str], set[int]] | None = None,
                 asked: Callable[[int, int], bool] | None = None) -> None:
        self.s = settings
        # windows [t0, t1) to diagnose whether or not they breach (sits-trace rca --at; the
        # evaluation's "given the fault's time", as NSigma and BARO are given it)
        self.asked = asked
        self.slos = list(slos)
        self.model = model
        self._frame = frame
        self._clock = clock_ns
        self._exclude = exclude_pids
        self._peer_pids = peer_pids  # a callee's processes on this node (live only)
        self._callees: dict[str, tuple[int, set[int]]] = {}  # peer -> (looked up at, pids)
        self._rows: list[Row] = []
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str | None, int], _Group] = {}
        self._procs: collections.deque[ProcSnapshot] = collections.deque(
            maxlen=int(settings.window_s * (settings.baseline_windows + 3)) + 10)
        self._next_end: int | None = None
        self._late: pd.DataFrame | None = None  # the window being closed: spans that outlasted it
        self.windows = 0

    # ---- input ----

    def add(self, span: Span) -> None:
        row = span_row(span, service_of(span, self.s.service_name))
        with self._lock:
            self._rows.append(row)

    def add_procs(self, snap: ProcSnapshot) -> None:
        self._procs.append(snap)

    def watched_pids(self) -> set[int]:
        """The local dependencies' processes (live only): the /proc sampler reads their whole
        run-queue wait, so a verdict can tell a starved callee from a slow one."""
        return set().union(*(p for _, p in self._callees.values())) if self._callees else set()

    def _callee_pids(self, peer: str) -> set[int]:
        """A callee's processes: the lookup of its windows (at most 30 s old), else a new one."""
        seen = self._callees.get(peer)
        if seen is not None:
            return set(seen[1])
        assert self._peer_pids is not None
        return self._peer_pids(peer)

    def _look_up_callees(self, peers: pd.Series, now: int) -> None:
        if self._peer_pids is None or not len(peers):
            return
        for peer in peers.value_counts().index[:WATCH_PEERS]:
            seen = self._callees.get(str(peer))
            if seen is None or now - seen[0] > WATCH_REFRESH_NS:
                self._callees[str(peer)] = (now, self._peer_pids(str(peer)))
        for old in [k for k, (t, _) in self._callees.items() if now - t > 4 * WATCH_REFRESH_NS]:
            del self._callees[old]

    # ---- windows ----

    def advance(self, now_ns: int | None = None) -> list[Verdict]:
        """Judge every window that ended at least grace_s before `now_ns`."""
        now = self._clock() if now_ns is None else now_ns
        w = int(self.s.window_s * 1e9)
        if self._next_end is None:
            self._next_end = (now // w + 1) * w
        out: list[Verdict] = []
        while self._next_end + self.s.grace_s * 1e9 <= now:
            out.extend(self._close(self._next_end - w, self._next_end, now))
            self._next_end += w
        return out

    def _take(self, end: int) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The spans that ended before `end`, and those that ended after it but began
        before it (requests that arrived in the window and outlasted it)."""
        with self._lock:
            rows, keep = self._rows, []
            self._rows = []
        win = [r for r in rows if float(r[0]) < end] if rows else []
        keep = [r for r in rows if float(r[0]) >= end] if rows else []
        with self._lock:
            self._rows = keep + self._rows
        late = [r for r in keep if float(r[1]) < end]
        return (to_frame(win) if win else empty_frame(),
                to_frame(late) if late else empty_frame())

    def _close(self, t0: int, t1: int, now: int) -> list[Verdict]:
        df, late = self._take(t1)
        df = df[df["end_ns"].to_numpy() >= t0]
        self._late = late[late["start_ns"].to_numpy() >= t0]
        self.windows += 1
        out: list[Verdict] = []
        if not len(df):
            return out
        client = df["client"].to_numpy() > 0
        self._look_up_callees(df.loc[client, "server"], now)
        server_pids = set(df.loc[~client, "pid"].astype(int))
        req_all = df[~client | ~df["pid"].isin(server_pids).to_numpy()]
        for (svc, kind), g in req_all.groupby(["service", "client"], sort=False):
            deps = df[client & df["pid"].isin(set(g["pid"].astype(int))).to_numpy()] \
                if not kind else df.iloc[:0]
            out.extend(self._judge(str(svc), None, int(kind), g, deps, t0, t1, now))
            for slo in self.slos:
                if slo.route is not None and slo.service == svc:
                    sub = g[g["route"].to_numpy() == slo.route]
                    out.extend(self._judge(str(svc), slo.route, int(kind), sub, deps, t0, t1, now))
        return out

    def _judge(self, svc: str, route: str | None, kind: int, g: pd.DataFrame, deps: pd.DataFrame,
               t0: int, t1: int, now: int) -> list[Verdict]:
        if len(g) < self.s.min_spans:
            return []
        key = (svc, route, kind)
        grp = self._groups.get(key)
        if grp is None:
            grp = self._groups[key] = _Group(collections.deque(maxlen=max(30, self.s.baseline_windows)),
                                             collections.deque(maxlen=self.s.baseline_windows))
        slos = [s for s in self.slos if s.service == svc and s.route == route]
        breaches = [b for s in slos for b in slo_breaches(g, s)]
        if not slos:
            breaches = degradation(g, grp.history, self.s.rule)
        if not breaches and self.asked is not None and self.asked(t0, t1):
            breaches = [asked_breach(g, grp.history)]
        if not breaches:
            grp.history.append(window_stats(g))
            grp.frames.append((t0, t1, g, deps))
            return []
        worst = max(breaches, key=lambda b: b.observed / max(b.target, 1e-9))
        return [self._verdict(svc, route, kind, worst, g, deps, grp, t0, t1, now)]

    def _verdict(self, svc: str, route: str | None, kind: int, breach: object, g: pd.DataFrame,
                 deps: pd.DataFrame, grp: _Group, t0: int, t1: int, now: int) -> Verdict:
        import pandas as pd  # noqa: PLC0415 - the type is imported for checking only, above

        assert isinstance(breach, Breach)
        metric = breach.objective.split(":", 1)[-1].removesuffix("_mean")
        metric = metric.rsplit("_p", 1)[0]
        metric = _METRIC_OF.get(metric, "duration_ms")
        if metric != "duration_ms" and g[metric].isna().all():
            metric = "duration_ms"
        base = pd.concat([f[2] for f in grp.frames]) if grp.frames else g.iloc[:0]
        bdeps = pd.concat([f[3] for f in grp.frames]) if grp.frames else deps.iloc[:0]
        b0, b1 = (grp.frames[0][0], grp.frames[-1][1]) if grp.frames else (t0, t0)
        # the window's processes up to the newest snapshot (taken after the window closed):
        # a competitor that started late in the window shows with its full rate
        pw, pb = self._proc_delta(t0, max(t1, now)), self._proc_delta(b0, b1)
        psi = (pb.psi.get("memory_some", 0.0) if pb else 0.0,
               pw.psi.get("memory_some", 0.0) if pw else 0.0)
        nb = max(len(grp.frames), 1)
        d = decompose(g, base, metric, deps_win=deps, deps_base=bdeps,
                      win_s=(t1 - t0) / 1e9, base_s=nb * (t1 - t0) / 1e9, psi_mem=psi,
                      arrivals=self._arrivals(g, base, nb, (svc, route, kind), (t0, t1),
                                              (b0, b1)))
        ctx = rank.Context(set(g["pid"].astype(int)), g, base, deps, bdeps, pw, pb,
                           *self._frames(t0, t1, b0, b1))
        if self._exclude is not None:
            ctx.exclude_pids = self._exclude
        ctx.peer_pids = self._callee_pids if self._peer_pids is not None else None
        ctx.win_s = (t1 - t0) / 1e9
        rank.starved_dependency(d, ctx)
        rank.memory_stall(d, ctx)
        f = rank.features(d, ctx)
        rules = rank.heuristic(d, f)
        f.update({k: rules.get(k[2:], 0.0) for k in rank.RULE_FEATURES})
        causes = rank.ranked(d, ctx, scores(self.model, f, rules))
        return Verdict(now, svc, route, breach, causes, t0, t1,
                       "CLIENT" if kind else "SERVER", f)

    def _arrivals(self, g: pd.DataFrame, base: pd.DataFrame, nb: int,
                  key: tuple[str, str | None, int], win: tuple[int, int],
                  span: tuple[int, int]) -> tuple[float, float]:
        """Requests that arrived in the window (began in it, whenever they ended, as far as
        the grace period shows) against what the baseline's `nb` windows brought each.
        Counted by completion, a server that stalled and then drained its queue into the
        window looked like a load rise (CI: 6.6 requests/s against 3.7 in a memory fault's
        first window, the load generator's own schedule 4-6/s) and the wait went to
        server_queueing."""
        svc, route, kind = key
        late = self._late if self._late is not None else g.iloc[:0]
        if len(late):
            keep = (late["service"].to_numpy() == svc) & (late["client"].to_numpy() == kind)
            if route is not None:
                keep &= late["route"].to_numpy() == route
            late = late[keep]
        seen = int(np.count_nonzero(g["start_ns"].to_numpy() >= win[0])) + len(late)
        bs = base["start_ns"].to_numpy()
        before = int(np.count_nonzero((bs >= span[0]) & (bs < span[1])))
        return before / max(nb, 1), float(seen)

    def _proc_delta(self, t0: int, t1: int) -> ProcDelta | None:
        if len(self._procs) < 2 or t1 <= t0:
            return None
        ts = [p.t_ns for p in self._procs]
        ia, ib = _nearest(ts, t0), _nearest(ts, t1)
        a, b = self._procs[ia], self._procs[ib]
        if b.t_ns <= a.t_ns:
            return None
        d = delta(a, b)
        missing = set(b.task_wait) - set(a.task_wait)
        # a callee watched since inside the interval (the engine looks one up when its first
        # window closes): its wait counts from the first snapshot that has it
        for s in itertools.islice(self._procs, ia + 1, ib):
            if not missing:
                break
            got = missing & set(s.task_wait)
            if got:
                rates = task_wait_rates(s, b)
                d.task_wait_per_s.update({p: rates[p] for p in got})
                missing -= got
        return d

    def _frames(self, t0: int, t1: int, b0: int, b1: int
                ) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
        fr = self._frame() if self._frame is not None else None
        if fr is None or not len(fr):
            return None, None
        t = fr.index.asi8 if hasattr(fr.index, "asi8") else np.asarray(fr.index)
        return fr[(t >= t0) & (t < t1)], fr[(t >= b0) & (t < b1)]


def asked_breach(g: pd.DataFrame, history: Sequence[dict[str, float]]) -> Breach:
    """A window asked for that breached nothing: judged on the metric whose mean rose most
    against the earlier windows' (duration when none has a baseline)."""
    now = window_stats(g)
    rose: list[Breach] = []
    for key in ("duration_ms_mean", "ttft_ms_mean", "tbt_ms_mean"):
        past = [h[key] for h in history if not np.isnan(h.get(key, np.nan))]
        if past and not np.isnan(now[key]):
            base = float(np.median(past))
            rose.append(Breach(f"asked:{key}", now[key], base, base))
    if not rose:
        return Breach("asked:duration_ms_mean", now["duration_ms_mean"], 0.0)
    return max(rose, key=lambda b: b.observed / max(b.target, 1e-9))


def _nearest(ts: list[int], t: int) -> int:
    i = bisect.bisect_left(ts, t)
    if i == 0:
        return 0
    if i >= len(ts):
        return len(ts) - 1
    return i if ts[i] - t < t - ts[i - 1] else i - 1
