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
