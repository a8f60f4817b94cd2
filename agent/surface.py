"""What an operator sees of a running agent: the live view, its read-only API socket, and
systemd's readiness and watchdog notifications.

    live = LiveView(...)
    agent = Agent(cfg, live.tee(sink)); agent.start()
    surface = Surface(cfg.api.socket, agent, live); surface.start()   # READY=1 after attach
    agent.run(stop); surface.stop()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from sits_trace.agent.model import AgentStats, Row
from sits_trace.analyzers.live import LiveView

from . import sdnotify
from .api import ApiServer, Op


class _Frame(Protocol):
    def latest(self) -> Row: ...


class AgentLike(Protocol):
    heartbeat: float

    def stats(self) -> AgentStats: ...

    @property
    def features(self) -> Any: ...


def snapshot(agent: AgentLike, live: LiveView, source: str = "daemon",
             slowest: bool = True) -> dict[str, Any]:
    """The `snapshot` op: the live view with the newest feature row and the agent's stats
    (`summary`: the same without each route's slowest spans)."""
    frame: _Frame | None = agent.features
    row = frame.latest() if frame is not None else {}
    out: dict[str, Any] = live.snapshot(row=row, agent_stats=agent.stats().to_json(), slowest=slowest)
    out["source"] = source
    return out


def ops(agent: AgentLike, live: LiveView) -> dict[str, Op]:
    return {
        "ping": lambda: {"ok": True},
        "snapshot": lambda: snapshot(agent, live),
        "summary": lambda: snapshot(agent, live, slowest=False),
        "stats": lambda: agent.stats().to_json(),
    }


class Surface:
    def __init__(self, socket_path: str, agent: AgentLike, live: LiveView,
                 notify: Callable[[str], bool] = sdnotify.notify,
                 watchdog_s: float | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.api = ApiServer(socket_path, ops(agent, live)) if socket_path else None
        self.agent = agent
        self._notify = notify
        self._watchdog_s = watchdog_s if watchdog_s is not None else sdnotify.watchdog_interval_s()
        self._now = monotonic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve the API, then tell systemd the agent is ready (its probes are attached).
        Raises api.ApiError."""
        if self.api is not None:
            self.api.start()
        self._notify("READY=1\nSTATUS=tracing")
        if self._watchdog_s:
            self._thread = threading.Thread(target=self._watch, args=(self._watchdog_s,),
                                            name="sits-watchdog", daemon=True)
            self._thread.start()

    def alive(self, every_s: float) -> bool:
        """The agent's loop turned within the last two ping intervals (one WatchdogSec)."""
        return self._now() - self.agent.heartbeat < 2 * every_s

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            if self.alive(every_s):  # a stuck loop stops the pings and systemd restarts us
                self._notify("WATCHDOG=1")

    def stop(self) -> None:
        self._notify("STOPPING=1")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.api is not None:
            self.api.stop()


def operator_surface(cfg: Any, agent: AgentLike, live: LiveView,
                     fail: Callable[[str], None]) -> Surface:
    """Start the surface for `cfg` ([api] socket), or end in one line through `fail`."""
    from .api import ApiError  # noqa: PLC0415 - only when the surface starts

    surface = Surface(cfg.api.socket, agent, live)
    try:
        surface.start()
    except ApiError as exc:
        fail(str(exc))
    return surface
