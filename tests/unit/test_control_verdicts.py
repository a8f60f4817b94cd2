"""The tolerant verdict reader: JSON form, dataclass form, files appended to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sits_trace.analyzers.control.verdicts import (
    JsonlVerdicts,
    PushedVerdicts,
    VerdictError,
    read_verdict,
)

V = {"time_unix_nano": 1, "service": "llm", "route": "/v1/completions", "breach": True,
     "causes": [{"cause": "cpu_starvation", "score": 0.9,
                 "culprit": {"pid": 42, "name": "stress-ng"}, "evidence": {"x": 1},
                 "explained_ms": 120.0},
                {"cause": "network_delay", "score": 0.2, "culprit": {"peer": "10.0.0.2:80"}}]}


def test_reads_the_json_form() -> None:
    v = read_verdict(V)
    top = v.top()
    assert top is not None and top.cause == "cpu_starvation" and top.culprit is not None
    assert (top.culprit.pid, top.culprit.name, top.explained_ms) == (42, "stress-ng", 120.0)
    assert v.causes[1].culprit is not None and v.causes[1].culprit.peer == "10.0.0.2:80"


def test_unknown_cause_and_extra_keys_are_tolerated() -> None:
    v = read_verdict({**V, "new_key": 1, "causes": [{"cause": "cosmic_rays", "score": "x"}]})
    top = v.top()
    assert top is not None and top.cause == "unknown" and top.score == 0.0


def test_dataclass_form() -> None:
    @dataclass
    class C:
        cause: str
        score: float
        culprit: Any = None

    @dataclass
    class D:
        time_unix_nano: int
        service: str
        route: str
        breach: bool
        causes: list[C] = field(default_factory=list)

    v = read_verdict(D(5, "s", "/", False, [C("gpu_throttling", 0.7, {"gpu": 0})]))
    assert not v.breach and v.causes[0].culprit is not None and v.causes[0].culprit.gpu == 0


@pytest.mark.parametrize("bad", [{}, {"time_unix_nano": 1}, {"service": "s"},
                                 {**V, "causes": "x"}, {**V, "causes": [{"score": 1}]}, 3])
def test_unusable_verdicts_raise_verdict_error(bad: Any) -> None:
    with pytest.raises(VerdictError):
        read_verdict(bad)


def test_jsonl_reads_new_lines_only_and_skips_bad(tmp_path: Path) -> None:
    p = tmp_path / "v.jsonl"
    src = JsonlVerdicts(p)
    assert src() == []  # no file yet
    p.write_text(json.dumps(V) + "\nnot json\n" + json.dumps(V)[:10])
    assert [v.service for v in src()] == ["llm"] and src.bad_lines == 1
    with p.open("a") as f:
        f.write(json.dumps(V)[10:] + "\n")
    assert len(src()) == 1  # the line finished by the second write
    assert src() == []
    p.write_text(json.dumps(V) + "\n")  # rotated: shorter than what was read
    assert len(src()) == 1


def test_pushed() -> None:
    src = PushedVerdicts()
    src.push(V)
    src.push(read_verdict(V))
    assert len(src()) == 2 and src() == []
