"""The agent's CPU at a paced nginx load, one agent against another or one config against another.

    .venv/bin/python bench/agent_cpu.py [--connections 10] [--paced-ms 10] [--seconds 8]
        [--rounds 3] [--config a.toml] [--baseline /other/.venv/bin/python] [--baseline-config b.toml]
        [--baseline-env NAME=VALUE ...] [--otlp]

nginx (`return 200`) under wrk, each of `--connections` waiting `--paced-ms` between requests
(10 x 10 ms: about 1k requests/s; 20 x 2 ms: as many as the VM gives, ~7k here; 1 x 1000 ms:
the agent nearly idle). The agent runs `trace --json --pid <nginx> --cpu-budget 0` (full
capture, output to /dev/null) with `--config` when given; its CPU (utime + stime from /proc)
is taken over `--seconds` once wrk has run for two. With `--baseline` and/or
`--baseline-config` the two sides alternate, round by round, so drift in the machine's load
hits both; `--baseline-env SITS_NATIVE=0` makes the baseline this checkout with its hot path
interpreted instead of compiled (agent/native.py). Prints requests/s, agent cores and agent µs per request (every request is a span:
full capture, nothing shed) for each run, then the medians.

`--otlp`: the agent runs as the service does (`sits-trace run`, a config with `trace.pids`,
full capture, no JSON lines, control loop and API sockets off; `--as-shipped`: on) and exports every span over
OTLP/HTTP to a receiver in this process, which counts the spans it got (parsed with
opentelemetry-proto) so a side that dropped or never sent spans shows; RED and agent
metrics go over OTLP too, as shipped (`--no-otlp-metrics`: traces only).
"""

from __future__ import annotations

import argparse
import http.server
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # the sibling bench: nginx and wrk helpers


class Receiver:
    """OTLP/HTTP: answers 200; counts the spans of every traces request (/v1/traces) and the
    metrics requests (/v1/metrics)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        recv = self
        self.spans = 0
        self.metric_requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.endswith("/v1/metrics"):
                    recv.metric_requests += 1
                else:
                    req = ExportTraceServiceRequest.FromString(body)
                    recv.spans += sum(len(ss.spans) for rs in req.resource_spans
                                      for ss in rs.scope_spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{self.base}/v1/traces"


def _service_config(d: Path, nginx_pid: int, url: str, extra: str | None,
                    metrics: bool = True, shipped: bool = False) -> str:
    """`url`: the receiver's base URL (/v1/traces and /v1/metrics are appended). `shipped`:
    the API socket (`top`) and the control loop (advise) stay on, as they ship."""
    p = d / "otlp.toml"
    off = "" if shipped else """
[api]
socket = ""

[control]
enabled = false
"""
    p.write_text(f"""[trace]
pids = [{nginx_pid}]
cpu_budget = 0

[export]
jsonl_path = ""
otlp_endpoint = "{url}"
otlp_protocol = "http/protobuf"
otlp_metrics = {str(metrics).lower()}
""" + off + (Path(extra).read_text() if extra else ""))
    return str(p)


def one_run(python: str, config: str | None, a: argparse.Namespace,
            receiver: Receiver | None = None,
            env: dict[str, str] | None = None) -> tuple[float, float]:
    """(requests/s, agent cores) of one run."""
    sits = str(Path(python).parent / "sits-trace")
    port = overhead.free_port()
    with tempfile.TemporaryDirectory() as d:
        pace = Path(d) / "pace.lua"
        pace.write_text(f"function delay() return {a.paced_ms} end\n")
        nginx = overhead.start_nginx(Path(d), port, 1)
        if receiver is not None:
            cmd = [sits, "run", "--config",
                   _service_config(Path(d), nginx.pid, receiver.base, config,
                                   not a.no_otlp_metrics, a.as_shipped)]
            ready = overhead.RUN_READY
        else:
            cmd = [sits, "trace", "--json", "--pid", str(nginx.pid), "--cpu-budget", "0"]
            cmd += ["--config", config] if config else []
            ready = overhead.TRACE_READY
        agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, **(env or {})})
        try:
            assert agent.stderr is not None
            for line in agent.stderr:
                if line.startswith(ready):
                    break
            wrk = subprocess.Popen(["wrk", "-t1", f"-c{a.connections}", f"-d{a.seconds + 3}s",
                                    "-s", str(pace), f"http://127.0.0.1:{port}/"],
                                   stdout=subprocess.PIPE, text=True)
            time.sleep(2)
            c0 = overhead.cpu_seconds(agent.pid)
            time.sleep(a.seconds)
            cpu = overhead.cpu_seconds(agent.pid) - c0
            out, _ = wrk.communicate(timeout=60)
        finally:
            overhead.stop_agent(agent)
            nginx.terminate()
            nginx.wait(timeout=10)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return (float(m.group(1)) if m else 0.0), cpu / a.seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=10)
    ap.add_argument("--paced-ms", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", help="TOML config for the agent under test")
    ap.add_argument("--baseline", help="python of another checkout's venv to alternate with")
    ap.add_argument("--baseline-config", help="TOML config for the baseline side")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for the baseline side's agent (repeatable)")
    ap.add_argument("--otlp", action="store_true",
                    help="run as the service, every span over OTLP/HTTP to a receiver here")
    ap.add_argument("--as-shipped", action="store_true",
                    help="with --otlp: the API socket and the control loop on, as they ship")
    ap.add_argument("--no-otlp-metrics", action="store_true",
                    help="with --otlp: traces only (export.otlp_metrics = false; on by default)")
    a = ap.parse_args()
    receiver = Receiver() if a.otlp else None
    benv = dict(kv.split("=", 1) for kv in a.baseline_env)
    sides: list[tuple[str, str, str | None, dict[str, str]]] = [
        ("this", sys.executable, a.config, {})]
    if a.baseline or a.baseline_config or benv:
        sides.append(("baseline", a.baseline or sys.executable, a.baseline_config, benv))
    got: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in sides}
    for r in range(a.rounds):
        for name, python, config, env in sides if r % 2 == 0 else sides[::-1]:
            before = receiver.spans if receiver is not None else 0
            rps, cores = one_run(python, config, a, receiver, env)
            got[name].append((rps, cores))
            per = cores / rps * 1e6 if rps else float("nan")
            spans = (f", {receiver.spans - before} spans received"
                     if receiver is not None else "")
            print(f"round {r + 1} {name}: {rps:.0f} req/s, agent {cores:.3f} cores, "
                  f"{per:.1f} µs/request{spans}", flush=True)
    for name, runs in got.items():
        rps = statistics.median(x[0] for x in runs)
        cores = statistics.median(x[1] for x in runs)
        per = statistics.median(x[1] / x[0] * 1e6 for x in runs if x[0])
        print(f"{name}: median {rps:.0f} req/s, agent {cores:.3f} cores, {per:.1f} µs/request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
