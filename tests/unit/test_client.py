"""sits_trace.client against a real Unix-socket server thread, and the pacer on a fake clock."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import socket
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_client() -> types.ModuleType:
    try:
        return importlib.import_module("sits_trace.client")
    except ImportError:  # packaging mapping not installed yet: load the folder itself
        name = "sits_trace_client_under_test"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "client" / "__init__.py",
            submodule_search_locations=[str(ROOT / "client")])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


client = _load_client()

GOOD = {"ok": True, "version": 3,
        "decisions": {"batch_window_ms": 7.5, "stream_priority": -1,
                      "copy_budget_bytes_per_s": 1e9, "cpu_actions": [{"kind": "nice"}]}}

Reply = Callable[[dict[str, Any]], bytes | None]


class Agent:
    """An agent stand-in on a real Unix socket: answers each request line with reply(request)."""

    def __init__(self, path: str, reply: Reply) -> None:
        self.requests: list[dict[str, Any]] = []
        self.reply = reply
        self.connections = 0
        self._conns: list[socket.socket] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        self._srv.listen(8)
        self._srv.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            self.connections += 1
            self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                request = json.loads(line)
                self.requests.append(request)
                out = self.reply(request)
                if out is not None:
                    conn.sendall(out)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._srv.close()
        for conn in self._conns:  # the agent is gone: so are its connections
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler


@pytest.fixture
def sock_path() -> Generator[str, None, None]:
    with tempfile.TemporaryDirectory() as d:  # short: AF_UNIX paths are limited to 108 bytes
        yield os.path.join(d, "c.sock")


def line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_get_returns_the_agents_decisions(sock_path: str) -> None:
    agent = Agent(sock_path, lambda r: line(GOOD if r["op"] == "get" else {"ok": True}))
    try:
        c = client.ControlClient(sock_path)
        d = c.decisions()
        assert d is not None
        assert (d.batch_window_ms, d.stream_priority, d.version) == (7.5, -1, 3)
        assert d.copy_budget_bytes_per_s == 1e9 and d.cpu_actions == ({"kind": "nice"},)
        assert c.batch_window_ms(default=2.0) == 7.5
        assert c.report(queue_depth=4, batch_size=2, service="llm") is True
        assert agent.requests[-1] == {"op": "report", "queue_depth": 4, "batch_size": 2,
                                      "service": "llm"}
        assert c.report(queue_depth=4, batch_size=2, service="llm", arrivals=17) is True
        assert agent.requests[-1]["arrivals"] == 17
        assert agent.connections == 1  # one connection kept for both
        c.close()
    finally:
        agent.close()


def test_no_agent_gives_the_default_and_does_not_retry_each_call(sock_path: str) -> None:
    clock = Clock()
    c = client.ControlClient(sock_path, refresh_ms=500, clock=clock)
    assert c.batch_window_ms(default=4.0) == 4.0
    assert c.report(1, 1, "llm") is False
    assert c.last_error is not None and "FileNotFoundError" in c.last_error
    agent = Agent(sock_path, lambda r: line(GOOD))
    try:
        clock.t += 0.2  # the agent is up now, but the last failure is too recent to ask again
        assert c.batch_window_ms(default=4.0) == 4.0
        assert agent.requests == []
        clock.t += 0.4
        assert c.batch_window_ms(default=4.0) == 7.5
    finally:
        agent.close()


@pytest.mark.parametrize("bad", [
    b"not json\n",
    line([1, 2]),
    line({"ok": False, "error": "busy"}),
    line({"ok": True, "version": 1}),
    line({"ok": True, "version": 1, "decisions": {"batch_window_ms": "5"}}),
    line({"ok": True, "version": 1, "decisions": {"batch_window_ms": -1}}),
    line({"ok": True, "version": 1, "decisions": {"stream_priority": 1.5}}),
    line({"ok": True, "version": True, "decisions": {}}),
    line({"ok": True, "version": 1, "decisions": {"cpu_actions": "renice"}}),
])
def test_bad_reply_gives_the_default_without_raising(sock_path: str, bad: bytes) -> None:
    agent = Agent(sock_path, lambda r: bad)
    try:
        c = client.ControlClient(sock_path)
        assert c.batch_window_ms(default=3.0) == 3.0
        assert c.decisions() is None
        assert c.last_error
    finally:
        agent.close()


def test_silent_agent_times_out_to_the_default(sock_path: str) -> None:
    agent = Agent(sock_path, lambda r: None)  # reads, never answers
    try:
        c = client.ControlClient(sock_path, timeout=0.05)
        assert c.batch_window_ms(default=9.0) == 9.0
        assert c.last_error is not None and "TimeoutError" in c.last_error
    finally:
        agent.close()


def test_decision_is_cached_then_reasked_then_forgotten_when_stale(sock_path: str) -> None:
    window = [5.0]

    def reply(r: dict[str, Any]) -> bytes:
        return line({"ok": True, "version": 1, "decisions": {"batch_window_ms": window[0]}})

    clock = Clock()
    agent = Agent(sock_path, reply)
    c = client.ControlClient(sock_path, refresh_ms=100, stale_ms=1000, clock=clock)
    try:
        assert c.batch_window_ms(1.0) == 5.0
        window[0] = 8.0
        clock.t += 0.05
        assert c.batch_window_ms(1.0) == 5.0  # cached
        assert len(agent.requests) == 1
        clock.t += 0.06
        assert c.batch_window_ms(1.0) == 8.0  # re-asked after refresh_ms
    finally:
        agent.close()
    clock.t += 0.2
    assert c.batch_window_ms(1.0) == 8.0  # agent gone: the last decision holds a while
    clock.t += 1.0
    assert c.batch_window_ms(1.0) == 1.0  # then the default


def test_null_decisions_mean_default(sock_path: str) -> None:
    nulls = {"ok": True, "version": 0, "decisions": {"batch_window_ms": None,
             "stream_priority": None, "copy_budget_bytes_per_s": None, "cpu_actions": []}}
    agent = Agent(sock_path, lambda r: line(nulls))
    try:
        c = client.ControlClient(sock_path)
        assert c.batch_window_ms(default=2.5) == 2.5
        assert c.copy_budget_bytes_per_s(default=None) is None
    finally:
        agent.close()


class FakeCuda:
    Stream: type | None = None

    def __init__(self, available: bool) -> None:
        self.available = available

    def is_available(self) -> bool:
        return self.available


class FakeStream:
    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, -3)  # what an H200 with torch 2.11 answers


def fake_torch(available: bool, ranged: bool = False) -> types.ModuleType:
    cuda = FakeCuda(available)
    if ranged:
        cuda.Stream = FakeStream
    m = types.ModuleType("torch")
    m.cuda = cuda  # type: ignore[attr-defined]
    return m


def test_stream_priority(sock_path: str) -> None:
    no_agent = client.ControlClient(sock_path)
    assert client.stream_priority(fake_torch(False), no_agent) is None
    assert client.stream_priority(fake_torch(True), no_agent) == 0
    priority = [-1]

    def reply(r: dict[str, Any]) -> bytes:
        return line({"ok": True, "version": 1, "decisions": {"stream_priority": priority[0]}})

    agent = Agent(sock_path, reply)
    try:
        assert client.stream_priority(fake_torch(True), client.ControlClient(sock_path)) == -1
        priority[0] = -9
        ranged = fake_torch(True, ranged=True)
        assert client.stream_priority(ranged, client.ControlClient(sock_path)) == -3  # clamped
        assert client.stream_priority(fake_torch(True), client.ControlClient(sock_path)) == -9
    finally:
        agent.close()


class SimClock:
    """Time that only moves when the pacer sleeps (or the copy takes time)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def test_pacer_stays_within_budget() -> None:
    clk = SimClock()
    pacer = client.CopyPacer(1_000_000, chunk_bytes=100_000, clock=clk.now, sleep=clk.sleep)
    copied: list[tuple[int, int, float]] = []
    stats = pacer.copy(1_050_000, lambda off, n: copied.append((off, n, clk.t)))
    assert [(o, n) for o, n, _ in copied] == [(i * 100_000, 100_000) for i in range(10)] + [
        (1_000_000, 50_000)]
    assert stats.bytes == 1_050_000 and stats.chunks == 11
    # the bucket starts with one chunk; every later byte waits for the budget
    assert clk.t == pytest.approx((1_050_000 - 100_000) / 1_000_000)
    for _, _, t in copied:  # never ahead of the budget at any point
        assert sum(n for _, n, t2 in copied if t2 <= t) <= 100_000 + t * 1_000_000 + 1e-6
    assert max(clk.sleeps) <= 0.05 + 1e-12


def test_pacer_budget_change_applies_to_the_next_chunk() -> None:
    clk = SimClock()
    pacer = client.CopyPacer(1_000_000, chunk_bytes=100_000, clock=clk.now, sleep=clk.sleep)
    times: list[float] = []

    def copy_range(off: int, n: int) -> None:
        times.append(clk.t)
        if len(times) == 5:
            pacer.set_budget(10_000_000)

    pacer.copy(1_000_000, copy_range)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[1:4] == pytest.approx([0.1] * 3)
    assert gaps[5:] == pytest.approx([0.01] * 4)


def test_pacer_without_budget_copies_at_once_and_stop_ends_early() -> None:
    clk = SimClock()
    pacer = client.CopyPacer(None, chunk_bytes=10, clock=clk.now, sleep=clk.sleep)
    got: list[int] = []
    assert pacer.copy(95, lambda off, n: got.append(n)).bytes == 95
    assert got == [10] * 9 + [5] and clk.sleeps == []
    stop = threading.Event()
    pacer.set_budget(10.0)

    def copy_range(off: int, n: int) -> None:
        if off == 20:
            stop.set()

    assert pacer.copy(1000, copy_range, stop=stop).bytes == 30
    with pytest.raises(ValueError):
        pacer.set_budget(0)
