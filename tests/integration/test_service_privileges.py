"""`sits-trace run` as an unprivileged user holding only the unit's capabilities (setpriv, the
same ambient set systemd gives it), told by $NOTIFY_SOCKET/$WATCHDOG_USEC to speak sd_notify:
READY=1 after the probes attach, WATCHDOG=1 pings, STOPPING=1, spans of real traffic, and the
API answering. (PID 1 of this test machine is not systemd; docs/systemd.md says what that
leaves unproven.)"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from .harness import SITS, curl, python_server

pytestmark = pytest.mark.bpf

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "sits-trace.service"
USER = "sits-trace-test"


def unit_caps() -> list[str]:
    line = next(x for x in UNIT.read_text().splitlines() if x.startswith("AmbientCapabilities="))
    return [c.lower().removeprefix("cap_") for c in line.split("=", 1)[1].split()]


def ensure_user() -> None:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-r", "-M", "-s", "/usr/sbin/nologin", USER], check=True)


def test_run_with_the_units_capabilities_only() -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    ensure_user()
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # pytest's tmp_path is root-only
        os.chmod(d, 0o777)
        _run_unprivileged(Path(d))


def _run_unprivileged(tmp_path: Path) -> None:
    caps = ",".join(f"+{c}" for c in unit_caps())
    notify = tmp_path / "notify"
    spans = tmp_path / "spans.jsonl"
    sock = tmp_path / "run" / "api.sock"
    cfg = tmp_path / "c.toml"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ns, python_server() as (port, _):
        ns.bind(str(notify))
        os.chmod(notify, 0o777)
        ns.settimeout(120)
        cfg.write_text(f'[trace]\ncpu_budget = 0\n[export]\njsonl_path = "{spans}"\n'
                       f'[api]\nsocket = "{sock}"\n'
                       f'[control]\nsocket_path = "{tmp_path / "run" / "control.sock"}"\n')
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NOTIFY_SOCKET": str(notify),
               "WATCHDOG_USEC": "2000000", "SITS_STATS_PATH": str(tmp_path / "stats.json")}
        p = subprocess.Popen(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups",
                              f"--inh-caps={caps}", f"--ambient-caps={caps}", "--no-new-privs",
                              SITS, "run", "-c", str(cfg)], env=env,
                             stderr=subprocess.PIPE, text=True)
        try:
            assert ns.recv(200).startswith(b"READY=1"), p.stderr
            ns.settimeout(5)
            curl(f"http://127.0.0.1:{port}/unprivileged", rid="caps-only")
            assert ns.recv(100) == b"WATCHDOG=1"
            out = subprocess.run([SITS, "top", "--once", "--json", "--socket", str(sock)],
                                 check=True, capture_output=True, text=True, timeout=30).stdout
            assert json.loads(out)["source"] == "daemon"
        finally:
            p.terminate()
            _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        msgs = []
        ns.settimeout(1)
        while True:
            try:
                msgs.append(ns.recv(100))
            except OSError:
                break
        assert b"STOPPING=1" in msgs
    # uprobes (libssl) attached too: without CAP_SYS_ADMIN the uprobe PMU says EACCES and BCC's
    # tracefs fallback fails with "perf_event_open(...uprobes/...): Invalid argument"
    assert "Permission denied" not in err and "Invalid argument" not in err, err
    mine = [json.loads(x) for x in spans.read_text().splitlines()
            if '"caps-only"' in x]
    assert {s["kind"] for s in mine} == {"SERVER", "CLIENT"}
    assert os.stat(spans).st_uid == pwd.getpwnam(USER).pw_uid  # it really ran as that user
