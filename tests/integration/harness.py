"""Real servers, clients and a real tracer for the integration tests (127.0.0.1 only)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

VENV_BIN = Path(sys.executable).parent
SITS = str(VENV_BIN / "sits-trace")
# the agent's own ready lines: matched at a line's start, since a warning before them may
# name agent/tracing/... (the stale compiled build's) or say "running"
TRACE_READY = "sits-trace: tracing;"
RUN_READY = "sits-trace: agent running"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def make_cert(d: Path) -> tuple[Path, Path]:
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )
    return key, crt


class Tracer:
    """`sits-trace trace --json` in a subprocess; spans collected as they are printed."""

    def __init__(self, *args: str) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        # the agent's counters (written every 5 s), its own file: a test can say what it lost
        fd, name = tempfile.mkstemp(prefix="sits-stats-", suffix=".json")
        os.close(fd)
        self.stats_path = Path(name)
        self.proc = subprocess.Popen(
            # full capture unless a test says otherwise: these tests count every request, and
            # a loaded CI machine must not make the agent shed load (test_load_shedding does)
            [SITS, "trace", "--json", *(() if "--cpu-budget" in args else ("--cpu-budget", "0")),
             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env={**os.environ, "SITS_STATS_PATH": str(self.stats_path)},
        )
        self.stderr_lines: list[str] = []
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._err.start()
        self._out = threading.Thread(target=self._read_out, daemon=True)
        self._out.start()
        self._wait_ready()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            span = json.loads(line)  # stdout holds JSON objects and nothing else
            with self._lock:
                self.spans.append(span)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith(TRACE_READY) for line in self.stderr_lines):
                return
            if self.proc.poll() is not None:
                raise RuntimeError("tracer exited: " + "".join(self.stderr_lines))
            time.sleep(0.05)
        raise TimeoutError("tracer did not start: " + "".join(self.stderr_lines))

    def matching(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if pred(s)]

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], count: int,
                 timeout: float = 15.0) -> list[dict[str, Any]]:
        """Spans matching pred once `count` arrived (and a short settle for extras)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.matching(pred)
            if len(got) >= count:
                time.sleep(0.3)  # a duplicate would show up now
                return self.matching(pred)
            time.sleep(0.05)
        return self.matching(pred)

    def by_request_id(self, rid: str, count: int = 1, timeout: float = 15.0,
                      kind: str | None = None) -> list[dict[str, Any]]:
        """Spans with this x-request-id (of this kind: SERVER, CLIENT), once `count` of them
        arrived. Give the kind when counting one side: a traced load generator's CLIENT
        spans carry the same id, and counting them too returned before the SERVER spans
        were all there (the hey and wrk tests' missing spans, 1595 of 2000)."""
        return self.wait_for(
            lambda s: s["attributes"].get("http.request.header.x-request-id") == rid
            and (kind is None or s["kind"] == kind), count, timeout)

    def counters(self, settle_s: float = 6.0) -> dict[str, Any]:
        """The agent's newest counters (kernel events seen and lost, spans, sheds), after
        `settle_s` (the agent writes them every 5 s); {} when none were written."""
        time.sleep(settle_s)
        try:
            out: dict[str, Any] = json.loads(self.stats_path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return out

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        # after the agent is gone: it writes its counters a last time as it exits, and a file
        # removed before that came back (396 sits-stats-*.json in /tmp after a few CI runs)
        self.stats_path.unlink(missing_ok=True)
        self._out.join(timeout=5)
        self._err.join(timeout=5)
        return "".join(self.stderr_lines)


class SitsRun:
    """`sits-trace run --config FILE` in a subprocess, until stop() sends SIGINT."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([SITS, "run", "--config", str(config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 90
        while not any(x.startswith(RUN_READY) for x in self.err):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("sits-trace run did not start: " + "".join(self.err))
            time.sleep(0.05)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


def write_config(path: Path, **export: object) -> Path:
    # full capture: these tests count spans (shedding has its own test)
    lines = ["[trace]", "cpu_budget = 0", "[export]"] + \
        [f"{k} = {json.dumps(v)}" for k, v in export.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Nginx:
    """nginx on 127.0.0.1 with HTTP and HTTPS and an access log that has $request_time."""

    LOG_FORMAT = "'$http_x_request_id $status $request_time $request_method $request_uri'"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.http_port = free_port()
        self.https_port = free_port()
        key, crt = make_cert(root)
        (root / "www").mkdir(exist_ok=True)
        (root / "www" / "static.txt").write_bytes(b"s" * 20000)
        self.access_log = root / "access.log"
        conf = root / "nginx.conf"
        user = "user root;" if os.geteuid() == 0 else ""
        conf.write_text(f"""
{user}
worker_processes 1;
daemon off;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format timing {self.LOG_FORMAT};
    access_log {self.access_log} timing;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    keepalive_requests 100000;
    sendfile on;
    server {{
        listen 127.0.0.1:{self.http_port};
        listen 127.0.0.1:{self.https_port} ssl;
        ssl_certificate {crt};
        ssl_certificate_key {key};
        root {root}/www;
        location = / {{ return 200 "hello from nginx\\n"; }}
        location = /missing {{ return 404; }}
        location = /fail {{ return 503 "down\\n"; }}
        location /static.txt {{ }}
        location = /upload {{ client_max_body_size 10m; return 201 "stored\\n"; }}
        # a file the test writes, sent 32 KiB a writev (over TLS 16 KiB an SSL_write)
        location = /v1/embeddings {{ sendfile off; default_type application/json; }}
    }}
}}
""")
        self.proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(root)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.http_port)
        wait_port(self.https_port)

    def pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [self.proc.pid] + [int(x) for x in out.stdout.split()]

    def log_entries(self, rid: str) -> list[list[str]]:
        time.sleep(0.1)
        lines = self.access_log.read_text().splitlines() if self.access_log.exists() else []
        return [line.split() for line in lines if line.split()[0] == rid]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


DEMO_SERVER = Path(__file__).resolve().parents[2] / "examples" / "demo_server.py"


ASGI_APP = r'''
import asyncio, sys

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/sse":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for i in range(5):
            await send({"type": "http.response.body", "body": b"data: token %d\n\n" % i, "more_body": True})
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if path.startswith("/status/"):
        code = int(path.split("/")[2])
        body = b"status %d\n" % code
    else:
        code, body = 200, b'{"ok": true}'
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
'''


@contextmanager
def python_server(tls: bool = False) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        args = [sys.executable, str(DEMO_SERVER), str(port)]
        if tls:
            key, crt = make_cert(Path(d))
            args += [str(key), str(crt)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE)
        try:
            wait_port(port)
            yield port, proc
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@contextmanager
def uvicorn_server() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        key, crt = make_cert(Path(d))
        (Path(d) / "sseapp.py").write_text(ASGI_APP)
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "sseapp:app", "--host", "127.0.0.1", "--port", str(port),
             "--ssl-keyfile", str(key), "--ssl-certfile", str(crt), "--log-level", "warning",
             "--no-access-log"],
            cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            wait_port(port, timeout=20)
            yield port, proc
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def curl(url: str, *args: str, rid: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["curl", "-sk", "--max-time", "10", url, *args]
    if rid:
        cmd += ["-H", f"x-request-id: {rid}"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def interrupt(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Ctrl-C a server and wait for it; killed when it does not exit within `timeout`."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def have(cmd: str) -> bool:
    return shutil.which(cmd) is not None


def env_with_path() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    return env


# ---- two network namespaces joined by a veth pair, with optional packet loss ----

A_ADDR, B_ADDR = "10.203.0.1", "10.203.0.2"
A_ADDR6, B_ADDR6 = "fd00:203::1", "fd00:203::2"
ADDRS = {A_ADDR, B_ADDR, A_ADDR6, B_ADDR6}

# This kernel has no netem qdisc: loss comes from an XDP program that drops a given share of
# the TCP packets arriving on a veth end.
DROPPER = r'''
import sys
from bcc import BPF
text = """
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
int sits_test_drop(struct xdp_md *ctx) {
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end) return XDP_PASS;
    __u8 proto = 0;
    if (eth->h_proto == htons(ETH_P_IP)) {
        struct iphdr *ip = (void *)(eth + 1);
        if ((void *)(ip + 1) > end) return XDP_PASS;
        proto = ip->protocol;
    } else if (eth->h_proto == htons(ETH_P_IPV6)) {
        struct ipv6hdr *ip6 = (void *)(eth + 1);
        if ((void *)(ip6 + 1) > end) return XDP_PASS;
        proto = ip6->nexthdr;
    }
    if (proto != IPPROTO_TCP || bpf_get_prandom_u32() % 100 >= PCT) return XDP_PASS;
    return XDP_DROP;
}
"""
b = BPF(text=text, cflags=["-DPCT=" + sys.argv[2]])
b.attach_xdp(sys.argv[1], b.load_func("sits_test_drop", BPF.XDP), 0)
print("attached", flush=True)  # the attachment outlives this process; netns deletion ends it
'''


def sh(*cmd: str, timeout: float = 20) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True,
                          timeout=timeout).stdout


@dataclass
class Netns:
    """Namespaces `a` (A_ADDR) and `b` (B_ADDR); what spawn() starts, stop_servers() kills."""

    a: str
    b: str
    dev_a: str
    dev_b: str
    tmp: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def exec(self, ns: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def spawn(self, ns: str, *cmd: str, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
        p = subprocess.Popen(self.exec(ns, *cmd), stdout=subprocess.PIPE, stdin=stdin, text=True)
        self.procs.append(p)
        return p

    def counters(self, ns: str) -> dict[str, int]:
        """Tcp* (/proc/net/snmp) and TcpExt* (/proc/net/netstat) of a namespace, as nstat."""
        out: dict[str, int] = {}
        for f in ("/proc/net/snmp", "/proc/net/netstat"):
            lines = sh(*self.exec(ns, "cat", f)).splitlines()
            for names, values in zip(lines[::2], lines[1::2]):
                prefix, *keys = names.split()
                _, *vals = values.split()
                for k, v in zip(keys, vals):
                    out[prefix.rstrip(":") + k] = int(v)
        return out

    def drop(self, pct: int) -> None:
        """Drop pct % of the TCP packets arriving in each namespace (0: stop dropping)."""
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            if pct:
                out = sh(*self.exec(ns, sys.executable, str(self.tmp / "drop.py"), dev,
                                    str(pct)), timeout=60)
                assert "attached" in out
            else:
                sh("ip", "-n", ns, "link", "set", "dev", dev, "xdp", "off")

    def sockets(self, ns: str, port: int, state: str = "all") -> list[str]:
        out = sh(*self.exec(ns, "ss", "-Htan", "state", state,
                            f"( sport = :{port} or dport = :{port} )"))
        return [ln for ln in out.splitlines() if ln.strip()]

    def stop_servers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=5)
        self.procs.clear()


N = TypeVar("N", bound=Netns)


@contextmanager
def netns_pair(tmp: Path, tag: str, cls: type[N]) -> Iterator[N]:
    """Two fresh namespaces and their veth pair, deleted whatever happens; short retransmit
    timeouts (rto_min 10 ms) keep lossy tests within seconds."""
    n = cls(f"sitsA{tag}", f"sitsB{tag}", f"sA{tag}", f"sB{tag}", tmp)
    (tmp / "drop.py").write_text(DROPPER)
    try:
        sh("ip", "netns", "add", n.a)
        sh("ip", "netns", "add", n.b)
        sh("ip", "link", "add", n.dev_a, "type", "veth", "peer", "name", n.dev_b)
        for ns, dev, a4, a6 in ((n.a, n.dev_a, A_ADDR, A_ADDR6), (n.b, n.dev_b, B_ADDR, B_ADDR6)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{a4}/24", "dev", dev)
            sh("ip", "-n", ns, "addr", "add", f"{a6}/64", "dev", dev, "nodad")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "route", "replace", "10.203.0.0/24", "dev", dev, "rto_min", "10ms")
        yield n
    finally:
        n.stop_servers()
        for ns in (n.a, n.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20, check=False)
        subprocess.run(["ip", "link", "del", n.dev_a], capture_output=True, timeout=20,
                       check=False)
