"""A process the agent found already running dlopen()s a private copy of libssl long after it
started (issue 10: 0 of 20 requests were traced): the periodic library look-up of processes
with traced connections (trace.library_rescan_s) probes it, and its TLS requests are traced.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .harness import Tracer, curl, free_port, make_cert, wait_port

pytestmark = pytest.mark.bpf

SERVER = r'''
import os, sys, time, socket
port, trigger, key, crt = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen(64)
while not os.path.exists(trigger):  # no TLS library in this process until told
    time.sleep(0.05)
import ssl  # now libssl is loaded, from LD_LIBRARY_PATH's private copy
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(crt, key)
while True:
    c, _ = s.accept()
    try:
        t = ctx.wrap_socket(c, server_side=True)
        req = t.recv(65536)
        path = req.split(b" ")[1]
        body = b"ok " + path + b"\n"
        t.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        t.close()
    except Exception:
        c.close()
'''


def _private_libssl(d: Path) -> Path:
    lib = d / "privlib"
    lib.mkdir()
    for name in ("libssl.so.3", "libcrypto.so.3"):
        shutil.copy2(f"/usr/lib/x86_64-linux-gnu/{name}", lib / name)
    return lib


def test_libssl_loaded_late_is_probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/usr/lib/x86_64-linux-gnu/libssl.so.3").exists():
        pytest.skip("no Debian libssl.so.3 to copy")
    lib = _private_libssl(tmp_path)
    key, crt = make_cert(tmp_path)
    port, trigger = free_port(), tmp_path / "go"
    (tmp_path / "srv.py").write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "srv.py"), str(port), str(trigger),
                             str(key), str(crt)], env={"LD_LIBRARY_PATH": str(lib), "PATH": "/usr/bin"})
    monkeypatch.setenv("SITS_TRACE_LIBRARY_RESCAN_S", "2")
    tracer = Tracer()
    try:
        wait_port(port)
        trigger.touch()
        time.sleep(0.5)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert str(lib / "libssl.so.3") in maps, "the server did not load the private copy"
        deadline, traced, sent = time.monotonic() + 20, None, 0
        while time.monotonic() < deadline and traced is None:
            rid = f"late-{uuid.uuid4().hex[:10]}"
            assert curl(f"https://127.0.0.1:{port}/late", rid=rid).stdout.startswith("ok /late")
            sent += 1
            got = tracer.by_request_id(rid, timeout=1.5)
            traced = next((s for s in got if s["kind"] == "SERVER"), None)
        seen = tracer.matching(lambda s: s["attributes"].get("process.pid") == proc.pid)
        assert traced is not None, (f"none of {sent} TLS requests traced within 20 s; "
                                    f"spans of the server: {seen[:3]}")
        a = traced["attributes"]
        assert a["tls"] is True and a["url.path"] == "/late" and a["process.pid"] == proc.pid
        # probed within two look-ups of the first traced connection, not at the next exec
        assert sent <= 8, f"{sent} requests before the first was traced"
    finally:
        tracer.stop()
        proc.terminate()
        proc.wait(timeout=10)
