"""The control API: the protocol, bad messages, the peer policy; a live socket in tmp."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sits_trace.analyzers.control.api import (
    MAX_LINE,
    ApiError,
    ControlServer,
    PeerCred,
    allowed,
    handle_line,
)
from sits_trace.analyzers.control.board import DecisionBoard


def ask(board: DecisionBoard, obj: Any) -> dict[str, Any]:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    reply: dict[str, Any] = handle_line(board, raw)
    return reply


def test_get_serves_decisions_and_version() -> None:
    b = DecisionBoard()
    r = ask(b, {"op": "get"})
    assert r == {"ok": True, "version": 0, "decisions": {
        "batch_window_ms": None, "stream_priority": None, "copy_budget_bytes_per_s": None,
        "cpu_actions": []}}
    assert b.publish(batch_window_ms=25.0)
    assert not b.publish(batch_window_ms=25.0)  # unchanged: same version
    r = ask(b, {"op": "get"})
    assert r["decisions"]["batch_window_ms"] == 25.0 and r["version"] == 1


def test_report_is_summed_per_service() -> None:
    b = DecisionBoard()
    for q, n in ((4, 2), (8, 6)):
        assert ask(b, {"op": "report", "queue_depth": q, "batch_size": n, "service": "llm"}) \
            == {"ok": True}
    s = b.take_reports("llm")
    assert s is not None and (s.reports, s.mean_batch_size, s.mean_queue_depth) == (2, 4, 6)
    assert b.take_reports("llm") is None


def test_arrivals_are_a_running_count_taken_as_differences() -> None:
    b = DecisionBoard()

    def report(arrivals: int | None) -> None:
        req = {"op": "report", "queue_depth": 0, "batch_size": 1, "service": "llm"}
        if arrivals is not None:
            req["arrivals"] = arrivals
        assert ask(b, req) == {"ok": True}

    report(100)
    s = b.take_reports("llm")
    assert s is not None and s.arrivals is None  # no count to take a difference from yet
    report(120)
    report(None)  # a report without the count keeps the last one
    report(130)
    s = b.take_reports("llm")
    assert s is not None and s.arrivals == 30  # 100 -> 130; a lost report loses nothing
    report(5)  # the server restarted
    s = b.take_reports("llm")
    assert s is not None and s.arrivals is None
    report(9)
    s = b.take_reports("llm")
    assert s is not None and s.arrivals == 4


@pytest.mark.parametrize("line", [
    b"not json", b"\xff\xfe", b"[1,2]", b'"get"', b"{}", b'{"op":"put"}',
    b'{"op":"report","queue_depth":-1,"batch_size":1,"service":"s"}',
    b'{"op":"report","queue_depth":1.5,"batch_size":1,"service":"s"}',
    b'{"op":"report","queue_depth":true,"batch_size":1,"service":"s"}',
    b'{"op":"report","queue_depth":1,"batch_size":1,"service":""}',
    b'{"op":"report","queue_depth":1,"batch_size":1}',
    b'{"op":"report","queue_depth":1,"batch_size":1,"service":"s","arrivals":-3}',
    b'{"op":"report","queue_depth":1,"batch_size":1,"service":"s","arrivals":"7"}',
    b'{"op":"report","queue_depth":1,"batch_size":1,"service":"s","arrivals":1e30}',
    b"[" * 60000 + b"]" * 60000,
])
def test_bad_messages_get_one_line_errors(line: bytes) -> None:
    r = handle_line(DecisionBoard(), line)
    assert r["ok"] is False and isinstance(r["error"], str) and "\n" not in r["error"]


def test_too_many_services_refused() -> None:
    b = DecisionBoard(max_services=1)
    assert ask(b, {"op": "report", "queue_depth": 0, "batch_size": 1, "service": "a"})["ok"]
    assert not ask(b, {"op": "report", "queue_depth": 0, "batch_size": 1, "service": "b"})["ok"]


def test_peer_policy() -> None:
    members = frozenset({1001})
    assert allowed(PeerCred(1, 0, 0), own_uid=0, gid=50, members=members)  # root
    assert allowed(PeerCred(1, 1002, 50), own_uid=0, gid=50, members=members)  # group
    assert allowed(PeerCred(1, 1001, 9), own_uid=0, gid=50, members=members)  # member
    assert not allowed(PeerCred(1, 65534, 65534), own_uid=0, gid=50, members=members)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControlServer]:
    srv = ControlServer(DecisionBoard(), tmp_path / "run" / "control.sock",
                        group=str(os.getegid()))
    srv.start()
    yield srv
    srv.close()


def _lines(sock: socket.socket, n: int) -> list[dict[str, Any]]:
    buf = b""
    while buf.count(b"\n") < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return [json.loads(x) for x in buf.splitlines()]


def test_socket_mode_and_owner(server: ControlServer) -> None:
    st = server.path.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())


def test_live_bad_messages_then_good_on_one_connection(server: ControlServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(server.path))
        s.sendall(b"garbage\n{\"op\": 7}\n\n{\"op\":\"get\"}\n")
        a, b, c = _lines(s, 3)
    assert not a["ok"] and not b["ok"] and c["ok"] and c["version"] == 0
    assert server.errors == 2


def test_overlong_line_ends_that_connection_only(server: ControlServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(server.path))
        s.sendall(b"x" * (MAX_LINE + 10))
        (r,) = _lines(s, 1)
        assert not r["ok"] and "longer" in r["error"]
        assert s.recv(10) == b""  # closed
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # the server still serves
        s.settimeout(5)
        s.connect(str(server.path))
        s.sendall(b'{"op":"get"}\n')
        assert _lines(s, 1)[0]["ok"]


def test_the_servers_client_library_follows_it(server: ControlServer) -> None:
    client_mod = pytest.importorskip("sits_trace.client")
    if not hasattr(client_mod, "ControlClient"):
        pytest.skip("sits_trace.client.ControlClient is not on this branch yet")
    client = client_mod.ControlClient(str(server.path), refresh_ms=0)
    server.board.publish(batch_window_ms=42.0)
    assert client.batch_window_ms(default=5.0) == 42.0
    assert client.report(queue_depth=3, batch_size=2, service="llm")
    rep = server.board.take_reports("llm")
    assert rep is not None and rep.mean_queue_depth == 3
    client.close()


def test_a_live_agent_socket_is_not_stolen(server: ControlServer) -> None:
    second = ControlServer(DecisionBoard(), server.path)
    with pytest.raises(ApiError, match="another agent"):
        second.start()


def test_a_stale_socket_is_replaced_and_a_file_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(p))
    stale.close()  # bound, never listening: what a killed agent leaves
    srv = ControlServer(DecisionBoard(), p)
    srv.start()
    srv.close()
    assert not p.exists()
    p.write_text("not a socket")
    with pytest.raises(ApiError, match="not a socket"):
        ControlServer(DecisionBoard(), p).start()


def test_unknown_group_is_one_line_error() -> None:
    with pytest.raises(ApiError, match="no group"):
        ControlServer(DecisionBoard(), Path("/nonexistent/c.sock"), group="no-such-group-x")
