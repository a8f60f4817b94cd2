"""install-service/uninstall-service under a root folder, the unit's ExecStart, and sd_notify."""

from __future__ import annotations

import socket
from pathlib import Path

from sits_trace.agent import sdnotify
from sits_trace.agent.config import load
from sits_trace.agent.service import DEFAULT_EXEC, install, render_unit, uninstall
from sits_trace.agent.surface import Surface
from sits_trace.analyzers.live import LiveView


def test_install_and_uninstall_under_a_root(tmp_path: Path) -> None:
    exe = Path("/srv/sits/.venv/bin/sits-trace")
    calls: list[list[str]] = []
    lines = list(install(tmp_path, exe, run=lambda c: calls.append(c) or 0))
    unit = (tmp_path / "etc/systemd/system/sits-trace.service").read_text()
    assert f"ExecStart={exe} run --config /etc/sits-trace/config.toml" in unit
    assert DEFAULT_EXEC not in unit and "Type=notify" in unit and "DynamicUser=yes" in unit
    conf = tmp_path / "etc/sits-trace/config.toml"
    assert load(conf, env={}).export.jsonl_path == ""  # no span flood into the journal
    assert calls == [] and "not the init system" in lines[-1]  # a folder is not a live systemd
    conf.write_text("[trace]\nport = 80\n")
    assert any("kept" in x for x in install(tmp_path, exe, run=lambda c: 0))
    assert conf.read_text() == "[trace]\nport = 80\n"
    list(uninstall(tmp_path, purge=True, run=lambda c: 0))
    assert not (tmp_path / "etc/systemd/system/sits-trace.service").exists()
    assert not conf.exists()


def test_capabilities_in_unit_are_bounded_and_ambient() -> None:
    unit = render_unit(Path("/x"))
    caps = {line.split("=", 1)[0]: set(line.split("=", 1)[1].split())
            for line in unit.splitlines() if line.startswith(("CapabilityBoundingSet=",
                                                             "AmbientCapabilities="))}
    # CAP_SYS_ADMIN for uprobes, no CAP_DAC_OVERRIDE: found under systemd (test_systemd_nspawn)
    want = {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN", "CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"}
    assert caps == {"CapabilityBoundingSet": want, "AmbientCapabilities": want}


def test_notify_datagrams(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": str(path)})
        assert s.recv(100) == b"READY=1"
    assert not sdnotify.notify("READY=1", {})
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"},
                                        pid=2) is None
    assert sdnotify.watchdog_interval_s({}) is None


class _Agent:
    heartbeat = 0.0
    features = None

    def stats(self) -> dict[str, object]:
        return {}


def test_watchdog_pings_only_while_the_loop_turns() -> None:
    now = [100.0]
    sent: list[str] = []
    agent = _Agent()
    s = Surface("", agent, LiveView(), notify=lambda m: sent.append(m) or True, watchdog_s=1.0,
                monotonic=lambda: now[0])
    agent.heartbeat = 99.5
    assert s.alive(1.0)
    agent.heartbeat = 97.0  # stuck for 3 s: more than WatchdogSec (2 pings)
    assert not s.alive(1.0)
    s.start()
    s.stop()
    assert sent[0].startswith("READY=1") and sent[-1] == "STOPPING=1"


def test_an_installation_under_tmp_is_bound_back_into_the_private_tmp() -> None:
    unit = render_unit(Path("/tmp/ci/checkout/.venv/bin/sits-trace"))
    assert "PrivateTmp=yes\nBindReadOnlyPaths=/tmp/ci/checkout\n" in unit
    assert "BindReadOnlyPaths" not in render_unit(Path("/opt/sits-trace/.venv/bin/sits-trace"))


def test_act_drop_in_is_installed_with_act_and_removed_without(tmp_path: Path) -> None:
    exe = Path("/srv/sits/.venv/bin/sits-trace")
    dropin = tmp_path / "etc/systemd/system/sits-trace.service.d/act.conf"
    conf = tmp_path / "etc/sits-trace/config.toml"
    lines = list(install(tmp_path, exe, run=lambda c: 0, act=True))
    text = dropin.read_text()
    for line in ("User=root", "DynamicUser=no", "ProtectControlGroups=no",
                 "CapabilityBoundingSet=CAP_SYS_NICE CAP_DAC_OVERRIDE",
                 "AmbientCapabilities=CAP_SYS_NICE CAP_DAC_OVERRIDE",
                 "RuntimeDirectoryPreserve=yes"):
        assert line in text.splitlines(), line
    assert load(conf, env={}).control.mode == "act"  # a fresh config acts
    assert any("act.conf" in x for x in lines)
    # a kept config that does not act is named, not rewritten
    conf.write_text('[control]\nmode = "advise"\n')
    lines = list(install(tmp_path, exe, run=lambda c: 0, act=True))
    assert any('set it to "act"' in x for x in lines) and "advise" in conf.read_text()
    # a plain reinstall goes back to the least privileges
    lines = list(install(tmp_path, exe, run=lambda c: 0))
    assert not dropin.exists() and any("removed" in x and "act.conf" in x for x in lines)
    list(install(tmp_path, exe, run=lambda c: 0, act=True))
    list(uninstall(tmp_path, run=lambda c: 0))
    assert not dropin.exists() and not dropin.parent.exists()
