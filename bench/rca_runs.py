"""Labelled fault runs for the RCA evaluation: a streamed (SSE) completion server with a
downstream dependency, a Poisson load generator replaying Azure LLM trace request sizes, the
agent recording (`sits-trace record`), and faults injected one after another with their labels.

  python bench/rca_runs.py run --seed 0 --out runs/        # as root; ~4 min per run
  python bench/rca_runs.py serve --port P --dep-port D     # (the runner starts these)
  python bench/rca_runs.py dep --port D
  python bench/rca_runs.py load --port P --rate R --seed S --control FILE --trace CSV

Faults (each a labelled episode): cpu_starvation (stress-ng --cpu N in the server's session,
so autogroup scheduling makes it compete), server_queueing (arrival rate x3..x4),
request_mix_shift (long prompts and outputs from the trace's upper quartile),
slow_dependency (the dependency answers 25..60 ms later). `--net`: network_delay and
network_loss through bench/faults' TUN relay (the load in a client netns). `--mem`:
host_memory_pressure, the server reading its per-token work from 256 MiB of mmap'd
"weights" in a memory cgroup of its own, squeezed by a competitor in that cgroup (with a
cpu_starvation episode as the contrast).

Request sizes: Azure LLM inference trace 2023 (conversation), Microsoft Azure, CC-BY 4.0
("Splitwise", ISCA 2024), tokens scaled down (prompt / 16, output / 8) for a 2-core VM.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import http.client
import http.server
import json
import os
import random
import signal
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _data_dir() -> Path:
    """../shared/data beside the checkout (a worktree sits one level deeper)."""
    env = os.environ.get("SITS_DATA_DIR")
    if env:
        return Path(env)
    for parent in Path(__file__).resolve().parents[1:4]:
        if (parent / "shared" / "data").is_dir():
            return parent / "shared" / "data"
    return Path(__file__).resolve().parents[2] / "shared" / "data"


DATA = _data_dir()
# the whole trace beside the checkout, else the repository's excerpt (a clean clone)
TRACE = next((p for p in (DATA / "azure_llm_inference_2023_conv.csv",
                          Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "azure"
                          / "conv_first_120.csv") if p.is_file()),
             DATA / "azure_llm_inference_2023_conv.csv")
TOKEN_CPU_ITERS = 20  # sha256 rounds of 4 KiB per output token (~0.1 ms CPU)
TOKEN_SLEEP_S = 0.004  # the "GPU" time of a decode step
SLOTS = 3  # requests served at once; the rest wait (dynamic batching stand-in)
_BUF = b"x" * 4096


_WEIGHTS: list[Any] = []  # serve --weights: the mmap'd "model", read page by page
_step = [0]


def _burn(n: int) -> None:
    if _WEIGHTS:  # the same work, on pages spread over the whole file (a forward pass)
        mm, pages = _WEIGHTS[0], len(_WEIGHTS[0]) // 4096
        for _ in range(n):
            _step[0] += 1
            off = (_step[0] * 2654435761 % pages) * 4096
            hashlib.sha256(mm[off:off + 4096]).digest()
        return
    for _ in range(n):
        hashlib.sha256(_BUF).digest()


def make_weights(path: Path, nbytes: int) -> Path:
    """A file of random "weights", written to disk and dropped from the page cache, so that
    the server's own faults bring it in (and charge it to the server's memory cgroup)."""
    with path.open("wb") as f:
        for _ in range(nbytes // (1 << 20)):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


# ---- the server ----

class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(port: int, dep_port: int, host: str = "127.0.0.1", weights: Path | None = None
          ) -> None:
    if weights is not None:
        import mmap

        with weights.open("rb") as f:
            _WEIGHTS.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        _burn(len(_WEIGHTS[0]) // 4096 * 2)  # loaded: every page read once (or nearly)
    slots = threading.BoundedSemaphore(SLOTS)
    local = threading.local()

    def dep_call() -> None:
        c = getattr(local, "conn", None)
        if c is None:
            c = local.conn = http.client.HTTPConnection("127.0.0.1", dep_port, timeout=10)
        try:
            c.request("GET", "/tokenize")
            c.getresponse().read()
        except (OSError, http.client.HTTPException):
            local.conn = None

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            n_in, n_out = int(body.get("prompt_tokens", 16)), int(body.get("max_tokens", 8))
            dep_call()
            with slots:
                kv = bytearray(n_in * 1024)  # the request's cache
                _burn(max(1, n_in // 8))  # prefill
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(n_out):
                    _burn(TOKEN_CPU_ITERS)
                    time.sleep(TOKEN_SLEEP_S)
                    data = b'data: {"i":%d,"t":"tok"}\n\n' % i
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                del kv
            self.wfile.write(b"0\r\n\r\n")

    _Server((host, port), H).serve_forever()


def dep(port: int) -> None:
    delay = [0.002]

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.startswith("/set?delay_ms="):
                delay[0] = float(self.path.split("=", 1)[1]) / 1e3
            else:
                time.sleep(delay[0])
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

    _Server(("127.0.0.1", port), H).serve_forever()


# ---- the load ----

def sizes(path: Path, limit: int = 20000) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    with path.open() as f:
        for row in csv.DictReader(f):
            out.append((max(1, min(256, int(row["ContextTokens"]) // 16)),
                        max(2, min(48, int(row["GeneratedTokens"]) // 12))))
            if len(out) >= limit:
                break
    return out


def load(port: int, rate: float, seed: int, control: Path, trace: Path,
         host: str = "127.0.0.1") -> None:
    rng = random.Random(seed)
    normal = sizes(trace)
    by_size = sorted(normal, key=lambda s: s[0] + 4 * s[1])
    long = by_size[3 * len(by_size) // 4:]
    ctl: dict[str, Any] = {"rate_mult": 1.0, "mix": "normal"}
    local = threading.local()
    sem = threading.BoundedSemaphore(64)

    def one(n_in: int, n_out: int) -> None:
        try:
            c = getattr(local, "conn", None)
            if c is None:
                c = local.conn = http.client.HTTPConnection(host, port, timeout=30)
            body = json.dumps({"prompt_tokens": n_in, "max_tokens": n_out, "stream": True})
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            c.getresponse().read()
        except (OSError, http.client.HTTPException):
            local.conn = None
        finally:
            sem.release()

    last_ctl = 0.0
    while True:
        now = time.monotonic()
        if now - last_ctl > 0.5:
            last_ctl = now
            try:
                ctl.update(json.loads(control.read_text()))
            except (OSError, ValueError):
                pass
        time.sleep(rng.expovariate(rate * float(ctl["rate_mult"])))
        n_in, n_out = rng.choice(long if ctl["mix"] == "long" else normal)
        if sem.acquire(blocking=False):
            threading.Thread(target=one, args=(n_in, n_out), daemon=True).start()


# ---- a labelled run ----

FAULTS = ("cpu_starvation", "server_queueing", "request_mix_shift", "slow_dependency")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float = 10) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


class Episode:
    """Start and stop one fault; returns its culprit for the label."""

    def __init__(self, cause: str, intensity: float, control: Path, dep_port: int) -> None:
        self.cause, self.intensity = cause, intensity
        self.control, self.dep_port = control, dep_port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> dict[str, Any] | None:
        if self.cause == "cpu_starvation":
            n = int(self.intensity)
            # same session as the server (this runner's): autogroup makes them compete
            self.proc = subprocess.Popen(["stress-ng", "--cpu", str(n), "--timeout", "120"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.5)  # its workers are forked by then
            return {"pid": self.proc.pid, "name": "stress-ng", "pids": _tree(self.proc.pid)}
        if self.cause == "server_queueing":
            self.control.write_text(json.dumps({"rate_mult": self.intensity, "mix": "normal"}))
        elif self.cause == "request_mix_shift":
            self.control.write_text(json.dumps({"rate_mult": 1.0, "mix": "long"}))
        elif self.cause == "slow_dependency":
            _get(self.dep_port, f"/set?delay_ms={self.intensity}")
            return {"peer": f"127.0.0.1:{self.dep_port}"}
        return None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.control.write_text(json.dumps({"rate_mult": 1.0, "mix": "normal"}))
        _get(self.dep_port, "/set?delay_ms=2")


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            kids = Path(f"/proc/{pid}/task/{t}/children").read_text().split()
            for k in kids:
                out.extend(_tree(int(k)))
    except OSError:
        pass
    return out


def _get(port: int, path: str) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", path)
    c.getresponse().read()
    c.close()


def _record(sits: str, rec: Path, total: float, *pids: int) -> subprocess.Popen[str]:
    """`sits-trace record` of `pids` for `total` s, returned once it records. Every exchange
    captured (no load shedding): the labels judge the analysis, not sampling."""
    env = {**os.environ, "SITS_TRACE_CPU_BUDGET": "0"}
    argv = [sits, "record", "--out", str(rec), "--duration", str(total)]
    for pid in pids:
        argv += ["-p", str(pid)]
    recorder = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    assert recorder.stderr is not None
    for line in recorder.stderr:
        if "recording" in line:
            break
    return recorder


INTENSITY = {"cpu_starvation": (2, 3, 4), "server_queueing": (4.0, 5.0, 6.0),
             "request_mix_shift": (1.0,), "slow_dependency": (25.0, 40.0, 60.0)}


def run(seed: int, out_dir: Path, baseline_s: float, fault_s: float, gap_s: float,
        rate: float, sits: str) -> Path:
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = out_dir / f"run-{seed}.jsonl.gz"
    control = out_dir / f".control-{seed}.json"
    control.write_text(json.dumps({"rate_mult": 1.0, "mix": "normal"}))
    port, dep_port = _free_port(), _free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    procs = [subprocess.Popen([*me, "dep", "--port", str(dep_port)])]
    procs.append(subprocess.Popen([*me, "serve", "--port", str(port), "--dep-port", str(dep_port)]))
    _wait_port(dep_port)
    _wait_port(port)
    order = list(FAULTS)
    rng.shuffle(order)
    total = baseline_s + len(order) * (fault_s + gap_s) + 5
    recorder = _record(sits, rec, total, procs[1].pid)
    procs.append(subprocess.Popen([*me, "load", "--port", str(port), "--rate", str(rate),
                                   "--seed", str(seed), "--control", str(control),
                                   "--trace", str(TRACE)]))
    labels: list[dict[str, Any]] = []
    try:
        time.sleep(baseline_s)
        for cause in order:
            ep = Episode(cause, rng.choice(INTENSITY[cause]), control, dep_port)
            t0 = time.time_ns()
            culprit = ep.start()
            time.sleep(fault_s)
            ep.stop()
            labels.append({"cause": cause, "culprit": culprit, "start_ns": t0,
                           "end_ns": time.time_ns(), "intensity": ep.intensity, "seed": seed,
                           "server_pid": procs[1].pid})
            time.sleep(gap_s)
        recorder.wait(timeout=total + 60)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(5)
    with gzip.open(rec, "at") as f:  # a second gzip member: readers see one stream
        for lab in labels:
            f.write(json.dumps({"type": "label", **lab}) + "\n")
    return rec


NET_INTENSITY = {"network_delay": (10.0, 20.0, 40.0), "network_loss": (0.03, 0.05, 0.1)}


def run_net(seed: int, out_dir: Path, baseline_s: float, fault_s: float, gap_s: float,
            rate: float, sits: str) -> Path:
    """network_delay and network_loss between the load (client netns) and the server (root
    netns), through bench/faults' TUN relay. Both the server and the load generator are traced:
    the client's spans carry what the network did to the exchange."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.faults.netns import Topology

    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = out_dir / f"net-{seed}.jsonl.gz"
    control = out_dir / f".control-net-{seed}.json"
    control.write_text(json.dumps({"rate_mult": 1.0, "mix": "normal"}))
    me = [sys.executable, str(Path(__file__).resolve())]
    order = list(NET_INTENSITY)
    rng.shuffle(order)
    total = baseline_s + len(order) * (fault_s + gap_s) + 5
    labels: list[dict[str, Any]] = []
    with Topology(server_in_root=True, seed=seed) as topo:
        host, port, dep_port = topo.ip_of("server"), _free_port(), _free_port()
        procs = [subprocess.Popen([*me, "dep", "--port", str(dep_port)])]
        procs.append(subprocess.Popen([*me, "serve", "--port", str(port), "--dep-port",
                                       str(dep_port), "--host", host]))
        _wait_port(dep_port)
        time.sleep(1.0)
        load_p = topo.popen("client", [*me, "load", "--port", str(port), "--rate", str(rate),
                                       "--seed", str(seed), "--control", str(control),
                                       "--host", host, "--trace", str(TRACE)])
        recorder = _record(sits, rec, total, procs[1].pid, load_p.pid)
        try:
            time.sleep(baseline_s)
            for cause in order:
                x = rng.choice(NET_INTENSITY[cause])
                kw = {"delay_ms": x} if cause == "network_delay" else {"loss": x}
                t0 = topo.set_link(**kw)
                time.sleep(fault_s)
                t1 = topo.set_link()
                # judged on the client's spans, whose peer across the bad link is the server
                labels.append({"cause": cause, "culprit": {"peer": host},
                               "start_ns": t0, "end_ns": t1, "intensity": x, "seed": seed,
                               "server_pid": procs[1].pid, "client_pid": load_p.pid,
                               "judge": "CLIENT"})
                time.sleep(gap_s)
            recorder.wait(timeout=total + 60)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(5)
    with gzip.open(rec, "at") as f:
        for lab in labels:
            f.write(json.dumps({"type": "label", **lab}) + "\n")
    return rec


MEM_FAULTS = ("host_memory_pressure", "host_memory_pressure", "cpu_starvation")
MEM_SQUEEZE = (0.03, 0.06, 0.1)  # of the weights' page cache, pushed out by the competitor
WEIGHTS_MB = 256


def run_mem(seed: int, out_dir: Path, baseline_s: float, fault_s: float, gap_s: float,
            rate: float, sits: str) -> Path:
    """host_memory_pressure: the server reads its per-token work from mmap'd "weights" and
    runs in a memory cgroup of its own (a pod's limit); a competitor started in that cgroup
    holds 512 MiB under a limit that makes room only by reclaiming part of the weights' page
    cache (bench/faults/competitors.py, start_memory_squeeze). A cpu_starvation episode in
    the same run is the contrast (a verdict that always says memory is wrong there)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.faults.competitors import MemoryCgroup, start_memory_squeeze

    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = out_dir / f"mem-{seed}.jsonl.gz"
    control = out_dir / f".control-mem-{seed}.json"
    control.write_text(json.dumps({"rate_mult": 1.0, "mix": "normal"}))
    weights = make_weights(out_dir / f".weights-{seed}.bin", WEIGHTS_MB << 20)
    order = list(MEM_FAULTS)
    rng.shuffle(order)
    squeezes = rng.sample(MEM_SQUEEZE, 2)
    total = baseline_s + len(order) * (fault_s + gap_s) + 5
    port, dep_port = _free_port(), _free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    cg = MemoryCgroup()
    procs: list[subprocess.Popen[bytes]] = []
    labels: list[dict[str, Any]] = []
    try:
        procs.append(subprocess.Popen([*me, "dep", "--port", str(dep_port)]))
        procs.append(subprocess.Popen(  # noqa: PLW1509 (this runner has no threads yet)
            [*me, "serve", "--port", str(port), "--dep-port", str(dep_port),
             "--weights", str(weights)], preexec_fn=cg.join))
        _wait_port(dep_port)
        _wait_port(port, timeout=60)  # it reads the weights in first
        recorder = _record(sits, rec, total, procs[1].pid)
        procs.append(subprocess.Popen([*me, "load", "--port", str(port), "--rate", str(rate),
                                       "--seed", str(seed), "--control", str(control),
                                       "--trace", str(TRACE)]))
        time.sleep(baseline_s)
        for cause in order:
            if cause == "host_memory_pressure":
                x = squeezes.pop()
                comp = start_memory_squeeze(cg, int(x * (WEIGHTS_MB << 20)),
                                            duration_s=fault_s + 30)
                t0 = time.time_ns()
                culprit: dict[str, Any] | None = comp.culprit()
                time.sleep(fault_s)
                comp.stop()
            else:
                ep = Episode(cause, x := rng.choice(INTENSITY[cause]), control, dep_port)
                t0 = time.time_ns()
                culprit = ep.start()
                time.sleep(fault_s)
                ep.stop()
            labels.append({"cause": cause, "culprit": culprit, "start_ns": t0,
                           "end_ns": time.time_ns(), "intensity": x, "seed": seed,
                           "server_pid": procs[1].pid})
            time.sleep(gap_s)
        recorder.wait(timeout=total + 60)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(5)
        cg.remove()
        weights.unlink(missing_ok=True)
    with gzip.open(rec, "at") as f:
        for lab in labels:
            f.write(json.dumps({"type": "label", **lab}) + "\n")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--dep-port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--weights", type=Path, default=None,
                   help="a file the server mmaps and reads its per-token work from")
    d = sub.add_parser("dep")
    d.add_argument("--port", type=int, required=True)
    lo = sub.add_parser("load")
    lo.add_argument("--port", type=int, required=True)
    lo.add_argument("--rate", type=float, default=10.0)
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument("--control", type=Path, required=True)
    lo.add_argument("--trace", type=Path, default=TRACE)
    lo.add_argument("--host", default="127.0.0.1")
    r = sub.add_parser("run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=Path("runs"))
    r.add_argument("--baseline", type=float, default=30.0)
    r.add_argument("--fault", type=float, default=12.0)
    r.add_argument("--gap", type=float, default=20.0)
    r.add_argument("--rate", type=float, default=5.0)
    r.add_argument("--sits", default=str(Path(sys.executable).parent / "sits-trace"))
    r.add_argument("--net", action="store_true",
                   help="network faults: the load in a client netns behind bench/faults' relay")
    r.add_argument("--mem", action="store_true",
                   help="host_memory_pressure: the server's mmap'd weights squeezed out of "
                        "its memory cgroup by a competitor in it")
    a = ap.parse_args()
    if a.cmd == "serve":
        serve(a.port, a.dep_port, a.host, a.weights)
    elif a.cmd == "dep":
        dep(a.port)
    elif a.cmd == "load":
        load(a.port, a.rate, a.seed, a.control, a.trace, a.host)
    elif a.mem:
        print(run_mem(a.seed, a.out, a.baseline, a.fault, a.gap, a.rate, a.sits))
    elif a.net:
        print(run_net(a.seed, a.out, a.baseline, a.fault, a.gap, a.rate, a.sits))
    else:
        print(run(a.seed, a.out, a.baseline, a.fault, a.gap, a.rate, a.sits))


if __name__ == "__main__":
    main()
