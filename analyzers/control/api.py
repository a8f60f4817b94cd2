"""The control API: a Unix stream socket that serves decisions and takes servers' reports.

JSON lines, one request a line, one reply a line, on a connection kept as long as the
client likes:

    {"op": "get"}  ->  {"ok": true, "decisions": {"batch_window_ms", "stream_priority",
                        "copy_budget_bytes_per_s", "cpu_actions"}, "version": N}
    {"op": "report", "queue_depth": N, "batch_size": N, "service": "name",
     "arrivals": N (optional: requests received since the server started)}  ->  {"ok": true}
    anything else  ->  {"ok": false, "error": "one line"}

The socket is owned by root (the agent's user), mode 0660, group `group` (root's when
empty). A peer is also checked with SO_PEERCRED: root, the agent's own user, or a member of
the group; anyone else gets one error line and is disconnected. A line longer than 64 KiB
ends the connection; at most `max_clients` connections at once.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import select
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .board import DecisionBoard

log = logging.getLogger(__name__)
MAX_LINE = 64 * 1024
DEFAULT_SOCKET = Path("/run/sits-trace/control.sock")


class ApiError(RuntimeError):
    """The socket cannot be set up; the message says what to do."""


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(conn: socket.socket) -> PeerCred:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def resolve_group(name: str) -> int:
    """The gid of a group name or number ("" is 0, root's group); ApiError if unknown."""
    if not name:
        return 0
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ApiError(f"control.socket_group: no group {name!r} on this node") from None


def allowed(peer: PeerCred, own_uid: int, gid: int, members: frozenset[int]) -> bool:
    """Root, the agent's user, the group (primary), or one of its listed members."""
    return peer.uid in (0, own_uid) or peer.gid == gid or peer.uid in members


def group_members(gid: int) -> frozenset[int]:
    try:
        names = grp.getgrgid(gid).gr_mem
    except KeyError:
        return frozenset()
    uids = set()
    for n in names:
        try:
            uids.add(pwd.getpwnam(n).pw_uid)
        except KeyError:
            continue
    return frozenset(uids)


def handle_line(board: DecisionBoard, line: bytes) -> dict[str, Any]:
    """One request line's reply; never raises."""
    try:
        req = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return _error("request is not JSON")
    except RecursionError:
        return _error("request is nested too deeply")
    if not isinstance(req, dict):
        return _error("request is not a JSON object")
    op = req.get("op")
    if op == "get":
        decisions, version = board.snapshot()
        return {"ok": True, "decisions": decisions, "version": version}
    if op == "report":
        return _report(board, req)
    return _error(f"unknown op {op!r} (get, report)")


def _report(board: DecisionBoard, req: dict[str, Any]) -> dict[str, Any]:
    q, b, service = req.get("queue_depth"), req.get("batch_size"), req.get("service")
    for name, v in (("queue_depth", q), ("batch_size", b)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**31:
            return _error(f"{name} must be an integer 0..2^31")
    if not isinstance(service, str) or not 0 < len(service) <= 256:
        return _error("service must be a string of 1..256 characters")
    assert isinstance(q, int) and isinstance(b, int)
    arrivals = req.get("arrivals")
    if arrivals is not None and (isinstance(arrivals, bool) or not isinstance(arrivals, int)
                                 or not 0 <= arrivals < 2**63):
        return _error("arrivals must be an integer 0..2^63")
    if not board.report(service, q, b, arrivals):
        return _error("too many services reporting")
    return {"ok": True}


def _error(msg: str) -> dict[str, Any]:
    return {"ok": False, "error": msg}


class ControlServer:
    """Accepts and serves connections on its own threads; `close()` stops and unlinks."""

    def __init__(self, board: DecisionBoard, path: Path = DEFAULT_SOCKET, group: str = "",
                 mode: int = 0o660, max_clients: int = 32, idle_timeout_s: float = 300.0) -> None:
        self.board = board
        self.path = path
        # "" is root's group, which a non-root agent (systemd's DynamicUser) cannot give its
        # socket (chown: EPERM): its own group then, which keeps the socket to root and itself
        self.gid = resolve_group(group) if group or os.geteuid() == 0 else os.getegid()
        self.mode = mode
        self.max_clients = max_clients
        self.idle_timeout_s = idle_timeout_s
        self.refused = 0
        self.errors = 0
        self.requests = 0
        self._members = group_members(self.gid)
        self._uid = os.geteuid()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._clients = threading.BoundedSemaphore(max_clients)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._prepare_path()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # no window in which the socket is open to all
            try:
                s.bind(str(self.path))
            finally:
                os.umask(old)
            os.chown(self.path, self._uid, self.gid)
            os.chmod(self.path, self.mode)
            s.listen(16)
        except OSError as e:
            s.close()
            raise ApiError(f"control socket {self.path}: {e.strerror or e} "
                           "(run as root, or set control.socket_path)") from None
        self._sock = s
        self._warn_unreachable()
        self._thread = threading.Thread(target=self._accept_loop, name="control-api", daemon=True)
        self._thread.start()

    def _warn_unreachable(self) -> None:
        """The group cannot reach the socket when a directory above it denies them search
        (e.g. /run/sits-trace made 0750 root:root by another server): say so, change nothing."""
        if self.gid == 0:
            return
        for d in self.path.parents:
            st = d.stat()
            if not (st.st_mode & 0o001 or (st.st_gid == self.gid and st.st_mode & 0o010)):
                log.warning("control API: group %d cannot search %s (mode %o, group %d); "
                            "its members cannot reach %s: chmod o+x or chgrp it",
                            self.gid, d, stat.S_IMODE(st.st_mode), st.st_gid, self.path)
                return
            if d == Path("/"):
                return

    def _prepare_path(self) -> None:
        try:
            self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            if self.path.exists() or self.path.is_symlink():
                if not stat.S_ISSOCK(self.path.lstat().st_mode):
                    raise ApiError(f"control socket {self.path}: exists and is not a socket")
                if _listening(self.path):
                    raise ApiError(f"control socket {self.path}: another agent serves it")
                self.path.unlink()  # a stale socket of an agent that died
        except OSError as e:
            raise ApiError(f"control socket {self.path}: {e.strerror or e}") from None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                self.path.unlink()
            except OSError:
                pass

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sock], [], [], 0.2)
            if not ready:
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            if not self._clients.acquire(blocking=False):
                _send(conn, _error("too many clients"))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="control-client").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer = peer_cred(conn)
            if not allowed(peer, self._uid, self.gid, self._members):
                self.refused += 1
                log.warning("control API: refused pid %d uid %d", peer.pid, peer.uid)
                _send(conn, _error(f"uid {peer.uid} is not allowed (root or group {self.gid})"))
                return
            self._lines(conn)
        except OSError:
            pass
        finally:
            conn.close()
            self._clients.release()

    def _lines(self, conn: socket.socket) -> None:
        buf = b""
        idle_until = time.monotonic() + self.idle_timeout_s
        while not self._stop.is_set() and time.monotonic() < idle_until:
            ready, _, _ = select.select([conn], [], [], min(0.5, self.idle_timeout_s))
            if not ready:
                continue
            idle_until = time.monotonic() + self.idle_timeout_s
            chunk = conn.recv(4096)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                self._answer(conn, line)
            if len(buf) > MAX_LINE:
                self.errors += 1
                _send(conn, _error(f"request line longer than {MAX_LINE} bytes"))
                return

    def _answer(self, conn: socket.socket, line: bytes) -> None:
        if not line.strip():
            return
        self.requests += 1
        reply = handle_line(self.board, line)
        if not reply.get("ok"):
            self.errors += 1
        _send(conn, reply)


def _listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    except OSError:
        pass
