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
import sys
import tempfile
import time
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


DROPIN = UNIT.with_name("sits-trace-act.conf")
# what `control.mode = "act"` does to a culprit and to the served process, then undoes; prints
# one JSON line (the actuators' own errors, or what they did)
ACT_PROBE = r"""
import json, sys
from pathlib import Path
from sits_trace.analyzers.control.actuators import CgroupCpuActuator, find_cpu_hierarchy
from sits_trace.analyzers.control.deadline import DeadlineReserver
culprit, served, state = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
out = {}
throttle = CgroupCpuActuator(find_cpu_hierarchy(), state_path=state / "throttle.json")
try:
    a = throttle.apply(throttle.plan("cpu_starvation", culprit))
    out["cgroup"] = a.cgroup
    out["moved"] = any(a.cgroup in line for line in open(f"/proc/{culprit}/cgroup"))
    throttle.revert(culprit)
except Exception as e:
    out["throttle_error"] = str(e)
reserver = DeadlineReserver(state_path=state / "reserve.json")
try:
    r = reserver.apply(reserver.plan("cpu_starvation", served))
    out["reserved_cpus"] = r.cpus
    reserver.revert(served)
except Exception as e:
    out["reserve_error"] = str(e)
print(json.dumps(out))
"""
BUSY = "import time\nwhile True:\n t = time.perf_counter()\n while time.perf_counter() - t < 0.003: pass\n time.sleep(0.02)"


def _caps(path: Path, key: str = "AmbientCapabilities=") -> list[str]:
    return [c.lower().removeprefix("cap_") for x in path.read_text().splitlines()
            if x.startswith(key) for c in x.split("=", 1)[1].split()]


def _probe(prefix: list[str], culprit: int, served: int, state: Path) -> dict[str, object]:
    r = subprocess.run([*prefix, sys.executable, "-c", ACT_PROBE, str(culprit), str(served),
                        str(state)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_act_drop_in_grants_what_throttles_and_reservations_need() -> None:
    """The act drop-in's process (root, the unit's capabilities plus the drop-in's, no new
    privileges) throttles another process into a cgroup and reserves CPU for another's thread,
    and undoes both; the plain unit's dynamic user with its capabilities can do neither."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    ensure_user()
    assert {"User=root", "DynamicUser=no"} <= set(DROPIN.read_text().splitlines())
    caps = ",".join(f"+{c}" for c in unit_caps() + _caps(DROPIN))
    as_root = ["setpriv", f"--bounding-set=-all,{caps}", "--inh-caps=-all", "--no-new-privs"]
    base = ",".join(f"+{c}" for c in unit_caps())
    as_user = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups",
               f"--inh-caps={base}", f"--ambient-caps={base}", "--no-new-privs"]
    culprit = subprocess.Popen(["sleep", "120"])
    served = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.5)
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            os.chmod(d, 0o777)
            home = Path(f"/proc/{culprit.pid}/cgroup").read_text()
            act = _probe(as_root, culprit.pid, served.pid, Path(d))
            assert act.get("moved") is True, act
            assert float(str(act.get("reserved_cpus", 0))) > 0, act
            assert Path(f"/proc/{culprit.pid}/cgroup").read_text() == home  # undone
            assert os.sched_getscheduler(served.pid) == os.SCHED_OTHER  # undone
            plain = _probe(as_user, culprit.pid, served.pid, Path(d))
            assert "throttle_error" in plain and "reserve_error" in plain, plain
            assert "Operation not permitted" in str(plain["reserve_error"]), plain
    finally:
        for p in (culprit, served):
            p.kill()
            p.wait()
