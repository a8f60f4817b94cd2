"""bpf/tcp.c against the kernel's own counters, in two network namespaces joined by a veth pair.

Everything runs in namespaces this module creates (and deletes, whatever happens), so the
kernel's per-namespace SNMP counters (/proc/net/snmp, /proc/net/netstat: what `nstat` reads)
count exactly the test's traffic. This kernel has no netem qdisc, so loss comes from a small
XDP program that drops a given share of TCP packets arriving on each veth end (harness.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from sits_trace.agent.capture import loader, probes
from sits_trace.agent.capture.bpfmaps import BccMaps
from sits_trace.agent.capture.events import Kind
from sits_trace.agent.capture.wire import TcpEventType
from sits_trace.agent.model import ConnInfo, Exchange, RequestHead, ResponseHead, Role, Span
from sits_trace.agent.signals import node as nodesignals
from sits_trace.agent.signals.tcp import TcpConnStats, TcpSignals, TcpTuple

from .harness import A_ADDR, A_ADDR6, ADDRS, B_ADDR, B_ADDR6, Netns, netns_pair, sh

pytestmark = pytest.mark.bpf

PEER = r'''
import json, socket, struct, sys, time
T = socket.IPPROTO_TCP
def fam(h): return socket.AF_INET6 if ":" in h else socket.AF_INET
def serve(host, port, how):
    s = socket.socket(fam(host)); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(64); print("listening", flush=True)
    while True:
        c, _ = s.accept()
        try:
            if how == "echo":
                while True:
                    d = c.recv(4096)
                    if not d: break
                    c.sendall(d)
            elif how == "close_first":
                c.recv(4096); c.sendall(b"bye")
            elif how == "unread":
                time.sleep(0.2)  # the client's bytes arrive, unread: close sends RST
        except OSError:
            pass
        c.close()
def client(host, port, how, n):
    sys.stdin.readline()  # "go": the test has registered this pid
    out = []
    for i in range(n if how != "pingpong" else 1):
        c = socket.socket(fam(host))
        t0 = time.monotonic_ns()
        try:
            c.connect((host, port))
        except ConnectionRefusedError:
            out.append({"refused": True}); c.close(); continue
        c.setsockopt(T, socket.TCP_NODELAY, 1)
        info = {"fd": c.fileno(), "laddr": c.getsockname()[0], "lport": c.getsockname()[1], "t0": t0}
        if how in ("pingpong", "keep"):
            for _ in range(n):
                c.sendall(b"x" * 200); got = 0
                while got < 200: got += len(c.recv(4096))
        elif how == "linger0":
            c.sendall(b"x" * 200); c.recv(4096)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif how == "unread":
            c.sendall(b"x" * 100)
            try:
                while c.recv(4096): pass
            except ConnectionResetError:
                info["reset"] = True
        elif how == "wait_eof":
            c.sendall(b"req")
            while c.recv(4096): pass
        elif how == "once":
            c.sendall(b"x" * 200); c.recv(4096)
        info["t1"] = time.monotonic_ns()
        if how == "keep":
            print(json.dumps(info), flush=True)
            while sys.stdin.readline().strip() == "more":  # n more round trips, then "done"
                for _ in range(n):
                    c.sendall(b"x" * 200); got = 0
                    while got < 200: got += len(c.recv(4096))
                print(json.dumps(info), flush=True)
        c.close(); out.append(info)
    print(json.dumps(out), flush=True)
if sys.argv[1] == "serve": serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
else: client(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
'''

class PeerNetns(Netns):
    """The namespaces, with peer.py (PEER) as server and client."""

    def server(self, ns: str, host: str, port: int, how: str) -> subprocess.Popen[str]:
        p = self.spawn(ns, sys.executable, str(self.tmp / "peer.py"), "serve", host, str(port),
                       how)
        assert p.stdout is not None and p.stdout.readline().strip() == "listening"
        return p

    def client(self, ns: str, host: str, port: int, how: str, n: int) -> subprocess.Popen[str]:
        return self.spawn(ns, sys.executable, str(self.tmp / "peer.py"), "client", host,
                          str(port), how, str(n), stdin=subprocess.PIPE)


@pytest.fixture(scope="module")
def netns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerNetns]:
    tmp = tmp_path_factory.mktemp("tcpsig")
    (tmp / "peer.py").write_text(PEER)
    with netns_pair(tmp, f"{os.getpid() % 100000}", PeerNetns) as n:
        yield n


@pytest.fixture(scope="module")
def kernel() -> Iterator[loader.Kernel]:
    add = nodesignals.load_additions(nodesignals.NodeSignalConfig(sched=False),
                                     probes.tracefs_root())
    # filter on with only the agent itself listed: nothing is traced by http.c until a test
    # adds its client's pid (tcp.c is node-wide and not filtered)
    opts = nodesignals.extend_options(
        loader.LoadOptions(tls=False, target_pids=[os.getpid()], ringbuf_pages=256), add)
    k = loader.load(opts)
    try:
        yield k
    finally:
        k.bpf.cleanup()


@pytest.fixture(scope="module")
def ring(kernel: loader.Kernel) -> loader.RingSource:
    return loader.RingSource(kernel)


def drain(ring: loader.RingSource, sig: TcpSignals | None = None) -> int:
    n = 0
    for _ in range(1000):
        recs = ring.read(0)
        if not recs:
            break
        for r in recs:
            if sig is not None and int.from_bytes(r[:4], "little") == Kind.TCP_EVENT:
                sig.on_record(r)
                n += 1
    return n


def ours(kernel: loader.Kernel, port: int) -> dict[TcpTuple, TcpConnStats]:
    out = {}
    for k, v in BccMaps(kernel.bpf).items("tcp_conns"):
        t = TcpTuple.from_key(k)
        if t.local_address in ADDRS and port in (t.local_port, t.remote_port):
            out[t] = TcpConnStats.from_bytes(v)
    return out


def delta(before: dict[str, int], after: dict[str, int], key: str) -> int:
    return after[key] - before[key]


def wait_closed(netns: PeerNetns, port: int, timeout: float = 15) -> None:
    """Until no socket of `port` is left in either namespace but TIME_WAIT ones."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [s for ns in (netns.a, netns.b) for s in netns.sockets(ns, port, "connected")
                if not s.startswith("TIME-WAIT")]
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"port {port}: sockets still closing: {left}")


def finish(p: subprocess.Popen[str], timeout: float = 60) -> list[dict[str, object]]:
    out, _ = p.communicate(timeout=timeout)
    return list(json.loads(out.strip().splitlines()[-1]))


@contextmanager
def tracefs_count(events: list[str], pattern: str) -> Iterator[Callable[[], int]]:
    """The kernel's own event stream (a private tracefs instance, no BPF): how many hits of
    `events` mention `pattern`."""
    root = probes.tracefs_root()
    assert root is not None
    inst = root / "instances" / f"sits_test_{os.getpid()}"
    inst.mkdir()
    try:
        (inst / "buffer_size_kb").write_text("4096")
        for ev in events:
            (inst / "events" / ev / "enable").write_text("1")

        def count() -> int:
            return sum(pattern in ln for ln in (inst / "trace").read_text().splitlines())

        yield count
    finally:
        for ev in events:
            (inst / "events" / ev / "enable").write_text("0")
        inst.rmdir()


def misses(kernel: loader.Kernel, *names: str) -> int:
    got = nodesignals.program_misses(kernel)
    return sum(got.get(n, 0) for n in names)


def test_retransmits_equal_kernel_counters(netns: PeerNetns, kernel: loader.Kernel,
                                           ring: loader.RingSource) -> None:
    port = 47011
    progs = ("tracepoint__tcp__tcp_retransmit_skb", "tracepoint__tcp__tcp_retransmit_synack")
    sig = TcpSignals(BccMaps(kernel.bpf))
    drain(ring)
    misses0 = misses(kernel, *progs)
    with tracefs_count(["tcp/tcp_retransmit_skb", "tcp/tcp_retransmit_synack"],
                       "saddr=10.203.0.") as traced:
        netns.drop(20)
        try:
            before = {ns: netns.counters(ns) for ns in (netns.a, netns.b)}
            netns.server(netns.b, B_ADDR, port, "echo")
            cli = netns.client(netns.a, B_ADDR, port, "pingpong", 60)
            kernel.add_target_pid(cli.pid)
            assert cli.stdin is not None
            cli.stdin.write("go\n")
            cli.stdin.flush()
            info = finish(cli)[0]
            wait_closed(netns, port)
        finally:
            netns.drop(0)
        after = {ns: netns.counters(ns) for ns in (netns.a, netns.b)}
        n_traced = traced()
    drain(ring, sig)
    netns.stop_servers()
    skipped = misses(kernel, *progs) - misses0

    kernel_retrans = sum(delta(before[ns], after[ns], "TcpRetransSegs") for ns in before)
    conns = ours(kernel, port)
    per_conn = sum(s.retransmits for s in conns.values())
    client = TcpTuple(A_ADDR, int(str(info["lport"])), B_ADDR, port)
    records = sig.events_between(client, 0, 2**64 - 1)
    n_records = sum(e.type in (TcpEventType.RETRANS, TcpEventType.SYNACK_RETRANS)
                    for e in records)
    print(f"TcpRetransSegs A+B={kernel_retrans} tracefs={n_traced} per-connection={per_conn} "
          f"records={n_records} recursion_misses={skipped} (client "
          f"{conns[client].retransmits}, server {conns[client.reversed()].retransmits})")
    assert kernel_retrans > 0, "20% loss produced no retransmits"
    # one tracepoint hit per retransmitted segment (small writes: one segment per skb)
    assert n_traced == kernel_retrans
    assert per_conn == n_records
    # every hit reached our program, except those the kernel skipped because another BPF
    # program was running on that CPU (counted in recursion_misses) and, on this 6.18 kernel,
    # now and then one skipped without being counted: seen only in softirq on top of another
    # process's task, about one run in ten, never more than 2 of ~50 (see the report)
    assert 0 <= kernel_retrans - skipped - per_conn <= 2
    assert set(conns) == {client, client.reversed()}

    # the span's connection, found from what the agent knows of each side
    cinfo = ConnInfo(conn_id=1, pid=cli.pid, fd=int(str(info["fd"])), role=Role.CLIENT,
                     peer_address=B_ADDR, peer_port=port)
    assert sig.resolve(cinfo) == client
    sinfo = ConnInfo(conn_id=2, pid=1, fd=4, role=Role.SERVER, peer_address=A_ADDR,
                     peer_port=client.local_port, local_address="0.0.0.0", local_port=port)
    assert sig.resolve(sinfo) == client.reversed()
    t0, t1 = int(str(info["t0"])), int(str(info["t1"]))
    ex = Exchange(cinfo, RequestHead("GET", "/", "1.1", [], t0, t0),
                  ResponseHead(200, "1.1", [], t1, t1))
    span = Span("0" * 32, "0" * 16, None, "GET", "CLIENT", 0, 0)
    sig.annotate(ex, span)
    in_window = [e for e in records if t0 <= e.ts_ns <= t1
                 and e.type in (TcpEventType.RETRANS, TcpEventType.SYNACK_RETRANS)]
    assert span.attributes["sits.tcp.retransmits"] == len(in_window) > 0
    assert span.attributes["sits.tcp.conn.retransmits"] == conns[client].retransmits
    assert span.attributes["sits.tcp.resets"] == 0


def test_resets_equal_kernel_counters(netns: PeerNetns, kernel: loader.Kernel,
                                      ring: loader.RingSource) -> None:
    port, closed = 47012, 47013
    sig = TcpSignals(BccMaps(kernel.bpf))
    drain(ring)
    before = {ns: netns.counters(ns) for ns in (netns.a, netns.b)}
    totals0 = sig.totals()
    netns.server(netns.b, B_ADDR, port, "echo")
    netns.server(netns.b, "::", port + 10, "unread")
    runs = [(B_ADDR, closed, "refused", 3), (B_ADDR6, closed, "refused", 1),
            (B_ADDR, port, "linger0", 2), (B_ADDR6, port + 10, "unread", 2)]
    results = {}
    for host, p, how, n in runs:
        cli = netns.client(netns.a, host, p, how, n)
        assert cli.stdin is not None
        cli.stdin.write("go\n")
        cli.stdin.flush()
        results[how + host] = finish(cli)
    wait_closed(netns, port)
    wait_closed(netns, port + 10)
    after = {ns: netns.counters(ns) for ns in (netns.a, netns.b)}
    totals1 = sig.totals()
    drain(ring, sig)
    netns.stop_servers()

    assert all(r.get("refused") for r in results["refused" + B_ADDR])
    assert all(r.get("reset") for r in results["unread" + B_ADDR6])
    evs = [e for q in sig._events.values() for e in q
           if e.conn.local_address in ADDRS and e.conn.remote_address in ADDRS]
    out = [e for e in evs if e.type is TcpEventType.RST_OUT]
    got = [e for e in evs if e.type is TcpEventType.RST_IN]
    kernel_out = sum(delta(before[ns], after[ns], "TcpOutRsts") for ns in before)
    print(f"TcpOutRsts A+B={kernel_out} RST records out={len(out)} in={len(got)}; "
          f"TcpExtTCPAbortOnData={delta(before[netns.a], after[netns.a], 'TcpExtTCPAbortOnData')}"
          f" TcpExtTCPAbortOnClose={delta(before[netns.b], after[netns.b], 'TcpExtTCPAbortOnClose')}"
          f" reasons={sorted(e.reason for e in out)}")
    assert kernel_out == 8  # 4 refused (no socket), 2 SO_LINGER 0 aborts, 2 unread closes
    # all counted; sent as records only where a live connection sent or took one: a refused
    # connect() is outside every span (a client retrying a dead port made ~40k a second)
    assert totals1["resets_out"] - totals0["resets_out"] == kernel_out
    assert totals1["resets_in"] - totals0["resets_in"] == 8  # each reached the other side
    assert totals1["events_unsent"] == totals0["events_unsent"]  # far below the rate
    assert len(out) == 4 and not any(e.conn.local_port == closed for e in out)
    assert len(got) == 4 and not any(e.conn.remote_port == closed for e in got)
    assert delta(before[netns.a], after[netns.a], "TcpExtTCPAbortOnData") == 2
    assert delta(before[netns.b], after[netns.b], "TcpExtTCPAbortOnClose") == 2
    # sent by the server that closed unread data; v6 addresses decoded from sockaddr_in6
    assert sum(e.conn == TcpTuple(B_ADDR6, port + 10, A_ADDR6, e.conn.remote_port)
               for e in out) == 2
    # per connection: the aborting client sent one, the server received one
    for info in results["linger0" + B_ADDR]:
        c = TcpTuple(A_ADDR, int(str(info["lport"])), B_ADDR, port)
        conns = ours(kernel, port)
        assert (conns[c].resets_out, conns[c].resets_in) == (1, 0)
        assert (conns[c.reversed()].resets_out, conns[c.reversed()].resets_in) == (0, 1)
        assert not conns[c].time_wait and conns[c].closed_ns


def test_time_wait_counts_equal_ss(netns: PeerNetns, kernel: loader.Kernel,
                                   ring: loader.RingSource) -> None:
    client_first, server_first = 47014, 47015
    sig = TcpSignals(BccMaps(kernel.bpf))
    entries0 = sig.time_wait_entries()
    netns.server(netns.b, B_ADDR, client_first, "echo")
    netns.server(netns.b, B_ADDR, server_first, "close_first")
    for port, how, n in ((client_first, "once", 4), (server_first, "wait_eof", 3)):
        cli = netns.client(netns.a, B_ADDR, port, how, n)
        assert cli.stdin is not None
        cli.stdin.write("go\n")
        cli.stdin.flush()
        finish(cli)
        wait_closed(netns, port)
    netns.stop_servers()
    entries = sig.time_wait_entries()
    gauge = sig.sample().time_wait
    ss_client = len(netns.sockets(netns.a, client_first, "time-wait"))
    ss_server = len(netns.sockets(netns.b, server_first, "time-wait"))
    peer_side = entries.get(("peer", client_first), 0) - entries0.get(("peer", client_first), 0)
    local_side = entries.get(("local", server_first), 0) - entries0.get(("local", server_first), 0)
    print(f"ss time-wait: clients {ss_client}, server {ss_server}; ours: peer-port "
          f"{client_first}={peer_side} local-port {server_first}={local_side}; gauge {gauge}")
    assert (ss_client, ss_server) == (4, 3)
    assert (peer_side, local_side) == (ss_client, ss_server)
    assert gauge[("peer", client_first)] == ss_client
    assert gauge[("local", server_first)] == ss_server
    assert ("local", client_first) not in entries  # the passive closer has no TIME_WAIT


def test_srtt_only_of_traced_connections(netns: PeerNetns, kernel: loader.Kernel,
                                        ring: loader.RingSource) -> None:
    """tcp_probe copies the srtt of traced connections only (bpf/sockio.h's rtt_socks): an
    untraced client's 50 round trips leave its side at 0 while the traced server's side
    has one; registered from user space (a connection open before the agent), the client's
    side gets one at its next write."""
    port = 47018
    netns.server(netns.b, B_ADDR, port, "echo")  # a child of this process: traced
    cli = netns.client(netns.a, B_ADDR, port, "keep", 50)
    assert cli.stdin is not None and cli.stdout is not None
    targets = kernel.bpf["target_pids"]
    del targets[targets.Key(cli.pid)]  # forked from a traced process; not any more
    cli.stdin.write("go\n")
    cli.stdin.flush()
    info = json.loads(cli.stdout.readline())
    try:
        c = TcpTuple(A_ADDR, int(info["lport"]), B_ADDR, port)
        conns = ours(kernel, port)
        print(f"untraced client: client side {conns[c]}, server side {conns[c.reversed()]}")
        assert conns[c].opened_ns and conns[c.reversed()].opened_ns  # both ends seen to open
        assert conns[c].srtt_us == 0
        assert conns[c.reversed()].srtt_us > 0
        kernel.register_conn(cli.pid, int(info["fd"]), 1 << 40, int(Role.CLIENT))
        cli.stdin.write("more\n")
        cli.stdin.flush()
        cli.stdout.readline()
        srtt = ours(kernel, port)[c].srtt_us
        print(f"registered from user space: client side srtt {srtt} us")
        assert srtt > 0
        assert_hints_cover(kernel)
    finally:
        cli.stdin.write("done\n")
        cli.stdin.flush()
        cli.communicate(timeout=10)
        netns.stop_servers()
        kernel.forget_pid(cli.pid, [int(info["fd"])])
        drain(ring)


RTT_HINTS = 16384  # bpf/sockio.h's SITS_RTT_HINTS


def rtt_hint_index(sk: int) -> int:
    """bpf/sockio.h's rtt_hint_index."""
    return ((sk >> 6) ^ (sk >> 20)) & (RTT_HINTS - 1)


def assert_hints_cover(kernel: loader.Kernel) -> None:
    """tcp_probe skips a socket whose bucket counts none (bpf/sockio.h's rtt_hints): every
    socket in rtt_socks must be counted in its bucket, and with nothing evicted the counts
    are exactly the sockets (a close that took no count back leaves one too many)."""
    socks = [k.value for k in kernel.bpf["rtt_socks"]]
    hints = kernel.bpf["rtt_hints"]
    assert len(hints) == RTT_HINTS
    counts = {i: v.value for i, v in enumerate(hints.values()) if v.value}
    want: dict[int, int] = {}
    for sk in socks:
        want[rtt_hint_index(sk)] = want.get(rtt_hint_index(sk), 0) + 1
    print(f"rtt_socks {len(socks)} sockets; rtt_hints {sum(counts.values())} in "
          f"{len(counts)} buckets")
    assert socks
    assert counts == want


def test_srtt_matches_ss_over_ipv6(netns: PeerNetns, kernel: loader.Kernel,
                                   ring: loader.RingSource) -> None:
    port = 47016
    sig = TcpSignals(BccMaps(kernel.bpf))
    netns.server(netns.b, "::", port, "echo")
    cli = netns.client(netns.a, B_ADDR6, port, "keep", 50)
    assert cli.stdin is not None and cli.stdout is not None
    cli.stdin.write("go\n")
    cli.stdin.flush()
    info = json.loads(cli.stdout.readline())
    try:
        ss = sh(*netns.exec(netns.a, "ss", "-Htin", "state", "established",
                             f"( dport = :{port} )"))
        m = re.search(r"\brtt:([\d.]+)/", ss)
        assert m, ss
        ss_us = float(m.group(1)) * 1000
        c = TcpTuple(A_ADDR6, int(info["lport"]), B_ADDR6, port)
        st = sig.conn_stats(c)
        assert st is not None and st.opened_ns and not st.closed_ns
        print(f"srtt: ss {ss_us:.0f} us, tcp_probe {st.srtt_us} us")
        # tcp_probe fires before the segment's ACK updates srtt: ours lags by one sample
        assert st.srtt_us > 0
        assert abs(st.srtt_us - ss_us) <= max(100.0, 0.5 * ss_us)
        ex = Exchange(ConnInfo(conn_id=3, pid=cli.pid, fd=0, role=Role.CLIENT,
                               local_address=A_ADDR6, local_port=c.local_port,
                               peer_address=B_ADDR6, peer_port=port),
                      RequestHead("GET", "/", "1.1", [], 0, 1), None)
        span = Span("0" * 32, "0" * 16, None, "GET", "CLIENT", 0, 0)
        sig.annotate(ex, span)
        assert span.attributes["sits.tcp.srtt_us"] == st.srtt_us
    finally:
        cli.stdin.write("done\n")
        cli.stdin.flush()
        cli.communicate(timeout=10)
        netns.stop_servers()
