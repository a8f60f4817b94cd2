"""A tolerant reader of RCA verdicts, the controllers' input.

A verdict is what the RCA says about one SLO breach (or its absence) of one service:

    {"time_unix_nano": int, "service": str, "route": str, "breach": bool,
     "causes": [{"cause": str, "score": float, "culprit": {"pid", "name"} | {"peer"} | {"gpu"}
                 | null, "evidence": ..., "explained_ms": float}, ...]}   (ranked, best first)

The reader takes that JSON form or any object with those attributes (a dataclass), keeps what
it understands and maps an unknown cause name to "unknown": a newer RCA never breaks the loop.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAUSES = frozenset({
    "cpu_starvation", "host_memory_pressure", "network_delay", "network_loss",
    "pcie_contention", "gpu_compute_contention", "gpu_throttling", "gpu_memory_pressure",
    "request_mix_shift", "server_queueing", "slow_dependency", "unknown",
})
# causes a larger batch window cannot fix: the time is lost outside the batcher
NOT_BATCHING = frozenset({
    "cpu_starvation", "host_memory_pressure", "network_delay", "network_loss",
    "pcie_contention", "gpu_compute_contention", "gpu_throttling", "gpu_memory_pressure",
    "slow_dependency",
})
# causes whose culprit process the CPU actuator may throttle
CPU_ACTIONABLE = frozenset({"cpu_starvation", "pcie_contention", "gpu_compute_contention"})


class VerdictError(ValueError):
    """A verdict that cannot be read; the message says which field."""


@dataclass(frozen=True)
class Culprit:
    pid: int | None = None
    name: str | None = None
    peer: str | None = None
    gpu: int | None = None


@dataclass(frozen=True)
class Cause:
    cause: str
    score: float
    culprit: Culprit | None = None
    explained_ms: float = 0.0


@dataclass(frozen=True)
class Verdict:
    time_unix_nano: int
    service: str
    route: str
    breach: bool
    causes: tuple[Cause, ...]

    def top(self) -> Cause | None:
        return self.causes[0] if self.causes else None


def _as_mapping(obj: object) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    raise VerdictError(f"a verdict is an object, not {type(obj).__name__}")


def _int(v: object) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    try:
        return int(v)
    except ValueError:
        return None


def _float(v: object, default: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return default
    return float(v)


def read_culprit(obj: object) -> Culprit | None:
    if obj is None:
        return None
    m = _as_mapping(obj)
    name, peer = m.get("name"), m.get("peer")
    c = Culprit(pid=_int(m.get("pid")), name=name if isinstance(name, str) else None,
                peer=str(peer) if peer is not None else None, gpu=_int(m.get("gpu")))
    return None if c == Culprit() else c


def read_cause(obj: object) -> Cause:
    m = _as_mapping(obj)
    name = m.get("cause")
    if not isinstance(name, str):
        raise VerdictError("cause: missing or not a string")
    return Cause(cause=name if name in CAUSES else "unknown", score=_float(m.get("score")),
                 culprit=read_culprit(m.get("culprit")),
                 explained_ms=_float(m.get("explained_ms")))


def read_verdict(obj: object) -> Verdict:
    """A Verdict from the JSON form (or an object with its fields); VerdictError if unusable."""
    m = _as_mapping(obj)
    t = _int(m.get("time_unix_nano"))
    service = m.get("service")
    if t is None:
        raise VerdictError("time_unix_nano: missing or not an integer")
    if not isinstance(service, str):
        raise VerdictError("service: missing or not a string")
    raw = m.get("causes") or []
    if not isinstance(raw, (list, tuple)):
        raise VerdictError("causes: not a list")
    route = m.get("route")
    return Verdict(time_unix_nano=t, service=service,
                   route=route if isinstance(route, str) else "",
                   breach=bool(m.get("breach", True)),
                   causes=tuple(read_cause(c) for c in raw))


VerdictSource = Callable[[], list[Verdict]]


class JsonlVerdicts:
    """New verdicts appended to a JSON-lines file since the last call (the RCA's output).

    A bad line is skipped and counted; a file that shrank (rotated) is read from the start.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bad_lines = 0
        self._offset = 0
        self._partial = b""

    def __call__(self) -> list[Verdict]:
        try:
            with self.path.open("rb") as f:
                size = f.seek(0, 2)
                if size < self._offset:
                    self._offset, self._partial = 0, b""
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except OSError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return list(self._parse(lines))

    def _parse(self, lines: list[bytes]) -> Iterator[Verdict]:
        for line in lines:
            if not line.strip():
                continue
            try:
                yield read_verdict(json.loads(line))
            except (ValueError, VerdictError):
                self.bad_lines += 1


class PushedVerdicts:
    """Verdicts handed over in process (by the RCA in the agent, or a benchmark)."""

    def __init__(self) -> None:
        self._pending: collections.deque[Verdict] = collections.deque(maxlen=10000)

    def push(self, verdict: object) -> None:
        self._pending.append(verdict if isinstance(verdict, Verdict) else read_verdict(verdict))

    def __call__(self) -> list[Verdict]:
        out: list[Verdict] = []
        while self._pending:
            out.append(self._pending.popleft())  # deque ends are thread-safe
        return out
