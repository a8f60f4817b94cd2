"""What the impaired link really does, measured through the kernels' own TCP.

  rtt:   a 1-byte TCP ping-pong across the link (app RTT) and the kernel's smoothed RTT
         (TCP_INFO tcpi_rtt) of the same socket, at a given one-way delay;
  loss:  an HTTP download (python3 -m http.server in the server netns, curl in the client
         netns) at a given loss, with the client netns's RetransSegs before and after;
  rate:  the same download without impairment: the relay's throughput;
  cpu:   a busy victim's run-queue wait alone, with the CPU competitor, and with a
         stress-ng in another session (autogroup: that one should bite far less).
Run: `bench/faults/inject.py --measure` (root); the tests in
tests/integration/test_faults.py call the same functions and assert on them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.faults.competitors import schedstat, start_cpu_competitor
from bench.faults.netns import Topology, TopologyError

TCPI_RTT_OFFSET = 68  # struct tcp_info: tcpi_rtt (us), after 8 bytes of u8s and 15 u32s


@dataclass(frozen=True)
class RttResult:
    delay_ms: float
    app_rtt_ms_median: float
    app_rtt_ms_min: float
    app_rtt_ms_max: float
    kernel_srtt_ms: float
    samples: int


@dataclass(frozen=True)
class TransferResult:
    loss: float
    bytes_expected: int
    bytes_received: int
    curl_ok: bool
    seconds: float
    retrans_segs_client: int
    retrans_segs_server: int  # the sender of a download: where retransmissions happen
    relay_dropped: int

    @property
    def mbit_s(self) -> float:
        return self.bytes_received * 8 / self.seconds / 1e6 if self.seconds > 0 else 0.0


def _echo_server(topo: Topology) -> tuple[socket.socket, int]:
    srv = topo.socket("server")
    srv.bind((topo.server_ip, 0))
    srv.listen(1)

    def serve() -> None:
        try:
            conn, _ = srv.accept()
            with conn:
                while data := conn.recv(64):
                    conn.sendall(data)
        except OSError:
            return  # the topology was torn down under it: the measurement is over

    threading.Thread(target=serve, daemon=True).start()
    return srv, int(srv.getsockname()[1])


def kernel_srtt_ms(s: socket.socket) -> float:
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    (rtt_us,) = struct.unpack_from("I", info, TCPI_RTT_OFFSET)
    return float(rtt_us) / 1000.0


def measure_rtt(topo: Topology, delay_ms: float, samples: int = 20,
                jitter_ms: float = 0.0) -> RttResult:
    """Set one-way `delay_ms` (+-`jitter_ms`), then ping-pong 1 byte `samples` times."""
    topo.set_link(delay_ms=delay_ms, jitter_ms=jitter_ms)
    srv, port = _echo_server(topo)
    cl = topo.socket("client")
    try:
        cl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cl.settimeout(10)
        cl.connect((topo.server_ip, port))
        rtts = []
        for _ in range(samples):
            t = time.perf_counter()
            cl.sendall(b"x")
            if cl.recv(1) != b"x":
                raise TopologyError("echo lost its byte")
            rtts.append((time.perf_counter() - t) * 1000.0)
        return RttResult(delay_ms, statistics.median(rtts), min(rtts), max(rtts),
                         kernel_srtt_ms(cl), samples)
    finally:
        cl.close()
        srv.close()


def http_transfer(topo: Topology, loss: float, size: int, timeout_s: float = 60.0
                  ) -> TransferResult:
    """Download `size` bytes over HTTP through the link at `loss`; count retransmissions."""
    with tempfile.TemporaryDirectory(prefix="sitsf-www-") as www:
        Path(www, "blob").write_bytes(bytes(range(256)) * (size // 256))
        port = _free_port_in(topo)
        server = topo.popen("server", [sys.executable, "-m", "http.server", str(port), "--bind",
                                       topo.server_ip, "--directory", www],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_port(topo, port)
            topo.set_link(loss=loss)
            before = _retrans(topo) + (_dropped(topo),)
            t = time.monotonic()
            curl = topo.popen("client", ["curl", "-sS", "-o", "-", "--max-time", str(timeout_s),
                                         f"http://{topo.server_ip}:{port}/blob"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            body, _ = curl.communicate(timeout=timeout_s + 5)
            secs = time.monotonic() - t
            after = _retrans(topo) + (_dropped(topo),)
        finally:
            topo.set_link()
            server.kill()
            server.wait()
    return TransferResult(loss, size // 256 * 256, len(body), curl.returncode == 0, secs,
                          after[0] - before[0], after[1] - before[1], after[2] - before[2])


def _retrans(topo: Topology) -> tuple[int, int]:
    return topo.snmp("client")["RetransSegs"], topo.snmp("server")["RetransSegs"]


def _dropped(topo: Topology) -> int:
    st = topo.stats()
    return int(st.get("a_to_b", {}).get("dropped_loss", 0)) + int(
        st.get("b_to_a", {}).get("dropped_loss", 0))


def _free_port_in(topo: Topology) -> int:
    with topo.socket("server") as s:
        s.bind((topo.server_ip, 0))
        return int(s.getsockname()[1])


def _wait_port(topo: Topology, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with topo.socket("client") as s:
            s.settimeout(1)
            if s.connect_ex((topo.server_ip, port)) == 0:
                return
        time.sleep(0.05)
    raise TopologyError(f"the HTTP server did not listen on {topo.server_ip}:{port}")


def cpu_effect(seconds: float = 1.5) -> dict[str, object]:
    """A busy victim in its own session: its run-queue wait and CPU per second, alone, with
    `start_cpu_competitor` (same scheduling group), and with a stress-ng in another session."""
    victim = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)
        out: dict[str, object] = {"alone": _rates(victim.pid, seconds)}
        comp = start_cpu_competitor(victim.pid, 1.0, 10)
        try:
            out["same_group"] = _rates(victim.pid, seconds)
            out["placement"] = comp.placement
        finally:
            comp.stop()
        other = subprocess.Popen(["stress-ng", "--cpu", str(os.cpu_count() or 1), "--timeout",
                                  "10s", "-q"], start_new_session=True,
                                 stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            out["other_session"] = _rates(victim.pid, seconds)
        finally:
            os.killpg(other.pid, signal.SIGTERM)
            other.wait()
    finally:
        victim.kill()
        victim.wait()
    return out


def _rates(pid: int, seconds: float) -> dict[str, float]:
    run0, wait0, _ = schedstat(pid)
    time.sleep(seconds)
    run1, wait1, _ = schedstat(pid)
    return {"runq_wait_s_per_s": round((wait1 - wait0) / 1e9 / seconds, 3),
            "on_cpu_s_per_s": round((run1 - run0) / 1e9 / seconds, 3)}


def main(seed: int = 0) -> int:
    with Topology(seed=seed) as topo:
        print(json.dumps({"backend": topo.backend, "client": topo.client_ip,
                          "server": topo.server_ip}))
        for d in (0.0, 10.0, 25.0, 50.0):
            print(json.dumps({"rtt": measure_rtt(topo, d).__dict__}))
        for loss, size in ((0.0, 64 << 20), (0.0, 4 << 20), (0.05, 4 << 20)):
            r = http_transfer(topo, loss, size)
            print(json.dumps({"transfer": r.__dict__ | {"mbit_s": round(r.mbit_s, 1)}}))
    if shutil.which("stress-ng"):
        print(json.dumps({"cpu_competitor": cpu_effect()}))
    return 0
