"""Which local processes serve an address: a CLIENT span's callee on this node, found through
the kernel's socket diagnostics (pyroute2) and the owners of the listening socket's inode.

Used once per verdict that blames a dependency, never per span: a dependency on this node that
waited for a CPU is a symptom of the CPU competition, not a slow dependency.
"""

from __future__ import annotations

import ipaddress
import os
import socket

_LISTEN = 1 << 10  # TCP_LISTEN in the diag state mask


def split_peer(peer: str) -> tuple[str, int] | None:
    """("127.0.0.1", 8080) from "127.0.0.1:8080" or "[::1]:8080"; None without a port."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _node_addresses() -> set[str]:
    from pyroute2 import IPRoute  # noqa: PLC0415 - only when a verdict names a dependency

    with IPRoute() as ip:
        return {str(a.get_attr("IFA_ADDRESS")) for a in ip.get_addr()}


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: not resolved here (the analysis never waits on DNS)
    return addr.is_loopback or addr.is_unspecified or str(addr) in _node_addresses()


def _listening_inodes(host: str, port: int) -> set[int]:
    from pyroute2 import DiagSocket  # noqa: PLC0415

    out: set[int] = set()
    wildcard = {"0.0.0.0", "::"}
    with DiagSocket() as ds:
        ds.bind()
        for family in (socket.AF_INET, socket.AF_INET6):
            for m in ds.get_sock_stats(family=family, states=_LISTEN):
                src = str(m.get("idiag_src", ""))
                if m.get("idiag_sport") == port and (src in wildcard or src == host
                                                     or host == "localhost"
                                                     or src.endswith(":" + host)):
                    out.add(int(m.get("idiag_inode", 0)))
    return out - {0}


def _owners(inodes: set[int], proc_root: str = "/proc") -> set[int]:
    want = {f"socket:[{i}]" for i in inodes}
    pids: set[int] = set()
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        fd_dir = f"{proc_root}/{name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in want:
                    pids.add(int(name))
                    break
            except OSError:
                continue
    return pids


def local_pids(peer: str) -> set[int]:
    """The processes on this node listening where `peer` ("host:port") points; empty for a
    remote peer, a name, or anything that cannot be read (the caller loses nothing)."""
    hp = split_peer(peer)
    if hp is None:
        return set()
    try:
        if not is_local(hp[0]):
            return set()
        inodes = _listening_inodes(*hp)
        return _owners(inodes) if inodes else set()
    except (OSError, ImportError, ValueError):
        return set()
