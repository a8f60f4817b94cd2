"""What /proc says about sockets and processes. The root is passed in, so tests use a fake tree."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

TCP_LISTEN = 0x0A
TCP_ESTABLISHED = 0x01


@dataclass(frozen=True, slots=True)
class TcpSocket:
    inode: int
    local_address: str
    local_port: int
    remote_address: str
    remote_port: int
    state: int


def _hex_addr(h: str) -> str:
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc/net/tcp6 prints four host-order 32-bit words
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    addr = ipaddress.IPv6Address(words)
    return str(addr.ipv4_mapped or addr)


def parse_proc_net_tcp(text: str) -> list[TcpSocket]:
    out: list[TcpSocket] = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            la, lp = f[1].split(":")
            ra, rp = f[2].split(":")
            out.append(TcpSocket(int(f[9]), _hex_addr(la), int(lp, 16), _hex_addr(ra),
                                 int(rp, 16), int(f[3], 16)))
        except ValueError:
            continue
    return out


class ProcFS:
    def __init__(self, root: str = "/proc", *, table_ttl_s: float = 1.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self._ttl = table_ttl_s
        self._now = monotonic
        # network namespace -> (read at, sockets by inode): one whole-table parse per
        # namespace per ttl, however many connections ask (a host with thousands of
        # TIME_WAIT sockets makes each parse cost milliseconds)
        self._tables: dict[str, tuple[float, dict[int, TcpSocket]]] = {}
        self.table_reads = 0  # whole-table parses so far

    def tcp_socket(self, pid: int, inode: int) -> TcpSocket | None:
        """The socket `inode` of `pid`'s network namespace, from a table at most ttl old;
        an inode missing from a fresh table is not looked for again until it expires."""
        try:
            ns = os.readlink(f"{self.root}/{pid}/ns/net")
        except OSError:
            ns = f"pid:{pid}"
        now = self._now()
        hit = self._tables.get(ns)
        if hit is not None:
            sock = hit[1].get(inode)
            if sock is not None or now - hit[0] < self._ttl:
                return sock
        table = self.tcp_sockets(pid)
        self.table_reads += 1
        if len(self._tables) > 256:
            self._tables.clear()
        self._tables[ns] = (now, table)
        return table.get(inode)

    def tcp_sockets(self, pid: int | None = None) -> dict[int, TcpSocket]:
        """TCP sockets by inode, from the network namespace of `pid` (or of the agent)."""
        base = f"{self.root}/{pid}/net" if pid else f"{self.root}/net"
        out: dict[int, TcpSocket] = {}
        for name in ("tcp", "tcp6"):
            try:
                with open(f"{base}/{name}") as f:
                    for s in parse_proc_net_tcp(f.read()):
                        out[s.inode] = s
            except OSError:
                continue
        return out

    def socket_inode(self, pid: int, fd: int) -> int | None:
        try:
            target = os.readlink(f"{self.root}/{pid}/fd/{fd}")
        except OSError:
            return None
        if target.startswith("socket:["):
            return int(target[8:-1])
        return None

    def socket_fds(self, pid: int) -> dict[int, int]:
        """fd -> socket inode for every socket the process holds."""
        out: dict[int, int] = {}
        try:
            names = os.listdir(f"{self.root}/{pid}/fd")
        except OSError:
            return out
        for n in names:
            ino = self.socket_inode(pid, int(n))
            if ino is not None:
                out[int(n)] = ino
        return out

    def comm(self, pid: int) -> str:
        try:
            with open(f"{self.root}/{pid}/comm") as f:
                return f.read().strip()
        except OSError:
            return ""

    def exe_name(self, pid: int) -> str:
        try:
            return os.path.basename(os.readlink(f"{self.root}/{pid}/exe"))
        except OSError:
            return self.comm(pid)

    def pids(self) -> list[int]:
        try:
            return sorted(int(n) for n in os.listdir(self.root) if n.isdigit())
        except OSError:
            return []

    def children(self, pid: int) -> list[int]:
        """Descendants of pid (through /proc/<pid>/task/*/children)."""
        out: list[int] = []
        todo = [pid]
        while todo:
            p = todo.pop()
            try:
                tasks = os.listdir(f"{self.root}/{p}/task")
            except OSError:
                continue
            for t in tasks:
                try:
                    with open(f"{self.root}/{p}/task/{t}/children") as f:
                        kids = [int(x) for x in f.read().split()]
                except OSError:
                    continue
                out.extend(kids)
                todo.extend(kids)
        return out
