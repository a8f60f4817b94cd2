"""The reference server's batchers (examples/inference_model.Engine), run step by step on a
fake clock and a model that records each call: no thread, no HTTP, no BLAS."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("inference_model", ROOT / "examples" / "inference_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("inference_model", module)
    spec.loader.exec_module(module)
    return module


im = _load()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Recorder:
    """A model that costs `call_ms` of the fake clock per call, whatever the batch size (the
    step floor of a device that reads all weights once a call)."""

    def __init__(self, clock: Clock, call_ms: float = 10.0) -> None:
        self.shape = im.Shape(hidden=4, layers=1, vocab=97)
        self.clock = clock
        self.call_ms = call_ms
        self.calls: list[int] = []  # sequences in each call

    def forward(self, token_ids: list[Any], pooled: bool) -> tuple[list[int], list[Any]]:
        self.calls.append(len(token_ids))
        self.clock.t += self.call_ms / 1000
        return [1] * len(token_ids), []


def engine(batcher: str, window_ms: float, max_batch: int = 8, instances: int = 0
           ) -> tuple[Any, Recorder, Clock, list[Any]]:
    clock = Clock()
    model = Recorder(clock)
    events: list[Any] = []
    eng = im.Engine(model, events.extend, max_batch, window_ms, clock=clock, batcher=batcher,
                    instances=instances)
    return eng, model, clock, events


def arrive(eng: Any, clock: Clock, n: int, tokens: int = 3) -> list[Any]:
    seqs = [im.Sequence(np.arange(4, dtype=np.int64), tokens, arrival=clock.t) for _ in range(n)]
    for s in seqs:
        eng.submit(s)
    eng._drain(0.0)
    return seqs


def test_window_batcher_waits_the_window_then_runs_the_group_to_its_end() -> None:
    eng, model, clock, events = engine("window", window_ms=50)
    first = arrive(eng, clock, 2)
    eng.tick()
    assert model.calls == [] and eng.queue_depth() == 2  # the window is open: nothing runs
    clock.t += 0.049
    eng.tick()
    assert model.calls == []
    clock.t += 0.002
    eng.tick()  # the window closed: one group of 2, its prefill call
    assert model.calls == [2] and eng.stats.last_batch == 2
    late = arrive(eng, clock, 1)  # does not join the running group
    eng.tick()
    assert model.calls == [2, 2]
    assert eng.queue_depth() == 1  # the late one waits in its own window
    for _ in range(5):
        eng.tick()
    assert all(s.done for s in first)
    tokens = [e for e in events if e.seq in first]
    assert len(tokens) == 6 and sum(e.finished for e in tokens) == 2
    assert not late[0].done


def test_window_batcher_dispatches_a_full_batch_at_once_and_groups_take_turns() -> None:
    eng, model, clock, _ = engine("window", window_ms=1000, max_batch=4)
    arrive(eng, clock, 6)
    eng.tick()
    assert model.calls == [4]  # full: no wait; the other 2 wait for their window
    clock.t += 1.0
    eng.tick()  # the second group is dispatched; the turn is its
    eng.tick()
    assert model.calls == [4, 2, 4]  # one call per group, in turn: small groups cost calls
    assert eng.stats.last_batch == 2
    assert eng.stats.steps == 3


def test_window_batcher_bounds_the_groups_running_at_once() -> None:
    eng, model, clock, _ = engine("window", window_ms=0, max_batch=8, instances=1)
    arrive(eng, clock, 1)
    eng.tick()
    arrive(eng, clock, 3)  # the only instance is busy: these wait, then go as one group
    for _ in range(3):
        eng.tick()
    assert model.calls[:3] == [1, 1, 1]
    eng.tick()
    assert model.calls[3] == 3


def test_continuous_batcher_admits_late_arrivals_into_the_running_batch() -> None:
    eng, model, clock, _ = engine("continuous", window_ms=0)
    arrive(eng, clock, 2)
    eng.tick()
    arrive(eng, clock, 1)
    eng.tick()
    assert model.calls == [2, 3]  # one call for everyone running
    assert eng.stats.last_batch == 3


def test_an_unknown_batcher_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown batcher 'fifo'"):
        engine("fifo", 10)
