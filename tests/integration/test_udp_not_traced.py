"""A connected UDP socket is not an HTTP connection. A traced process connect()s UDP sockets
for its resolver's queries and its metrics (statsd); http.c registered each as a client
connection, so every DNS lookup was a connection opened and closed and two data records the
parser could not use, and a statsd client a record per metric until the agent muted it.
http.c now reads the socket's type at connect (the BTF socket walk) and registers stream
sockets only. TCP connections of the same process are traced as before."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sits_trace.agent.capture import loader
from sits_trace.agent.capture.events import ConnEvent, DataEvent, Kind, decode

pytestmark = pytest.mark.bpf

N = 40
# the traced process (the agent never traces its own pid): on each line of stdin, a phase
CHILD = r"""
import json, socket, sys
sys.stdin.readline()
server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
server.bind(("127.0.0.1", 0))
for i in range(N_LOOKUPS):  # a resolver's pattern: a socket, connect, a query, an answer, close
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
        c.connect(server.getsockname())
        c.send(b"query " + str(i).encode())
        data, addr = server.recvfrom(64)
        server.sendto(b"answer", addr)
        assert c.recv(64) == b"answer"
server.close()
print("udp", flush=True)
sys.stdin.readline()
lst = socket.create_server(("127.0.0.1", 0))
cli = socket.create_connection(lst.getsockname())
srv, _ = lst.accept()
cli.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
assert srv.recv(100).startswith(b"GET")
srv.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
assert cli.recv(100).startswith(b"HTTP/1.1 204")
print(json.dumps({cli.fileno(): cli.getsockname()[1], srv.fileno(): srv.getsockname()[1]}),
      flush=True)
sys.stdin.readline()
""".replace("N_LOOKUPS", str(N))


@pytest.fixture()
def child() -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def drain(ring: loader.RingSource, pid: int) -> list[ConnEvent | DataEvent]:
    out: list[ConnEvent | DataEvent] = []
    for _ in range(20):
        recs = ring.read(50)
        if not recs and out:
            break
        for r in recs:
            ev = decode(r)
            if isinstance(ev, (ConnEvent, DataEvent)) and ev.pid == pid:
                out.append(ev)
    return out


def step(p: subprocess.Popen[str]) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def test_connected_udp_sockets_are_not_registered(child: subprocess.Popen[str]) -> None:
    kernel = loader.load(loader.LoadOptions(tls=False, target_pids=[child.pid]))
    try:
        if "SITS_SOCK_WALK" not in kernel.defines:
            pytest.skip("no kernel BTF: the socket walk is compiled out")
        ring = loader.RingSource(kernel)
        assert step(child) == "udp"
        udp = drain(ring, child.pid)
        # a TCP exchange of the same process after them: each end's fd and local port
        ports = {int(fd): port for fd, port in json.loads(step(child)).items()}
        tcp = drain(ring, child.pid)
        step(child)
    finally:
        kernel.bpf.cleanup()
    opens = {e.fd: e.local_port for e in tcp
             if isinstance(e, ConnEvent) and e.kind == Kind.CONN_OPEN}
    data = [e for e in tcp if isinstance(e, DataEvent)]
    print(f"{N} UDP lookups: {len(udp)} records; TCP: {len(opens)} opened, "
          f"{len(data)} data records")
    assert udp == []
    # the client's connect and the server's accept: still traced, each with its local port
    # read from the socket in the kernel (at connect, from the walk that read its type)
    assert opens == ports
    assert len(data) == 4  # each side's request and response
