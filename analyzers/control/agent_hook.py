"""The control loop inside the agent: built from `[control]`, fed the agent's spans.

`AgentControl.build(opts)` wires the decision board, the API socket, the verdict source
(`control.verdicts_path`, the RCA's JSON lines; or verdicts pushed in process), the window
controller and, in `act` mode, the cgroup actuator. A socket or cgroup that cannot be set up
is one warning line and the loop runs without it: control never stops tracing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from sits_trace.agent.model import MetricSample, Span
from sits_trace.agent.sinks import BatchSink, tee

from .actuators import ActuatorError, CgroupCpuActuator, find_cpu_hierarchy
from .api import ApiError, ControlServer
from .board import DecisionBoard
from .loop import ActionSink, ControlLoop, ControlOptions
from .verdicts import JsonlVerdicts, PushedVerdicts, Verdict

log = logging.getLogger(__name__)


class AgentControlOptions(ControlOptions, Protocol):
    socket_path: str
    socket_group: str
    verdicts_path: str
    cpu_fraction: float
    cpu_weight: int
    max_actions: int
    state_path: str
    cpu_reservation: bool


class AgentControl:
    def __init__(self, loop: ControlLoop, server: ControlServer | None,
                 pushed: PushedVerdicts) -> None:
        self.loop = loop
        self.server = server
        self.pushed = pushed

    @classmethod
    def build(cls, opts: AgentControlOptions, *, proc_root: Path = Path("/proc"),
              on_action: Sequence[ActionSink] = ()) -> AgentControl:
        board = DecisionBoard()
        pushed = PushedVerdicts()
        files = JsonlVerdicts(Path(opts.verdicts_path)) if opts.verdicts_path else None

        def verdicts() -> list[Verdict]:
            return pushed() + (files() if files is not None else [])

        actuator = None
        if opts.mode == "act":
            h = find_cpu_hierarchy(proc_root)
            if h is None:
                log.warning("control: no cpu cgroup controller mounted; CPU actions off")
            else:
                actuator = CgroupCpuActuator(
                    h, proc_root=proc_root, cpu_fraction=opts.cpu_fraction,
                    weight=opts.cpu_weight, max_actions=opts.max_actions,
                    state_path=Path(opts.state_path) if opts.state_path else None)
        elif opts.mode == "advise":
            h = find_cpu_hierarchy(proc_root)  # plans only: advise names what act would do
            if h is not None:
                actuator = CgroupCpuActuator(h, proc_root=proc_root,
                                             cpu_fraction=opts.cpu_fraction,
                                             weight=opts.cpu_weight, max_actions=opts.max_actions)
        reserver = None
        if opts.cpu_reservation and opts.mode in ("act", "advise"):
            from .deadline import DeadlineReserver  # noqa: PLC0415

            try:
                state = Path(opts.state_path).with_name("control-reservations.json") \
                    if opts.state_path and opts.mode == "act" else None
                reserver = DeadlineReserver(state_path=state, proc_root=proc_root)
            except ActuatorError as e:
                log.warning("control: %s; CPU reservations off", e)
        loop = ControlLoop(opts, board, actuator=actuator, reserver=reserver, verdicts=verdicts,
                           on_action=on_action)
        server = None
        if opts.socket_path:
            server = ControlServer(board, Path(opts.socket_path), opts.socket_group)
        return cls(loop, server, pushed)

    def tee(self, sink: Callable[[Span], None]) -> BatchSink:
        """A sink that gives each span, or a tracer's batch of them, to the loop, then to
        `sink`."""
        return tee(self.loop.observe_span, self.loop.observe_spans, sink)

    def start(self) -> None:
        if self.server is not None:
            try:
                self.server.start()
            except ApiError as e:
                log.warning("control: %s; the API is off", e)
                self.server = None
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        if self.server is not None:
            self.server.close()

    def metric_samples(self) -> list[MetricSample]:
        out = self.loop.metric_samples()
        if self.server is not None:
            s = self.server
            out += [MetricSample("sits_control_api_requests_total", {}, float(s.requests)),
                    MetricSample("sits_control_api_errors_total", {}, float(s.errors)),
                    MetricSample("sits_control_api_refused_total", {}, float(s.refused))]
        return out


