"""A verdict: which objective a service missed in a window, and the ranked causes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .slo import Breach

Culprit = dict[str, Any]  # {"pid", "name"} | {"peer"} | {"gpu"}


@dataclass(slots=True)
class Evidence:
    signal: str
    baseline: float
    observed: float

    def to_json(self) -> dict[str, Any]:
        return {"signal": self.signal, "baseline": _r(self.baseline),
                "observed": _r(self.observed)}


@dataclass(slots=True)
class CauseScore:
    cause: str
    score: float
    culprit: Culprit | None = None
    evidence: list[Evidence] = field(default_factory=list)
    explained_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "score": round(self.score, 4), "culprit": self.culprit,
                "evidence": [e.to_json() for e in self.evidence],
                "explained_ms": round(self.explained_ms, 3)}


@dataclass(slots=True)
class Verdict:
    time_unix_nano: int  # when the verdict was made
    service: str
    route: str | None
    breach: Breach
    causes: list[CauseScore]
    window_start_unix_nano: int = 0
    window_end_unix_nano: int = 0
    kind: str = "SERVER"  # the spans judged: the service's SERVER spans, or CLIENT for a client
    features: dict[str, float] = field(default_factory=dict)  # what the model saw (not printed)

    def to_json(self) -> dict[str, Any]:
        return {
            "time_unix_nano": self.time_unix_nano, "service": self.service, "route": self.route,
            "breach": self.breach.to_json(), "causes": [c.to_json() for c in self.causes],
            "window": {"start_unix_nano": self.window_start_unix_nano,
                       "end_unix_nano": self.window_end_unix_nano},
            "kind": self.kind,
        }

    def top(self) -> CauseScore | None:
        return self.causes[0] if self.causes else None

    def line(self) -> str:
        """One readable line: service, breach, top causes with culprit and ms explained."""
        b = self.breach
        route = f" {self.route}" if self.route else ""
        parts = [f"{self.service}{route}: {b.objective} {b.observed:.1f} > {b.target:.1f}"]
        for c in self.causes[:3]:
            who = f" [{_culprit(c.culprit)}]" if c.culprit else ""
            parts.append(f"{c.cause} {c.score:.2f}{who} {c.explained_ms:+.1f} ms")
        return " | ".join(parts)


def _culprit(c: Culprit) -> str:
    if "pid" in c:
        return f"pid {c['pid']} {c.get('name', '')}".strip()
    if "peer" in c:
        return f"peer {c['peer']}"
    return f"gpu {c.get('gpu')}"


def _r(x: float) -> float:
    return round(float(x), 4)
