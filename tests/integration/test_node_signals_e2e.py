"""`sits-trace run` with node signals on: spans carry TCP and run-queue attributes that agree
with the kernel's own per-socket and per-thread counters, and /metrics shows the node metrics.

A python http.server (HTTP/1.1) in one network namespace, a client in another, joined by a
veth pair (harness.netns_pair). Phase 1: 20 % of TCP packets dropped, one keep-alive
connection; the client reads its socket's tcpi_total_retrans after each response. Phase 2: no
loss, stress-ng on every CPU, a second connection; the client reads its thread's schedstat
run_delay around each request, in which it spins for 40 ms. The precise checks of each signal are test_tcp_signals.py and
test_sched_signals.py; this one is about the agent's wiring, end to end.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .harness import B_ADDR, Netns, SitsRun, free_port, netns_pair, sh, wait_port, write_config

pytestmark = [pytest.mark.bpf, pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("stress-ng") is None, reason="needs stress-ng")]

PORT = 47111
# one keep-alive connection; per request: the socket's retransmit total before and after
# (struct tcp_info: tcpi_total_retrans at offset 100) and the thread's run-queue wait
CLIENT = r'''
import json, re, socket, struct, sys, time
host, port, tag, n, gap, spin = (sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                 float(sys.argv[5]), float(sys.argv[6]))
def retrans(c):
    return struct.unpack_from("I", c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 100)[0]
def run_delay():
    return int(open("/proc/thread-self/schedstat").read().split()[1])
sys.stdin.readline()
c = socket.create_connection((host, port))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for i in range(n):
    rid = f"{tag}-{i}"
    r0, d0 = retrans(c), run_delay()
    c.sendall(f"GET /blob HTTP/1.1\r\nHost: x\r\nx-request-id: {rid}\r\n\r\n".encode())
    end = time.monotonic() + spin  # on a CPU inside the span's window: preempted under load
    while time.monotonic() < end:
        pass
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += c.recv(65536)
    head, body = buf.split(b"\r\n\r\n", 1)
    size = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < size:
        body += c.recv(65536)
    d1 = run_delay()
    out.append({"rid": rid, "retrans_before": r0, "retrans_after": retrans(c),
                "runq_ns": d1 - d0})
    time.sleep(gap)
print(json.dumps(out), flush=True)
sys.stdin.readline()  # the connection stays open until the test has looked at it
c.close()
'''


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Netns]:
    tmp = tmp_path_factory.mktemp("nodesig")
    (tmp / "client.py").write_text(CLIENT)
    (tmp / "www").mkdir()
    (tmp / "www" / "blob").write_bytes(b"b" * 16384)
    with netns_pair(tmp, f"n{time.monotonic_ns() % 10000}", Netns) as n:
        yield n


def wait_listening(net: Netns, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not net.sockets(net.b, PORT, "listening"):
        assert time.monotonic() < deadline, "http.server did not start"
        time.sleep(0.05)


def client(net: Netns, tag: str, n: int, gap: float, spin: float = 0.0
           ) -> subprocess.Popen[str]:
    p = net.spawn(net.a, sys.executable, str(net.tmp / "client.py"), B_ADDR, str(PORT), tag,
                  str(n), str(gap), str(spin), stdin=subprocess.PIPE)
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()
    return p


def results(p: subprocess.Popen[str]) -> list[dict[str, Any]]:
    assert p.stdout is not None
    return list(json.loads(p.stdout.readline()))


def release(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("done\n")
    p.stdin.flush()
    p.wait(timeout=10)


def server_total_retrans(net: Netns) -> int:
    """The server socket's retransmit total, as ss shows it (retrans:<now>/<total>)."""
    out = sh(*net.exec(net.b, "ss", "-Htin", "state", "established", f"( sport = :{PORT} )"))
    m = re.search(r"\bretrans:\d+/(\d+)", out)
    return int(m.group(1)) if m else 0


def scrape(port: int) -> dict[str, list[Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def metric(m: dict[str, list[Any]], name: str, **labels: str) -> float:
    hits = [s.value for s in m.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, m.get(name))
    return float(hits[0])


def by_rid(spans: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {s["attributes"]["http.request.header.x-request-id"]: s["attributes"] for s in spans
            if s["kind"] == kind and "http.request.header.x-request-id" in s["attributes"]}


def test_spans_and_metrics_carry_node_signals(net: Netns, tmp_path: Path) -> None:
    metrics_port = free_port()
    spans_file = tmp_path / "spans.jsonl"
    agent = SitsRun(write_config(tmp_path / "sits.toml", prometheus_port=metrics_port,
                                 jsonl_path=str(spans_file), batch_delay_s=0.2))
    try:
        net.spawn(net.b, sys.executable, "-m", "http.server", "-p", "HTTP/1.1", "--bind", B_ADDR,
                  "--directory", str(net.tmp / "www"), str(PORT))
        wait_listening(net)
        wait_port(metrics_port)
        net.drop(20)
        try:
            lossy = client(net, "loss", 30, 0.1)
            loss = results(lossy)
        finally:
            net.drop(0)
        server_retrans = server_total_retrans(net)
        stress = subprocess.Popen(["stress-ng", "--cpu", "3", "--timeout", "20s", "--quiet"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            busy = client(net, "busy", 10, 0.05, spin=0.04)
            runq = results(busy)
        finally:
            stress.terminate()
            stress.wait(timeout=10)
        time.sleep(1.1)  # a feature-frame tick while the clients live
        m = scrape(metrics_port)
        release(lossy)
        release(busy)
        time.sleep(1.5)  # a feature-frame tick after both clients closed (TIME_WAIT now)
        time_wait = len(net.sockets(net.a, PORT, "time-wait"))
        after = scrape(metrics_port)
    finally:
        rc = agent.stop()
    assert rc == 0, "".join(agent.err)
    spans = [json.loads(x) for x in spans_file.read_text().splitlines()]

    # TCP: the client's spans count its own retransmits on their connection
    clients, servers = by_rid(spans, "CLIENT"), by_rid(spans, "SERVER")
    # every span (full capture: write_config sets trace.cpu_budget = 0)
    missing = sorted({r["rid"] for r in loss + runq} - set(clients))
    assert not missing, f"no client span for {missing}; {len(spans)} spans, " \
        f"{''.join(agent.err)[-500:]}"
    loss = [r for r in loss if r["rid"] in clients]
    runq = [r for r in runq if r["rid"] in clients]
    in_window = before_total = 0
    for r in loss:
        a = clients[r["rid"]]
        assert a["sits.tcp.resets"] == 0
        # sent by this side since the connection opened, when the span was finished: at least
        # the kernel's counter after the response, but for a rare run of tcp.c the kernel
        # skipped (test_tcp_signals); no more than the final count (an agent slowed by other
        # load may finish the span after the next request's retransmits)
        assert r["retrans_after"] - 2 <= a["sits.tcp.conn.retransmits"] <= \
            max(x["retrans_after"] for x in loss), r
        in_window += int(a["sits.tcp.retransmits"])  # both sides', inside the span
        before_total += r["retrans_after"] - r["retrans_before"]
    client_retrans = max(r["retrans_after"] for r in loss)
    print(f"client retransmits {client_retrans} ({before_total} during requests), server "
          f"{server_retrans}; inside client spans (both sides) {in_window}")
    assert client_retrans > 0, "20 % loss gave the client no retransmit"
    assert in_window >= before_total - 2
    conn_server = [int(servers[r["rid"]]["sits.tcp.conn.retransmits"]) for r in loss
                   if r["rid"] in servers]
    print(f"server's last span: sits.tcp.conn.retransmits={conn_server[-1]}, ss {server_retrans}")
    assert len(conn_server) >= 25 and conn_server == sorted(conn_server)
    assert 0 < conn_server[-1] <= server_retrans

    # run queue: the client's waits between its request's first write and its response's end,
    # against its thread's schedstat read just around them
    waited = ours = 0
    for r in runq:
        a = clients[r["rid"]]
        assert a["sits.cpu.runq_threads"] == 1
        delay_ns = int(a["sits.cpu.runq_delay_us"]) * 1000
        # the span's window (its write's exit to its last read's exit) lies inside the
        # client's two schedstat reads, give or take a few lines of Python and sched.c's own
        # error against schedstat (test_sched_signals.py holds it; seen here: 2.3 ms over
        # 26 ms). Once a clean-clone CI run read 25.1 ms against 17.2: sched.c then counted a
        # wait from a wakeup that found the thread still on its CPU (fixed; the napping
        # thread of test_sched_signals.py shows it)
        assert abs(delay_ns - r["runq_ns"]) <= 0.15 * r["runq_ns"] + 5_000_000, \
            (r, a["sits.cpu.runq_delay_us"])
        waited += r["runq_ns"]
        ours += delay_ns
    print(f"run-queue wait in the busy client's spans: {ours / 1e6:.1f} ms, its schedstat "
          f"{waited / 1e6:.1f} ms")
    assert waited > 20_000_000, "stress-ng should have kept the client waiting"
    assert abs(ours - waited) <= 0.1 * waited  # seen: 296 vs 313 ms, 304 vs 309 ms

    # /metrics: the node counter includes every retransmit counted on the connection (one a
    # tcp_retransmit_skb hit: a retransmitted GSO skb of several segments is one, where ss
    # and TcpRetransSegs count segments, hence the server's lower count), TIME_WAIT by port
    last = clients[loss[-1]["rid"]]["sits.tcp.conn.retransmits"]
    assert metric(m, "sits_tcp_retransmits_total") >= last + conn_server[-1]
    assert metric(after, "sits_tcp_time_wait_sockets", side="peer", port=str(PORT)) == \
        time_wait == 2
    assert "sits_tcp_retransmits_per_s" in m
    busy_pid = str(busy.pid)
    assert metric(m, "sits_cpu_runq_delay_seconds_total", pid=busy_pid) * 1e9 >= ours
    assert metric(m, "sits_cpu_runq_waits_total", pid=busy_pid) >= len(runq)
    assert metric(m, "sits_cpu_runq_delay_s_per_s", pid=busy_pid) >= 0  # the frame's row
