"""The control loop on the real node, as root: the API's permissions against another user, and
cgroup throttles undone on SIGTERM and when the cause clears, nothing touched in observe or
advise. Runs the loop as its own process (`python -m sits_trace.analyzers.control`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sits_trace.analyzers.control.actuators import PREFIX, find_cpu_hierarchy
from sits_trace.analyzers.control.api import ControlServer
from sits_trace.analyzers.control.board import DecisionBoard

# `bpf` is this suite's "needs root" marker: skipped without it, a failure in CI
pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(find_cpu_hierarchy() is None, reason="no cpu cgroup controller")]
NOBODY = 65534


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sits-control-", dir="/run"))
    d.chmod(0o755)  # another user may reach the socket; the socket's own mode decides
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def as_user(uid: int, gid: int, fn: Callable[[], str]) -> str:
    """fn() in a forked child that dropped to uid/gid; its result string."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = f"exception {type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        result = f.read().decode()
    os.waitpid(pid, 0)
    return result


def ask_get(path: Path) -> Callable[[], str]:
    def go() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            try:
                s.connect(str(path))
            except OSError as e:
                return f"connect {e.errno}"
            s.sendall(b'{"op":"get"}\n')
            data = s.recv(65536)
            return data.decode().strip() or "closed"
    return go


def test_another_user_is_refused_by_mode(run_dir: Path) -> None:
    srv = ControlServer(DecisionBoard(), run_dir / "c.sock")  # root:root 0660
    srv.start()
    try:
        out = as_user(NOBODY, NOBODY, ask_get(srv.path))
        assert out == "connect 13"  # EACCES: not even connected
        assert json.loads(ask_get(srv.path)())["ok"] is True  # root is served
    finally:
        srv.close()


def test_another_user_is_refused_by_peercred_even_if_the_file_is_open(run_dir: Path) -> None:
    srv = ControlServer(DecisionBoard(), run_dir / "c.sock", mode=0o666)
    srv.start()
    try:
        reply = json.loads(as_user(NOBODY, NOBODY, ask_get(srv.path)))
        assert reply["ok"] is False and "not allowed" in reply["error"]
        assert srv.refused == 1
    finally:
        srv.close()


def test_the_configured_group_is_served(run_dir: Path) -> None:
    srv = ControlServer(DecisionBoard(), run_dir / "c.sock", group=str(NOBODY))
    srv.start()
    try:
        srv.board.publish(batch_window_ms=30.0)
        reply = json.loads(as_user(NOBODY, NOBODY, ask_get(srv.path)))
        assert reply["ok"] is True and reply["decisions"]["batch_window_ms"] == 30.0
    finally:
        srv.close()


def test_a_directory_the_group_cannot_search_is_reported(run_dir: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    run_dir.chmod(0o750)  # root:root, as another server may have made /run/sits-trace
    srv = ControlServer(DecisionBoard(), run_dir / "c.sock", group=str(NOBODY))
    with caplog.at_level("WARNING"):
        srv.start()
    try:
        assert "cannot search" in caplog.text
        assert as_user(NOBODY, NOBODY, ask_get(srv.path)) == "connect 13"
    finally:
        srv.close()


# -- the loop as a process, acting on a real culprit ---------------------------------------

CPU = find_cpu_hierarchy()


def cpu_cgroup(pid: int) -> str:
    assert CPU is not None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if (CPU.version == 2 and hid == "0") or (CPU.version == 1 and "cpu" in ctrls.split(",")):
            return path
    return "/"


def throttle_dirs() -> list[Path]:
    assert CPU is not None
    return [p for p in CPU.mount.rglob(f"{PREFIX}*") if p.is_dir()]


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.fixture
def culprit() -> Iterator[subprocess.Popen[bytes]]:
    """A process with a child, both asleep (a CPU hog is not needed to be moved)."""
    p = subprocess.Popen(["sh", "-c", "sleep 120 & sleep 120; wait"], start_new_session=True)
    time.sleep(0.3)
    yield p
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def child_of(pid: int) -> int:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(kids[0])


def start_loop(tmp: Path, mode: str, pid: int, clear_after: float = 60.0,
               socket_path: str = "") -> subprocess.Popen[bytes]:
    v = {"time_unix_nano": time.time_ns(), "service": "llm", "route": "/", "breach": True,
         "causes": [{"cause": "cpu_starvation", "score": 0.9,
                     "culprit": {"pid": pid, "name": "sh"}, "explained_ms": 100}]}
    (tmp / "verdicts.jsonl").write_text(json.dumps(v) + "\n")
    env = {**os.environ, "SITS_CONTROL_INTERVAL_S": "0.2"}
    return subprocess.Popen(
        [sys.executable, "-m", "sits_trace.analyzers.control", "--mode", mode,
         "--socket", socket_path, "--verdicts", str(tmp / "verdicts.jsonl"),
         "--state", str(tmp / "state.json"), "--clear-after", str(clear_after)],
        env=env, stderr=subprocess.PIPE)


def stop(p: subprocess.Popen[bytes]) -> str:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=15)
    assert p.returncode == 0, err.decode()
    return err.decode()


def test_act_throttles_and_sigterm_undoes(tmp_path: Path,
                                          culprit: subprocess.Popen[bytes]) -> None:
    home, kid = cpu_cgroup(culprit.pid), child_of(culprit.pid)
    loop = start_loop(tmp_path, "act", culprit.pid)
    try:
        assert wait_for(lambda: PREFIX in cpu_cgroup(culprit.pid)), "never throttled"
        assert PREFIX in cpu_cgroup(kid)  # its descendants too
        (d,) = throttle_dirs()
        limit = (d / ("cpu.max" if CPU and CPU.version == 2 else "cpu.cfs_quota_us")).read_text()
        assert limit.split()[0] == "25000"
    finally:
        err = stop(loop)
    assert "actions undone" in err
    assert cpu_cgroup(culprit.pid) == home and cpu_cgroup(kid) == home
    assert throttle_dirs() == []
    assert culprit.poll() is None  # throttled and released, never killed


def test_act_undoes_when_the_cause_clears(tmp_path: Path,
                                          culprit: subprocess.Popen[bytes]) -> None:
    home = cpu_cgroup(culprit.pid)
    loop = start_loop(tmp_path, "act", culprit.pid, clear_after=1.0)
    try:
        assert wait_for(lambda: PREFIX in cpu_cgroup(culprit.pid)), "never throttled"
        # asleep, it uses nothing of its cap: the cause has cleared, the throttle goes
        assert wait_for(lambda: cpu_cgroup(culprit.pid) == home, timeout=10)
        assert wait_for(lambda: throttle_dirs() == [], timeout=5)
    finally:
        stop(loop)


def test_act_undoes_when_the_culprit_exits(tmp_path: Path,
                                           culprit: subprocess.Popen[bytes]) -> None:
    loop = start_loop(tmp_path, "act", culprit.pid)
    try:
        assert wait_for(lambda: len(throttle_dirs()) == 1), "never throttled"
        os.killpg(culprit.pid, signal.SIGKILL)
        culprit.wait()
        assert wait_for(lambda: throttle_dirs() == [], timeout=10)
    finally:
        stop(loop)


@pytest.mark.parametrize("mode", ["observe", "advise"])
def test_observe_and_advise_touch_nothing(tmp_path: Path, mode: str,
                                          culprit: subprocess.Popen[bytes]) -> None:
    home = cpu_cgroup(culprit.pid)
    sock = Path(tempfile.mkdtemp(prefix="sits-control-", dir="/run")) / "c.sock"
    loop = start_loop(tmp_path, mode, culprit.pid, socket_path=str(sock))
    try:
        assert wait_for(sock.exists)
        got: dict[str, Any] = {}

        def published() -> bool:
            got.update(json.loads(ask_get(sock)()))
            return bool(got["decisions"]["cpu_actions"]) or mode == "observe"

        assert wait_for(published)
        time.sleep(1.0)  # several intervals
        assert cpu_cgroup(culprit.pid) == home and throttle_dirs() == []
        acts = json.loads(ask_get(sock)())["decisions"]["cpu_actions"]
        if mode == "advise":
            assert [(a["pid"], a["applied"]) for a in acts] == [(culprit.pid, False)]
        else:
            assert acts == []
    finally:
        stop(loop)
        sock.parent.rmdir()
