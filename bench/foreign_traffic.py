"""The agent's CPU while traffic that is not the traced server's own runs on the node.

- dead-port: a second nginx is given one wrk connection (paced, 1 request a second), then
  stopped: wrk keeps reconnecting as fast as it can, every attempt refused with a reset each
  way (~40k a second here). The agent traces the first nginx (`trace --json`, default
  budget), which keeps serving a request every 0.2 s. Prints the agent's cores over the storm,
  the resets the kernel sent (TcpOutRsts) and the agent's stats line.
- non-http: one Python process holds both ends of a local connection and ping-pongs a
  Redis-style SET and +OK over it (a model server's cache or database client, in the small);
  the agent traces it. Prints the round trips a second, the agent's cores and its stats line
  (records sent, shed, connections muted).

With --baseline, each round runs that checkout's agent too, alternating.

Usage: bench/foreign_traffic.py [--case dead-port] [--case non-http] [--seconds 8] [--rounds 2]
                                [--baseline /path/to/other/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # the sibling bench: nginx and agent helpers
from faults.netns import parse_proc_net


def trace(sits: str, pid: int) -> subprocess.Popen[str]:
    """`sits-trace trace --json --pid <pid>` at its default budget, once it is tracing."""
    agent = subprocess.Popen([sits, "trace", "--json", "--pid", str(pid)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert agent.stderr is not None
    for line in agent.stderr:
        if line.startswith(overhead.TRACE_READY):
            break
    return agent


def out_rsts() -> int:
    """TcpOutRsts of this network namespace (/proc/net/snmp)."""
    return parse_proc_net(Path("/proc/net/snmp").read_text(), "Tcp")["OutRsts"]


def dead_port(sits: str, seconds: float) -> str:
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        traced_port, dead_port = overhead.free_port(), overhead.free_port()
        traced = overhead.start_nginx(Path(d1), traced_port, 1)
        dying = overhead.start_nginx(Path(d2), dead_port, 1)
        agent = trace(sits, traced.pid)
        pace = Path(d2) / "pace.lua"
        pace.write_text("function delay() return 1000 end\n")
        wrk = subprocess.Popen(["wrk", "-t1", "-c1", f"-d{seconds + 4:.0f}s", "-s", str(pace),
                                f"http://127.0.0.1:{dead_port}/"], stdout=subprocess.DEVNULL)
        time.sleep(1.5)
        dying.terminate()
        dying.wait(timeout=10)
        time.sleep(1)
        c0, r0, t0 = overhead.cpu_seconds(agent.pid), out_rsts(), time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:  # the traced server keeps working meanwhile
            subprocess.run(["curl", "-s", "-o", "/dev/null", f"http://127.0.0.1:{traced_port}/"],
                           check=False)
            time.sleep(0.2)
        cores = (overhead.cpu_seconds(agent.pid) - c0) / (time.monotonic() - t0)
        resets = out_rsts() - r0
        wrk.wait(timeout=60)
        lines = overhead.stop_agent(agent)
        traced.terminate()
        traced.wait(timeout=10)
    stats = next((ln for ln in reversed(lines) if "records=" in ln), "")
    return f"agent {cores:.3f} cores while the kernel sent {resets / seconds:.0f} resets/s | {stats}"


PEER = r'''
import socket, sys, threading, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
def serve():
    c, _ = srv.accept()
    while True:
        d = c.recv(4096)
        if not d: break
        c.sendall(b"+OK\r\n")
threading.Thread(target=serve, daemon=True).start()
c = socket.create_connection(srv.getsockname())
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print("ready", flush=True)
sys.stdin.readline()
end, n = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    c.sendall(b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n"); c.recv(64); n += 1
print("ops", n, flush=True)
'''


def non_http(sits: str, seconds: float) -> str:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "peer.py"
        script.write_text(PEER)
        peer = subprocess.Popen([sys.executable, str(script), str(seconds)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert peer.stdout is not None and peer.stdin is not None
        assert peer.stdout.readline().startswith("ready")
        agent = trace(sits, peer.pid)
        c0, t0 = overhead.cpu_seconds(agent.pid), time.monotonic()
        peer.stdin.write("go\n")
        peer.stdin.flush()
        ops = int(peer.stdout.readline().split()[1])
        cores = (overhead.cpu_seconds(agent.pid) - c0) / (time.monotonic() - t0)
        peer.wait(timeout=10)
        lines = overhead.stop_agent(agent)
    stats = next((ln for ln in reversed(lines) if "records=" in ln), "")
    muted = next((ln.split("conns_muted=")[1] for ln in lines if "conns_muted=" in ln), "n/a")
    return (f"{ops / seconds:.0f} round trips/s; agent {cores:.3f} cores | {stats} "
            f"conns_muted={muted}")


CASES: dict[str, Callable[[str, float], str]] = {"dead-port": dead_port, "non-http": non_http}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="python of another checkout's venv, alternated")
    a = ap.parse_args()
    sides = {"this": str(Path(sys.executable).parent / "sits-trace")}
    if a.baseline:
        sides["base"] = str(Path(a.baseline).parent / "sits-trace")
    for case in a.case or sorted(CASES):
        for r in range(a.rounds):
            for name, sits in sides.items():
                print(f"{case} round {r + 1} [{name}]: {CASES[case](sits, a.seconds)}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
