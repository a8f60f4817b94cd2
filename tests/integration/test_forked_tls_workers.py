"""Two TLS workers forked from one master allocate the same SSL* and BIO* addresses (gunicorn's
case: CI failed on it one run in ten, one worker's response landing on the other's connection).
Here the interleaving that broke it is forced, not left to chance: worker A takes its request,
then worker B does its whole handshake and takes its request, then A answers, then B. Each
worker uses a memory BIO, as asyncio and uvloop do (`SSL_set_bio` + `BIO_write`), and answers
with a body that names it. Every SERVER span must be its own worker's, with its own response.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .harness import Tracer, free_port, make_cert

pytestmark = pytest.mark.bpf

SERVER = r'''
import os, socket, ssl, sys, time
port_a, port_b, key, crt, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(crt, key)
la = socket.create_server(("127.0.0.1", port_a)); lb = socket.create_server(("127.0.0.1", port_b))

def wait_file(p):
    while not os.path.exists(p):
        time.sleep(0.01)

def worker(name, lsock):
    c, _ = lsock.accept()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_side=True)
    def flush():
        data = out.read()
        if data:
            c.sendall(data)
    def feed():
        data = c.recv(65536)
        if not data:
            raise SystemExit(1)
        inc.write(data)
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            flush(); feed()
    flush()
    req = b""
    while b"\r\n\r\n" not in req:
        try:
            req += obj.read(65536)
        except ssl.SSLWantReadError:
            flush(); feed()
    path = req.split(b" ")[1].decode()
    open(os.path.join(d, "req-" + name), "w").write(str(os.getpid()))
    wait_file(os.path.join(d, "go-" + name))
    body = ("worker %s answers %s\n" % (name, path) * (8 if name == "a" else 3)).encode()
    obj.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
              b"connection: close\r\n\r\n" % len(body) + body)
    flush()
    try:
        obj.unwrap()
    except ssl.SSLError:
        pass
    flush()
    c.close()

kids = []
for name, lsock in (("a", la), ("b", lb)):
    pid = os.fork()
    if pid == 0:
        worker(name, lsock)
        os._exit(0)
    kids.append(pid)
open(os.path.join(d, "forked"), "w").write("")
for pid in kids:
    os.waitpid(pid, 0)
'''


def _wait(p: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while not p.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{p.name} did not appear within {timeout} s")
        time.sleep(0.01)
    time.sleep(0.05)
    return p.read_text()


def test_forked_tls_workers_each_get_their_own_responses(tmp_path: Path) -> None:
    key, crt = make_cert(tmp_path)
    port_a, port_b = free_port(), free_port()
    (tmp_path / "srv.py").write_text(SERVER)
    tracer = Tracer()
    server = subprocess.Popen([sys.executable, str(tmp_path / "srv.py"), str(port_a),
                               str(port_b), str(key), str(crt), str(tmp_path)])
    clients: list[subprocess.Popen[str]] = []
    try:
        # the listeners exist before the fork; a probe connection would be a worker's one
        _wait(tmp_path / "forked")
        rids = {w: f"fork-{w}-{uuid.uuid4().hex[:8]}" for w in "ab"}

        def client(w: str, port: int) -> subprocess.Popen[str]:
            return subprocess.Popen(
                ["curl", "-sk", "--http1.1", "--max-time", "15", "-H",
                 f"x-request-id: {rids[w]}", f"https://127.0.0.1:{port}/from-{w}"],
                stdout=subprocess.PIPE, text=True)

        clients.append(client("a", port_a))
        pid_a = int(_wait(tmp_path / "req-a"))  # A holds its request, tied
        clients.append(client("b", port_b))
        pid_b = int(_wait(tmp_path / "req-b"))  # B's whole handshake happened meanwhile
        (tmp_path / "go-a").touch()
        out_a = clients[0].communicate(timeout=15)[0]
        (tmp_path / "go-b").touch()
        out_b = clients[1].communicate(timeout=15)[0]
        assert out_a == "worker a answers /from-a\n" * 8
        assert out_b == "worker b answers /from-b\n" * 3

        for w, pid, body in (("a", pid_a, out_a), ("b", pid_b, out_b)):
            spans = tracer.by_request_id(rids[w], count=2, timeout=10)
            srv = [s for s in spans if s["kind"] == "SERVER"]
            assert len(srv) == 1, f"worker {w}: {len(srv)} SERVER spans: {spans}"
            a = srv[0]["attributes"]
            got = {k: a.get(k) for k in ("process.pid", "url.path", "url.scheme",
                                         "http.response.status_code", "error.type",
                                         "http.response.body.size")}
            assert got == {"process.pid": pid, "url.path": f"/from-{w}", "url.scheme": "https",
                           "http.response.status_code": 200, "error.type": None,
                           "http.response.body.size": len(body)}, f"worker {w}: {got}"
    finally:
        for p in clients:
            p.kill()
        tracer.stop()
        server.kill()
        server.wait(timeout=10)
