"""The agent's per-span stages on a hot keep-alive workload, one checkout against another.

    .venv/bin/python bench/hot_path.py [--baseline /tmp/base/.venv/bin/python] [--rounds 3]

What bench/agent_cpu.py measures whole (the agent's CPU beside a real nginx) moves by
0.5-2 µs a span from run to run on this VM; this measures the stages of the agent's own
code, which is where a change lands, with that noise taken out:
- records as bpf/http.c lays them out (struct data_event): `--exchanges` nginx-like
  exchanges (request and response, two records each) over 50 keep-alive connections, each
  connection its own fd, without an x-request-id (as wrk and most clients send them) unless
  `--request-id`;
- `tracer`: the tracer's whole path from ring record to span (decode, parse, span), the
  same records fed again and again to one Tracer, so its connections stay open;
- `otlp`: the shipped OTLP encoder (exporters/_otlp_traces.py) over those spans, a
  request per batch of 512; `red`: the RED histograms (exporters/_red.py); `live`: `top`'s
  live view (analyzers/live.py), in the tracer's batches (64 here). `run` as shipped does
  all four; `trace --json` the first and its JSON lines.
Each stage runs `--loops` times over the same spans with the cyclic collector off (a full
collection lands in whichever stage it lands in: bench/span_cost.py's numbers move with
it), the median of `--repeat` such runs is its µs a span (wall time of one thread, on an
otherwise idle machine). With `--baseline`, the other checkout's python runs this same
script over its own code, round by round, alternating who goes first.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from span_cost import RESP, data_record  # the record layout bench/span_cost.py writes

# wrk's request: no x-request-id unless --request-id (then one per request, as span_cost's)
REQ = (b"GET /index.html HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: wrk\r\n"
       b"Accept: */*\r\n%s\r\n")


def records(exchanges: int, request_id: bool, conns: int = 50) -> list[bytes]:
    out = []
    t = 1_000_000_000
    for i in range(exchanges):
        cid = 1 + i % conns
        extra = b"x-request-id: %016x\r\n" % i if request_id else b""
        # each connection its own fd: one fd for all would replace a connection per record
        out.append(data_record(cid, 0, t, REQ % extra, fd=100 + cid))
        out.append(data_record(cid, 1, t + 30_000, RESP, fd=100 + cid))
        t += 50_000
    return out


def per_span(fn: Callable[[], int], loops: int, repeat: int) -> float:
    """Median over `repeat` runs of `loops` calls of fn (which returns its span count): µs a
    span."""
    runs = []
    for _ in range(repeat):
        n = 0
        t0 = time.perf_counter()
        for _ in range(loops):
            n += fn()
        runs.append((time.perf_counter() - t0) / max(n, 1) * 1e6)
    return statistics.median(runs)


def measure(a: argparse.Namespace) -> dict[str, float]:
    from sits_trace.agent.model import Span
    from sits_trace.agent.tracing.pipeline import Tracer
    from sits_trace.agent.tracing.procfs import ProcFS
    from sits_trace.agent.tracing.spans import SpanBuilder
    from sits_trace.analyzers.live import LiveView
    from sits_trace.exporters._otlp_traces import encode
    from sits_trace.exporters._red import RedAggregator

    class NoSource:
        def read(self, timeout_ms: int) -> list[bytes]:
            return []

        def close(self) -> None:
            pass

    spans: list[Span] = []
    tracer = Tracer(NoSource(), spans.append, SpanBuilder(clock_offset_ns=0),
                    procfs=ProcFS(tempfile.mkdtemp()), monotonic_ns=lambda: 0)
    recs = records(a.exchanges, a.request_id)
    tracer.process(recs)  # connections opened, caches warm
    if len(spans) != a.exchanges or tracer.stats.conns_replaced:
        raise SystemExit(f"the tracer made {len(spans)} spans of {a.exchanges} exchanges")
    kept = list(spans)
    resource = {"service.name": "nginx", "process.pid": 100}

    def tracer_stage() -> int:
        spans.clear()
        tracer.process(recs)
        return len(spans)

    def otlp_stage() -> int:
        for i in range(0, len(kept), 512):
            encode(kept[i:i + 512], lambda _s: resource)
        return len(kept)

    red = RedAggregator()

    def red_stage() -> int:
        for i in range(0, len(kept), 512):
            red.observe_many(kept[i:i + 512], lambda _s: "nginx")
        return len(kept)

    view = LiveView()

    def live_stage() -> int:
        for i in range(0, len(kept), 64):
            view.add_many(kept[i:i + 64])
        return len(kept)

    gc.collect()
    gc.disable()
    try:
        out = {name: per_span(fn, a.loops, a.repeat) for name, fn in
               (("tracer", tracer_stage), ("otlp", otlp_stage), ("red", red_stage),
                ("live", live_stage))}
    finally:
        gc.enable()
    out["total"] = sum(out.values())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exchanges", type=int, default=512)
    ap.add_argument("--loops", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--request-id", action="store_true",
                    help="each request its own x-request-id (a trace id hashed from it)")
    ap.add_argument("--baseline", help="python of another checkout's venv to alternate with")
    ap.add_argument("--json", action="store_true", help="one run, its stages as JSON")
    a = ap.parse_args()
    if a.json:
        print(json.dumps(measure(a)))
        return 0
    args = ["--exchanges", str(a.exchanges), "--loops", str(a.loops), "--repeat", str(a.repeat),
            *(["--request-id"] if a.request_id else []), "--json"]
    sides = [("this", sys.executable)] + ([("baseline", a.baseline)] if a.baseline else [])
    got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
    for r in range(a.rounds):
        for name, python in sides if r % 2 == 0 else sides[::-1]:
            # each side its own process: its own checkout's code, nothing warm from the other
            res = subprocess.run([python, __file__, *args], capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{name} ({python}): {res.stderr.strip()[-500:]}")
            stages = json.loads(res.stdout.strip().splitlines()[-1])
            got[name].append(stages)
            print(f"round {r + 1} {name}: " + " ".join(f"{k} {v:.2f}" for k, v in stages.items())
                  + " µs/span", flush=True)
    med = {name: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
           for name, runs in got.items()}
    for name, m in med.items():
        print(f"{name}: median " + " ".join(f"{k} {v:.2f}" for k, v in m.items()) + " µs/span")
    if a.baseline:
        print("this/baseline: " + " ".join(
            f"{k} {med['this'][k] / med['baseline'][k]:.3f}" for k in med["this"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
