"""The API socket: JSON lines over a Unix socket, mode 0600, stale sockets, errors answered."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest
from sits_trace.agent.api import ApiError, ApiServer, answer, query


def test_serves_ops_and_answers_errors(tmp_path: Path) -> None:
    path = tmp_path / "run" / "api.sock"
    calls: list[int] = []
    server = ApiServer(path, {"ping": lambda: {"ok": True},
                              "snapshot": lambda: calls.append(1) or {"routes": [1]},
                              "boom": lambda: 1 / 0})
    server.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
        assert query(path, "snapshot") == {"routes": [1]} and calls == [1]
        with pytest.raises(ApiError, match="unknown op 'nope' \\(allowed: boom, ping, snapshot\\)"):
            query(path, "nope")
        with pytest.raises(ApiError, match="ZeroDivisionError"):
            query(path, "boom")
        with socket.socket(socket.AF_UNIX) as s:  # several requests on one connection
            s.connect(str(path))
            s.sendall(b'{"op":"ping"}\n{"op":"ping"}\n')
            data = b""
            while data.count(b"\n") < 2:
                data += s.recv(100)
        assert data == b'{"ok":true}\n{"ok":true}\n'
        with pytest.raises(ApiError, match="another sits-trace daemon"):
            ApiServer(path, {}).start()
    finally:
        server.stop()
    assert not path.exists()
    with pytest.raises(ApiError, match="api socket"):
        query(path, "ping")


def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))  # bound, never listening: nobody answers
    dead.close()
    server = ApiServer(path, {"ping": lambda: {"ok": True}})
    server.start()
    try:
        assert query(path, "ping") == {"ok": True}
    finally:
        server.stop()


def test_answer_rejects_bad_requests() -> None:
    assert "not JSON" in answer({}, b"{nope\n")["error"]
    assert "unknown op None" in answer({}, b"[1]\n")["error"]
    assert "longer than" in answer({}, b"x" * 5000)["error"]
