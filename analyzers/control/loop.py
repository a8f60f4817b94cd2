"""The control loop: once an interval, latency + reports + RCA verdicts -> decisions -> actions.

  window   the controlled service's P95 of this interval, the batch sizes and queue depths it
           reported and the RCA's latest top cause go to the window controller.
  CPU      a verdict whose top cause is cpu_starvation, pcie_contention or
           gpu_compute_contention with a culprit pid becomes a throttle of that pid;
           cpu_starvation also reserves CPU (SCHED_DEADLINE) for the served process's busiest
           threads when `control.cpu_reservation` is on (deadline.py).
  GPU      pcie_contention / gpu_compute_contention also ask the served process to raise its
           compute stream's priority; pcie_contention asks a cooperating copier for a budget.

Modes: `observe` computes and logs and exports, publishes nothing, touches nothing;
`advise` publishes the decisions on the API (the server may follow them) and lists CPU
actions as advised, touching nothing; `act` also applies the CPU actions. An action is
undone when its cause clears (the culprit exited, or wanted under half of its cap, running or
runnable, for `clear_after_s`; a reservation: no verdict named cpu_starvation for
`clear_after_s`), and all of them when the loop stops.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sits_trace.agent.model import MetricSample, Span

from .actuators import ActuatorError, CgroupCpuActuator, CpuAction
from .board import DecisionBoard
from .deadline import DeadlineReserver, Reservation
from .latency import LatencyTable, p95
from .verdicts import CPU_ACTIONABLE, Cause, Verdict, VerdictSource
from .window import Bounds, IntervalStats, WindowController, make_controller

log = logging.getLogger(__name__)
MODES = ("observe", "advise", "act")
GPU_CAUSES = frozenset({"pcie_contention", "gpu_compute_contention"})

ActionSink = Callable[[dict[str, Any]], None]


class ControlOptions(Protocol):
    """What `[control]` in the configuration gives the loop (agent/config.py ControlConfig)."""

    mode: str
    service: str
    slo_ms: float
    controller: str
    window_ms: float
    window_min_ms: float
    window_max_ms: float
    interval_s: float
    clear_after_s: float
    min_score: float
    stream_priority: int
    copy_budget_bytes_per_s: float


@dataclass
class _Advice:
    """A CPU action published but not applied (advise) or only logged (observe)."""

    action: CpuAction
    last_named: float


@dataclass
class _Reserved:
    """A reservation (applied in act, published in advise) and when a verdict last asked."""

    reservation: Reservation
    last_named: float
    culprit: int | None = None  # the competitor named with it: kept while it competes
    low_since: float | None = None


class ControlLoop:
    def __init__(self, opts: ControlOptions, board: DecisionBoard, *,
                 actuator: CgroupCpuActuator | None = None,
                 reserver: DeadlineReserver | None = None,
                 verdicts: VerdictSource = list,
                 controller: WindowController | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 on_action: Sequence[ActionSink] = ()) -> None:
        if opts.mode not in MODES:
            raise ValueError(f"control.mode: {opts.mode!r} is not one of {', '.join(MODES)}")
        self.opts = opts
        self.board = board
        self.actuator = actuator
        self.reserver = reserver
        self._reserved: dict[int, _Reserved] = {}  # served pid -> its reservation
        self.verdicts = verdicts
        bounds = Bounds(opts.window_min_ms, opts.window_max_ms)
        self.controller = controller or make_controller(opts.controller, opts.slo_ms,
                                                        opts.window_ms, bounds)
        self.latency = LatencyTable()
        self._clock, self._wall = clock, wall
        self._on_action = list(on_action)
        self._last_tick: float | None = None
        self._latest: dict[str, tuple[float, Verdict]] = {}  # service -> (seen at, verdict)
        self._advice: dict[int, _Advice] = {}
        self._gpu_until = -math.inf
        self.window_ms: float | None = None
        self.last_p95_ms: float | None = None
        self.counts: dict[tuple[str, str, str], int] = {}  # (kind, cause, applied) -> n
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- inputs ----------------------------------------------------------------------------

    def observe_span(self, span: Span) -> None:
        self.observe_spans([span])

    def observe_spans(self, spans: list[Span]) -> None:
        """The latency of each SERVER span into the table: a tracer's batch under one lock
        (compiled: latency.py)."""
        self.latency.add_spans(spans)

    def observe_latency(self, service: str, ms: float) -> None:
        self.latency.add(service, ms)

    # -- the loop --------------------------------------------------------------------------

    def tick(self) -> None:
        """One interval: read verdicts, step the window, act on causes, clear what cleared."""
        now = self._clock()
        duration = now - self._last_tick if self._last_tick is not None else self.opts.interval_s
        self._last_tick = now
        fresh = self.verdicts()
        for v in fresh:
            self._latest[v.service] = (now, v)
        service = self.opts.service or self.latency.busiest()
        if service is not None:
            self._step_window(service, max(duration, 1e-3), now)
        for v in fresh:
            self._on_verdict(v, now)
        self._clear(now)

    def _step_window(self, service: str, duration: float, now: float) -> None:
        lat = self.latency.take(service)
        rep = self.board.take_reports(service)
        stats = IntervalStats(duration_s=duration, completed=len(lat), p95_ms=p95(lat),
                              batch_size=rep.mean_batch_size if rep else None,
                              queue_depth=rep.mean_queue_depth if rep else None,
                              arrivals=rep.arrivals if rep else None)  # the server's count
        self.last_p95_ms = stats.p95_ms
        if self.actuator is not None:
            self.actuator.protected |= self.latency.pids(service)
        cause = self._cause(service, now)
        before = self.window_ms
        self.window_ms = round(self.controller.step(stats, cause.cause if cause else None), 3)
        if self.opts.mode != "observe":
            self.board.publish(batch_window_ms=self.window_ms)
        if before is None or abs(self.window_ms - before) > 0.1 * before:
            self._record("batch_window", cause.cause if cause else "", applied=False,
                         service=service, window_ms=self.window_ms, previous_ms=before,
                         p95_ms=stats.p95_ms, controller=self.controller.name,
                         reason=getattr(self.controller, "last_reason", ""))

    def _cause(self, service: str, now: float) -> Cause | None:
        seen = self._latest.get(service)
        if seen is None or now - seen[0] > self.opts.clear_after_s or not seen[1].breach:
            return None
        return seen[1].top()

    def _on_verdict(self, v: Verdict, now: float) -> None:
        top = v.top()
        if top is None or not v.breach or top.score < self.opts.min_score:
            return
        if top.cause in GPU_CAUSES:
            self._gpu_decisions(top, now)
        if top.cause == "cpu_starvation" and self.reserver is not None:
            self._reserve(top, v.service, now)
        pid = top.culprit.pid if top.culprit else None
        if top.cause not in CPU_ACTIONABLE or pid is None or self.actuator is None:
            return
        if pid in self._advice:
            self._advice[pid].last_named = now
            return
        if pid in self.actuator.active:
            return
        self._cpu_action(top, pid, v.service, now)

    def _cpu_action(self, top: Cause, pid: int, service: str, now: float) -> None:
        assert self.actuator is not None
        name = top.culprit.name if top.culprit and top.culprit.name else ""
        try:
            action = self.actuator.plan(top.cause, pid, name)
            if self.opts.mode == "act":
                self.actuator.apply(action)
            else:
                self._advice[pid] = _Advice(action, now)
        except ActuatorError as e:
            self._record("cpu_throttle_refused", top.cause, applied=False, pid=pid,
                         service=service, reason=str(e))
            return
        detail = {k: v for k, v in action.to_json().items()
                  if k not in ("kind", "cause", "applied")}
        self._record("cpu_throttle", top.cause, applied=action.applied, service=service,
                     **detail)
        self._publish_cpu()

    def _reserve(self, top: Cause, service: str, now: float) -> None:
        """CPU for the starved service's own threads, whoever the culprit is."""
        assert self.reserver is not None
        culprit = top.culprit.pid if top.culprit else None
        for pid in sorted(self.latency.pids(service) - {culprit})[:2]:
            if pid in self._reserved:
                self._reserved[pid].last_named = now
                continue
            try:
                r = self.reserver.plan(top.cause, pid, service)
                if self.opts.mode == "act":
                    self.reserver.apply(r)
            except ActuatorError as e:
                self._record("cpu_reservation_refused", top.cause, applied=False, pid=pid,
                             service=service, reason=str(e))
                continue
            self._reserved[pid] = _Reserved(r, now, culprit)
            detail = {k: v for k, v in r.to_json().items()
                      if k not in ("kind", "cause", "applied")}
            self._record("cpu_reservation", top.cause, applied=r.applied, service=service,
                         **detail)
            self._publish_cpu()

    def _unreserve(self, pid: int, reason: str) -> None:
        res = self._reserved.pop(pid, None)
        if res is None:
            return
        r = res.reservation
        applied = r.applied
        if applied and self.reserver is not None:
            self.reserver.revert(pid)
        self._record("cpu_reservation_restore", r.cause, applied=applied, pid=pid,
                     name=r.name, reason=reason)
        self._publish_cpu()

    def _gpu_decisions(self, top: Cause, now: float) -> None:
        first = now > self._gpu_until
        self._gpu_until = now + self.opts.clear_after_s
        if not first:
            return
        budget = self.opts.copy_budget_bytes_per_s if top.cause == "pcie_contention" else None
        if self.opts.mode != "observe":
            self.board.publish(stream_priority=self.opts.stream_priority,
                               copy_budget_bytes_per_s=budget or None)
        self._record("gpu_priority", top.cause, applied=False,
                     stream_priority=self.opts.stream_priority, copy_budget_bytes_per_s=budget)

    def _clear(self, now: float) -> None:
        if self._gpu_until != -math.inf and now > self._gpu_until:
            self._gpu_until = -math.inf
            if self.opts.mode != "observe":
                self.board.publish(stream_priority=None, copy_budget_bytes_per_s=None)
            self._record("gpu_priority_restore", "", applied=False)
        for pid, adv in list(self._advice.items()):
            if now - adv.last_named > self.opts.clear_after_s:
                del self._advice[pid]
                self._record("cpu_restore", adv.action.cause, applied=False, pid=pid,
                             reason="no verdict has named it for clear_after_s")
                self._publish_cpu()
        if self.actuator is not None:
            for action in list(self.actuator.active.values()):
                self._check_active(action, now)
        for pid, res in list(self._reserved.items()):
            reason = self._reservation_cleared(res, now)
            if reason is not None:
                self._unreserve(pid, reason)

    def _reservation_cleared(self, res: _Reserved, now: float) -> str | None:
        """Why a reservation should go, or None. With a culprit: when it exits or wants under
        0.1 CPU for clear_after_s (a reservation that works ends the verdicts, not the
        competition: undoing it then would flap); without one: no verdict for clear_after_s."""
        assert self.reserver is not None
        if res.reservation.applied and not self.reserver.alive(res.reservation):
            return "the served threads exited"
        if res.culprit is None:
            if now - res.last_named > self.opts.clear_after_s:
                return "no verdict has named cpu_starvation for clear_after_s"
            return None
        wanted = self.reserver.culprit_demand(res.culprit)
        if wanted is None and not self.reserver.proc.joinpath(str(res.culprit)).exists():
            return "the culprit exited"
        if wanted is not None and wanted < 0.1:
            res.low_since = res.low_since or now
            if now - res.low_since >= self.opts.clear_after_s:
                return f"the culprit wanted {wanted:.2f} CPU for clear_after_s"
        elif wanted is not None:
            res.low_since = None
        return None

    def _check_active(self, action: CpuAction, now: float) -> None:
        assert self.actuator is not None
        reason = None
        if not self.actuator.alive(action):
            reason = "the culprit exited"
        else:
            wanted = self.actuator.demand_cpus(action, now)
            if wanted is not None and wanted < 0.5 * action.cpu_fraction:
                action.low_since = action.low_since or now
                if now - action.low_since >= self.opts.clear_after_s:
                    reason = f"the culprit wanted {wanted:.2f} CPU, under half its cap"
            elif wanted is not None:
                action.low_since = None
        if reason is not None:
            self.actuator.revert(action.pid)
            self._record("cpu_restore", action.cause, applied=True, pid=action.pid,
                         name=action.name, reason=reason)
            self._publish_cpu()

    def _publish_cpu(self) -> None:
        if self.opts.mode == "observe":
            return
        acts = [a.to_json() for a in (self.actuator.active.values() if self.actuator else [])]
        acts += [a.action.to_json() for a in self._advice.values()]
        acts += [r.reservation.to_json() for r in self._reserved.values()]
        self.board.publish(cpu_actions=acts)

    # -- records and metrics ---------------------------------------------------------------

    def _record(self, kind: str, cause: str, *, applied: bool, **detail: Any) -> None:
        rec = {"time_unix": self._wall(), "kind": kind, "cause": cause,
               "mode": self.opts.mode, "applied": applied, **detail}
        key = (kind, cause, "true" if applied else "false")
        self.counts[key] = self.counts.get(key, 0) + 1
        level = logging.INFO if kind != "batch_window" else logging.DEBUG
        log.log(level, "control %s: %s", kind, {k: v for k, v in rec.items() if k != "kind"})
        for sink in self._on_action:
            try:
                sink(rec)
            except Exception:
                log.debug("control action sink failed", exc_info=True)

    def metric_samples(self) -> list[MetricSample]:
        out = [MetricSample("sits_control_mode", {"mode": self.opts.mode}, 1.0)]
        if self.window_ms is not None:
            out.append(MetricSample("sits_control_batch_window_seconds",
                                    {"controller": self.controller.name}, self.window_ms / 1e3))
        if self.last_p95_ms is not None:
            out.append(MetricSample("sits_control_latency_p95_seconds", {},
                                    self.last_p95_ms / 1e3))
        active = len(self.actuator.active) if self.actuator else 0
        out.append(MetricSample("sits_control_cpu_actions_active", {}, float(active)))
        out.append(MetricSample("sits_control_cpu_actions_advised", {}, float(len(self._advice))))
        out.append(MetricSample("sits_control_cpu_reservations", {}, float(len(self._reserved))))
        out.append(MetricSample("sits_control_decisions_version", {}, float(self.board.version)))
        for (kind, cause, applied), n in sorted(self.counts.items()):
            out.append(MetricSample("sits_control_actions_total",
                                    {"kind": kind, "cause": cause, "applied": applied}, float(n)))
        return out

    # -- thread ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.actuator is not None and self.opts.mode == "act":
            n = self.actuator.revert_stale()
            if n:
                self._record("cpu_restore", "", applied=True, reason=f"{n} left by a previous agent")
        if self.reserver is not None and self.opts.mode == "act":
            n = self.reserver.revert_stale()
            if n:
                self._record("cpu_reservation_restore", "", applied=True,
                             reason=f"{n} threads left reserved by a previous agent")
        self._thread = threading.Thread(target=self._run, name="control-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.opts.interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("control loop interval failed")

    def stop(self) -> None:
        """Stop the thread and undo every action (the agent is stopping)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.undo_all("the agent stopped")

    def undo_all(self, reason: str) -> None:
        for pid in list(self._reserved):
            self._unreserve(pid, reason)
        if self.actuator is None:
            return
        for action in self.actuator.revert_all():
            self._record("cpu_restore", action.cause, applied=True, pid=action.pid,
                         name=action.name, reason=reason)
        self._advice.clear()
        self._publish_cpu()
