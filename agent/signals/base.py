"""What the agent's loop asks of a signal group (signals/node.py: tcp + sched; signals/gpu.py:
cuda + nvml). Each is built from the loaded kernel by its own `from_kernel`, after its module
added its programs, tracepoints and defines to the LoadOptions (`load_additions` /
`cuda_options`); doctor rows come from each module's `doctor_checks()`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sits_trace.agent.model import Provider

if TYPE_CHECKING:
    from sits_trace.agent.tracing.pipeline import Tracer


class Signal(Protocol):
    def install(self, tracer: Tracer) -> None:
        """Register record handlers, data observers and span annotators with the tracer."""

    def providers(self) -> dict[str, Provider]:
        """Per-second feature-frame providers, by group name."""

    def poll(self) -> None:
        """Each loop: read what the kernel accumulated (maps, slots)."""

    def check_process(self, pid: int) -> None:
        """A process ran exec: probe libraries it maps, if any are new."""

    def forget(self, pid: int) -> None:
        """A process exited: drop what is kept for it."""

    def stop(self) -> None: ...
