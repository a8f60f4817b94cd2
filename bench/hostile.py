"""Hostile traffic against nginx with `sits-trace trace` at default settings (issue 10).
Needs root and nginx.

    .venv/bin/python bench/hostile.py [--scale 1.0] [SCENARIO ...]

Scenarios: slowloris (300 connections, 1 byte / 100 ms, 12 s), churn (300 new connections/s
with thousands of TIME_WAIT sockets), upload (100 MB, then a request on the same keep-alive
connection; upload-tls: the same over HTTPS), pipelined (200 requests in one 14 KB write, 10
times), junk (junk prefixes, 16 03 included), headers (1,000 headers), resets (partial
requests ended by RST). `--scale`
shortens each (CI runs a bounded form). After each, valid requests (x-request-id
`probe-...`) are sent one every 100 ms; each must be traced within 2 s.

Prints one line per scenario: what the attack sent, probes traced within 2 s, the worst
delay, spans blaming a client (malformed_request), and the agent's stats line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sits_trace.agent.capture.events import ConnEvent, DataEvent, DecodeError, decode
from sits_trace.agent.capture.loader import RecordedSource

SITS = str(Path(sys.executable).parent / "sits-trace")
Span = dict[str, Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Nginx:
    """One worker, keep-alive, a 200 MB upload location; access log with the request id."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.tls_port = free_port()
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=localhost", "-keyout", str(root / "key.pem"),
                        "-out", str(root / "cert.pem")], check=True, capture_output=True)
        self.log = root / "access.log"
        user = "user root;" if os.geteuid() == 0 else ""
        (root / "nginx.conf").write_text(f"""{user} worker_processes 1; daemon off;
pid {root}/nginx.pid; error_log {root}/error.log crit; events {{ worker_connections 8192; }}
http {{ log_format rid '$http_x_request_id $status'; access_log {self.log} rid;
client_body_temp_path {root}/b; proxy_temp_path {root}/p; fastcgi_temp_path {root}/f;
uwsgi_temp_path {root}/u; scgi_temp_path {root}/s; keepalive_requests 100000;
large_client_header_buffers 4 32k;
server {{ listen 127.0.0.1:{self.port} backlog=4096; listen 127.0.0.1:{self.tls_port} ssl;
  ssl_certificate {root}/cert.pem; ssl_certificate_key {root}/key.pem;
  location = / {{ return 200 "ok\\n"; }}
  location = /upload {{ client_max_body_size 200m; return 201 "stored\n"; }}
}} }}
""")
        self.proc = subprocess.Popen(["nginx", "-c", str(root / "nginx.conf"), "-p", str(root)],
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def logged(self, prefix: str) -> int:
        time.sleep(0.2)
        if not self.log.exists():
            return 0
        return sum(1 for line in self.log.read_text().splitlines() if line.startswith(prefix))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Agent:
    """`sits-trace trace --json -p PID` with default settings; spans kept with arrival times."""

    def __init__(self, pid: int, record: Path | None = None) -> None:
        self.spans: list[tuple[float, Span]] = []
        self.err: list[str] = []
        self._lock = threading.Lock()
        extra = ["--record", str(record)] if record is not None else []
        self.proc = subprocess.Popen([SITS, "trace", "--json", "-p", str(pid), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     bufsize=1)
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._errs, daemon=True).start()
        deadline = time.monotonic() + 90
        while not any(x.startswith("sits-trace: tracing;") for x in self.err):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tracer did not start: " + "".join(self.err))
            time.sleep(0.05)

    def _out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            span = json.loads(line)
            with self._lock:
                self.spans.append((time.monotonic(), span))

    def _errs(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def matching(self, pred: Callable[[Span], bool]) -> list[tuple[float, Span]]:
        with self._lock:
            return [(t, s) for t, s in self.spans if pred(s)]

    def stop(self) -> dict[str, int]:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        time.sleep(0.2)
        return stats_of("".join(self.err))


def stats_of(text: str) -> dict[str, int]:
    """The stats lines (`name=value`) the tracer prints when it stops."""
    return {k: int(v) for k, v in re.findall(r"\b([a-z_]+)=(\d+)\b", text)}


def rid_of(s: Span) -> str:
    return str(s["attributes"].get("http.request.header.x-request-id", ""))


def blames_client(s: Span) -> bool:
    return bool(s["attributes"].get("error.type") == "malformed_request")


# ---- attacks (each returns a short description of what it sent) ----


def request(rid: str, path: str = "/", extra: str = "", close: bool = False) -> bytes:
    conn = "Connection: close\r\n" if close else ""
    return (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nx-request-id: {rid}\r\n{extra}{conn}"
            "\r\n").encode()


def read_responses(s: socket.socket, n: int, timeout: float = 10) -> int:
    """Read until `n` status lines arrived (or timeout/close); returns how many."""
    s.settimeout(timeout)
    buf = b""
    got = 0
    try:
        while got < n:
            b = s.recv(65536)
            if not b:
                break
            buf += b
            got = buf.count(b"HTTP/1.1 ")
    except OSError:
        pass
    return got


def slowloris(port: int, scale: float) -> str:
    """300 connections each sending a request head one byte every 100 ms for 12 s."""
    n, seconds = 300, 12 * scale
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        for s in socks:
            try:
                s.send(b"a" if sent % 7 else b"\n")
                sent += 1
            except OSError:
                pass
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t)))
    for s in socks:
        s.close()
    return f"{n} connections, {sent} one-byte sends over {seconds:.0f} s"


def churn(port: int, scale: float, rid: str = "churn") -> str:
    """300 new connections/s (one request each, client closes first: TIME_WAIT on the host)."""
    for _ in range(int(3000 * scale)):  # thousands of TIME_WAIT sockets before it starts
        socket.create_connection(("127.0.0.1", port)).close()
    rate, seconds = 300, max(2.0, 10 * scale)
    sent = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        due = int((time.monotonic() - t0) * rate)
        while sent < due:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request(f"{rid}-{sent}"))
                read_responses(s, 1, 2)
            sent += 1
        time.sleep(0.002)
    tw = subprocess.run(["ss", "-tanH", "state", "time-wait"], check=False, capture_output=True,
                        text=True)
    return f"{sent} requests at {sent / seconds:.0f}/s, time_wait={len(tw.stdout.splitlines())}"


def upload(port: int, scale: float, rid: str = "upload", tls: bool = False) -> str:
    """100 MB body, then a request on the same keep-alive connection (over TLS: `port` is
    nginx's HTTPS port)."""
    size = int(100 * 1024 * 1024 * max(scale, 0.25))
    raw = socket.create_connection(("127.0.0.1", port))
    with (ssl._create_unverified_context().wrap_socket(raw) if tls else raw) as s:
        s.sendall(f"POST /upload HTTP/1.1\r\nHost: x\r\nx-request-id: {rid}-big\r\n"
                  f"Content-Length: {size}\r\n\r\n".encode())
        block = b"u" * 65536
        left = size
        while left:
            left -= s.send(block[: min(left, len(block))])
        read_responses(s, 1, 30)
        s.sendall(request(f"{rid}-after"))
        got = read_responses(s, 1, 10)
    return f"{size >> 20} MiB upload, then {got} request on the same connection ({rid}-after)"


def pipelined(port: int, scale: float, rid: str = "pipe") -> str:
    """200 requests in one write (about 14 KB), on one connection, 10 times."""
    rounds = max(2, int(10 * scale))
    for r in range(rounds):
        burst = b"".join(request(f"{rid}-{r}-{i:03d}") for i in range(200))
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(burst)
            read_responses(s, 200, 10)
    return f"{rounds} x 200 pipelined requests in one write of {len(burst)} bytes"


def junk(port: int, scale: float) -> str:
    """Junk before a request: binary noise, a TLS-looking 16 03 prefix, bare CRLFs, a bad
    method; each on a new connection (nginx answers 400 and closes)."""
    rnd = random.Random(7)
    prefixes = [b"\x16\x03\x01\x02\x00garbage", b"\r\n\r\n\r\n", b"BREW / HTCPCP/1.0\r\n\r\n",
                bytes(rnd.randrange(256) for _ in range(300)), b"\x00" * 64]
    n = max(10, int(100 * scale))
    for i in range(n):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(prefixes[i % len(prefixes)] + request(f"junk-{i}"))
            read_responses(s, 1, 2)
    return f"{n} connections with junk prefixes"


def headers(port: int, scale: float, rid: str = "hdrs") -> str:
    """1,000 header fields; x-request-id is the 101st (past the parser's 64 kept)."""
    n = max(5, int(20 * scale))
    lines = "".join(f"x-h{i}: v\r\n" for i in range(100))
    tail = "".join(f"x-t{i}: v\r\n" for i in range(899))
    for i in range(n):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: x\r\n{lines}x-request-id: {rid}-{i}\r\n{tail}\r\n"
                      .encode())
            read_responses(s, 1, 5)
    return f"{n} requests with 1,000 headers each"


def resets(port: int, scale: float) -> str:
    """Partial requests and requests without reading the response, ended by a TCP reset."""
    n = max(20, int(200 * scale))
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(request(f"reset-{i}")[: 10 + i % 40] if i % 2 else request(f"reset-{i}"))
        s.close()
    return f"{n} connections reset"


ATTACKS: dict[str, Callable[[int, float], str]] = {
    "slowloris": slowloris, "churn": churn, "upload": upload, "pipelined": pipelined,
    "junk": junk, "headers": headers, "resets": resets,
    "upload-tls": lambda port, scale: upload(port, scale, "upload-tls", tls=True),
}


# ---- probes ----


@dataclass
class Probe:
    sent: int = 0
    traced: int = 0  # within 2 s of being sent
    worst_s: float = 0.0
    missing: list[str] = field(default_factory=list)
    # seconds from the attack's end to the first probe from which on every probe was traced
    # within 2 s (inf: the last probe was not)
    recovered_s: float = float("inf")


def probe(agent: Agent, port: int, attack_end: float, n: int = 30, every_s: float = 0.1) -> Probe:
    """`n` valid requests on fresh connections, from the attack's end on, one every `every_s`;
    tracing has recovered once every later probe is traced within 2 s of being sent."""
    tag = uuid.uuid4().hex[:8]
    sent_at: dict[str, float] = {}
    for i in range(n):
        rid = f"probe-{tag}-{i}"
        with socket.create_connection(("127.0.0.1", port)) as s:
            sent_at[rid] = time.monotonic()
            s.sendall(request(rid, close=True))
            read_responses(s, 1, 2)
        time.sleep(every_s)
    time.sleep(2.0)
    seen = {rid_of(s): t for t, s in agent.matching(lambda s: rid_of(s).startswith(f"probe-{tag}"))}
    p = Probe(sent=n)
    for rid, t0 in sent_at.items():
        t = seen.get(rid)
        if t is not None and t - t0 <= 2.0:
            p.traced += 1
            p.worst_s = max(p.worst_s, t - t0)
            if p.recovered_s == float("inf"):
                p.recovered_s = max(0.0, t0 - attack_end)
        else:
            p.missing.append(rid)
            p.recovered_s = float("inf")
    return p


@dataclass
class Result:
    name: str
    attack: str
    probe: Probe
    stats: dict[str, int]
    spans: list[Span]
    blamed: int  # spans that blame the client (malformed_request)
    agent_cores: float  # the agent's CPU use during the attack
    record: Path | None = None  # the agent's raw records (run_scenario's `record`)

    def traced(self, prefix: str) -> list[Span]:
        return [s for s in self.spans if rid_of(s).startswith(prefix)]

    def line(self) -> str:
        keys = ("spans", "records", "lost_in_kernel", "exchanges_shed", "capture_shift",
                "capture_lost", "requests_uncaptured", "dribbles", "parser_malformed",
                "conns_expired", "conns_active")
        st = " ".join(f"{k}={self.stats.get(k, 0)}" for k in keys)
        more = " ".join(f"{k}={v}" for k, v in sorted(self.stats.items()) if v and k not in keys)
        p = self.probe
        return (f"{self.name}: {self.attack}; agent {self.agent_cores:.3f} cores during it; "
                f"probes traced within 2 s: {p.traced}/{p.sent}, recovered "
                f"{p.recovered_s:.2f} s after the attack; malformed_request spans: "
                f"{self.blamed}; {st}" + (f" ({more})" if more else ""))

    def records_of(self, marker: bytes) -> str:
        """The recorded reads and writes of the connection whose captured bytes first hold
        `marker` (run with `record`): what a failed check is explained from."""
        if self.record is None or not self.record.exists():
            return "(not recorded)"
        return connection_records(self.record, marker)


def connection_records(path: Path, marker: bytes) -> str:
    """One line per record of the first connection whose captured bytes hold `marker`: its
    opening and closing; each read and write's direction, bytes moved, bytes captured, flags
    and the captured bytes' ends."""
    src, events = RecordedSource(path), []
    while not src.exhausted:
        raws = src.read(0)
        for raw in raws:
            try:
                ev = decode(raw)
            except DecodeError:
                continue
            if isinstance(ev, (DataEvent, ConnEvent)):
                events.append(ev)
    conn = next((e.conn_id for e in events if isinstance(e, DataEvent) and marker in e.payload),
                None)
    if conn is None:
        return f"(no record holds {marker!r})"
    mine = [e for e in events if e.conn_id == conn]
    t0 = next((e.ts_enter_ns for e in mine if isinstance(e, DataEvent)), 0)
    out = []
    for e in mine:
        if isinstance(e, ConnEvent):
            out.append(f"{e.kind.name.lower()} fd={e.fd} {(e.ts_ns - t0) / 1e6:.3f}ms")
            continue
        data = bytes(e.payload)
        ends = repr(data if len(data) <= 48 else data[:16] + b".." + data[-28:])
        flags = "".join(f for f, on in (("T", e.tail), ("G", e.gap), ("L", e.lost)) if on)
        out.append(f"{('in', 'out')[int(e.direction)]} {e.length} cap={len(data)} {flags or '-'} "
                   f"{(e.ts_exit_ns - t0) / 1e6:.3f}ms {ends}")
    return "\n".join(out)


def cpu_seconds(pid: int) -> float:
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def run_scenario(name: str, nginx: Nginx, scale: float, record: Path | None = None) -> Result:
    """Run attack `name`, then the probes, under a fresh agent (saving its raw records to
    `record` when given)."""
    agent = Agent(nginx.proc.pid, record)
    try:
        c0, t0 = cpu_seconds(agent.proc.pid), time.monotonic()
        what = ATTACKS[name](nginx.tls_port if name.endswith("-tls") else nginx.port, scale)
        end = time.monotonic()
        cores = (cpu_seconds(agent.proc.pid) - c0) / max(end - t0, 1e-3)
        p = probe(agent, nginx.port, end)
    finally:
        stats = agent.stop()
    spans = [s for _, s in agent.spans if s.get("kind") == "SERVER"]
    return Result(name, what, p, stats, spans, sum(1 for s in spans if blames_client(s)), cores,
                  record)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*", help=" ".join(ATTACKS))
    ap.add_argument("--scale", type=float, default=1.0, help="shorten each attack (CI: 0.3)")
    args = ap.parse_args()
    unknown = set(args.scenarios) - set(ATTACKS)
    if unknown:
        sys.exit(f"unknown scenario(s) {sorted(unknown)}: choose from {' '.join(ATTACKS)}")
    with tempfile.TemporaryDirectory() as d:
        nginx = Nginx(Path(d))
        try:
            for name in args.scenarios or list(ATTACKS):
                print(run_scenario(name, nginx, args.scale).line(), flush=True)
        finally:
            nginx.stop()


if __name__ == "__main__":
    main()
