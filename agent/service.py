"""`sits-trace install-service` / `uninstall-service`: the systemd unit (systemd/sits-trace.service
with ExecStart pointing at this installation), /etc/sits-trace/config.toml (kept when present),
then `systemctl daemon-reload` and `enable --now` when systemd is the init system."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

UNIT_NAME = "sits-trace.service"
UNIT_SOURCE = Path(__file__).resolve().parent.parent / "systemd" / UNIT_NAME
ACT_SOURCE = UNIT_SOURCE.with_name("sits-trace-act.conf")  # the drop-in for control.mode "act"
ACT_DROPIN = f"{UNIT_NAME}.d/act.conf"
DEFAULT_EXEC = "/opt/sits-trace/.venv/bin/sits-trace"
Runner = Callable[[list[str]], int]


class ServiceError(RuntimeError):
    """Cannot install or remove the service; the message says why."""


def render_unit(executable: Path, source: Path = UNIT_SOURCE) -> str:
    try:
        text = source.read_text()
    except OSError as exc:
        raise ServiceError(f"unit template {source}: {exc.strerror}") from None
    text = text.replace(DEFAULT_EXEC, str(executable))
    if any(executable.is_relative_to(t) for t in (Path("/tmp"), Path("/var/tmp"))):
        # PrivateTmp gives the service an empty /tmp, which hides an installation (a venv and
        # its checkout) living there: bind that folder back in, read-only
        root = executable.parents[2] if len(executable.parents) > 2 else executable.parent
        text = text.replace("PrivateTmp=yes\n", f"PrivateTmp=yes\nBindReadOnlyPaths={root}\n", 1)
    return text


def service_config(act: bool = False) -> str:
    """The defaults, with spans to no JSON stdout (the journal is not a span store); with
    `act`, the control loop acts."""
    from .configdoc import defaults_toml  # noqa: PLC0415 - only when installing

    text = defaults_toml().replace('jsonl_path = "-"', 'jsonl_path = ""', 1)
    return text.replace('mode = "advise"', 'mode = "act"', 1) if act else text


def _control_mode(conf: Path) -> str:
    from .config import ConfigError, load  # noqa: PLC0415 - only when installing

    try:
        return load(conf, env={}).control.mode
    except ConfigError:
        return "?"


def systemd_running(root: Path) -> bool:
    return root == Path("/") and Path("/run/systemd/system").is_dir()


def _run(cmd: list[str]) -> int:
    return subprocess.run(cmd, check=False).returncode


def install(root: Path, executable: Path, enable: bool = True, run: Runner = _run,
            act: bool = False) -> Iterator[str]:
    unit = root / "etc/systemd/system" / UNIT_NAME
    dropin = root / "etc/systemd/system" / ACT_DROPIN
    conf = root / "etc/sits-trace/config.toml"
    text = render_unit(executable)
    try:
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(text)
        yield f"wrote {unit}"
        if act:
            dropin.parent.mkdir(parents=True, exist_ok=True)
            dropin.write_text(ACT_SOURCE.read_text())
            yield f"wrote {dropin} (root, CAP_SYS_NICE, CAP_DAC_OVERRIDE: control.mode act)"
        elif dropin.exists():
            dropin.unlink()
            yield f"removed {dropin} (the unit is back to its least privileges)"
        if conf.exists():
            yield f"kept {conf}"
            if act and _control_mode(conf) != "act":
                yield f'{conf} has control.mode = "{_control_mode(conf)}": set it to "act"'
        else:
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(service_config(act))
            yield f"wrote {conf}"
    except OSError as exc:
        raise ServiceError(f"{exc.filename}: {exc.strerror} (run as root)") from None
    if not systemd_running(root):
        yield "systemd is not the init system here: start it with `systemctl enable --now " \
              "sits-trace` where it is"
        return
    if run(["systemctl", "daemon-reload"]) != 0:
        raise ServiceError("systemctl daemon-reload failed")
    if enable:
        # restart, not `enable --now`: a reinstall over a running service must take effect
        if run(["systemctl", "enable", UNIT_NAME]) != 0 or \
                run(["systemctl", "restart", UNIT_NAME]) != 0:
            raise ServiceError("systemctl enable/restart sits-trace failed: "
                               "see journalctl -u sits-trace")
        yield "enabled and started sits-trace.service"


def uninstall(root: Path, purge: bool = False, run: Runner = _run) -> Iterator[str]:
    unit = root / "etc/systemd/system" / UNIT_NAME
    if systemd_running(root):
        run(["systemctl", "disable", "--now", UNIT_NAME])
    try:
        if unit.exists():
            unit.unlink()
            yield f"removed {unit}"
        dropin = root / "etc/systemd/system" / ACT_DROPIN
        if dropin.exists():
            dropin.unlink()
            yield f"removed {dropin}"
            if not any(dropin.parent.iterdir()):
                dropin.parent.rmdir()
        if purge and (root / "etc/sits-trace").exists():
            shutil.rmtree(root / "etc/sits-trace")
            yield f"removed {root / 'etc/sits-trace'}"
    except OSError as exc:
        raise ServiceError(f"{exc.filename}: {exc.strerror} (run as root)") from None
    if systemd_running(root):
        run(["systemctl", "daemon-reload"])
