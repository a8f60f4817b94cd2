"""The closed loop: RCA verdicts and request latency -> batch window, CPU and GPU priorities.

verdicts (read the RCA's output) -> window (controllers) and actuators (cgroup CPU throttle)
-> loop (one interval's decisions, modes observe/advise/act) -> board + api (the control
socket a server asks). agent_hook builds it all from `[control]` for the agent.
"""

from .actuators import ActuatorError, CgroupCpuActuator, CpuAction, CpuHierarchy, find_cpu_hierarchy
from .api import ApiError, ControlServer, handle_line
from .board import DecisionBoard
from .loop import MODES, ControlLoop
from .verdicts import Cause, Culprit, JsonlVerdicts, PushedVerdicts, Verdict, read_verdict
from .window import (
    Aimd,
    Bounds,
    IntervalStats,
    PublishedRule,
    StaticWindow,
    VerdictWindow,
    make_controller,
)

__all__ = [
    "MODES", "ActuatorError", "Aimd", "ApiError", "Bounds", "Cause", "CgroupCpuActuator",
    "ControlLoop", "ControlServer", "CpuAction", "CpuHierarchy", "Culprit", "DecisionBoard",
    "IntervalStats", "JsonlVerdicts", "PublishedRule", "PushedVerdicts", "StaticWindow",
    "Verdict", "VerdictWindow", "find_cpu_hierarchy", "handle_line", "make_controller",
    "read_verdict",
]
