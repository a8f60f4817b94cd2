from __future__ import annotations

import os
from pathlib import Path

from sits_trace.agent.tracing.procfs import ProcFS, parse_proc_net_tcp

# captured from this machine: nginx listening on 127.0.0.1:18080, one client connected
PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:46A0 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 31337 1 0000000000000000 100 0 0 10 0
   1: 0100007F:46A0 0100007F:D4F2 01 00000000:00000000 00:00000000 00000000     0        0 31338 1 0000000000000000 20 4 30 10 -1
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:1F90 0000000000000000FFFF00000100007F:B7A2 01 00000000:00000000 00:00000000 00000000     0        0 40001 1 0000000000000000 20 4 0 10 -1
"""


def test_parse_ipv4_and_ipv6_mapped() -> None:
    socks = parse_proc_net_tcp(PROC_NET_TCP) + parse_proc_net_tcp(PROC_NET_TCP6)
    by_ino = {s.inode: s for s in socks}
    assert by_ino[31337].local_port == 18080 and by_ino[31337].state == 0x0A
    assert by_ino[31338].remote_address == "127.0.0.1" and by_ino[31338].remote_port == 54514
    assert by_ino[40001].local_address == "127.0.0.1" and by_ino[40001].local_port == 8080


def test_fake_proc_tree(tmp_path: Path) -> None:
    pid = tmp_path / "42"
    (pid / "fd").mkdir(parents=True)
    (pid / "net").mkdir()
    (pid / "net" / "tcp").write_text(PROC_NET_TCP)
    (pid / "comm").write_text("nginx\n")
    os.symlink("socket:[31337]", pid / "fd" / "6")
    os.symlink("/dev/null", pid / "fd" / "0")
    fs = ProcFS(str(tmp_path))
    assert fs.socket_fds(42) == {6: 31337}
    assert fs.tcp_sockets(42)[31337].local_port == 18080
    assert fs.comm(42) == "nginx"
    assert fs.pids() == [42]
    assert fs.socket_inode(42, 99) is None


def _tree(tmp_path: Path, pids: list[int], ns: str) -> None:
    for p in pids:
        d = tmp_path / str(p)
        (d / "net").mkdir(parents=True)
        (d / "ns").mkdir()
        (d / "net" / "tcp").write_text(PROC_NET_TCP)
        os.symlink(ns, d / "ns" / "net")


def test_socket_lookups_parse_one_table_per_namespace_per_ttl(tmp_path: Path) -> None:
    # issue 10: 100 new connections/s each re-read /proc/<pid>/net/tcp{,6}; with thousands
    # of TIME_WAIT sockets that was 85% of the agent's time
    _tree(tmp_path, [42, 43], "net:[4026531840]")
    _tree(tmp_path, [77], "net:[4026532000]")
    t = [0.0]
    fs = ProcFS(str(tmp_path), table_ttl_s=1.0, monotonic=lambda: t[0])
    for _ in range(50):
        assert fs.tcp_socket(42, 31338) is not None
        assert fs.tcp_socket(43, 31337) is not None  # same namespace: same table
        assert fs.tcp_socket(42, 99999) is None  # unknown inode: negative until the ttl
    assert fs.table_reads == 1
    assert fs.tcp_socket(77, 31338) is not None
    assert fs.table_reads == 2
    t[0] = 1.5  # expired: a missing inode reads the table again, once
    assert fs.tcp_socket(42, 99999) is None
    assert fs.tcp_socket(42, 99999) is None
    assert fs.table_reads == 3
    assert fs.tcp_socket(42, 31338) is not None  # a hit never rereads
    assert fs.table_reads == 3
