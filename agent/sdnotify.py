"""systemd's readiness and watchdog protocol (sd_notify), spoken directly: one datagram to
$NOTIFY_SOCKET. Outside systemd (no $NOTIFY_SOCKET) every call is a no-op that returns False."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send e.g. "READY=1" or "WATCHDOG=1"; True when a datagram was sent."""
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr  # "@": the abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(target)
            s.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval_s(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Half of WatchdogSec= when systemd asked this process for pings, else None."""
    e = os.environ if env is None else env
    usec, owner = e.get("WATCHDOG_USEC", ""), e.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    return int(usec) / 2e6
