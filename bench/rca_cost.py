"""What the live analysis costs the agent: CPU seconds per second of traffic at a span rate.

  python bench/rca_cost.py --rate 1000 --seconds 120

Feeds `--seconds` of synthetic server spans (the attributes a traced request carries: run-queue
wait, TCP, stream timings) at `--rate` spans/s through the engine exactly as the live agent does
(add() per span, advance() every 0.25 s, a real /proc snapshot every second), with a CPU fault in
the last third so verdicts are made too, and prints the CPU time this took divided by the
simulated time: the share of one core the analysis adds at that rate (steady state: the
one-time pandas import is left out). Run on an idle machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from sits_trace.agent.model import Span
from sits_trace.analyzers.rca.engine import RcaEngine, RcaSettings
from sits_trace.analyzers.rca.model import load
from sits_trace.analyzers.rca.procs import ProcSampler

SEC = 1_000_000_000


def spans(rng: np.random.Generator, t0: int, rate: int, fault: bool) -> list[Span]:
    out = []
    for i in range(rate):
        start = t0 + i * (SEC // rate)
        runq = float(rng.uniform(5000, 9000) if fault else rng.uniform(0, 200))
        dur = int((4e6 + runq * 1e3) * float(rng.uniform(0.8, 1.2)))
        chunks = int(rng.integers(2, 30))
        out.append(Span(f"{i:032x}", f"{i:016x}", None, "POST /v1/completions", "SERVER", start,
                        start + dur, {
                            "http.request.method": "POST", "url.path": "/v1/completions",
                            "http.route": "/v1/completions", "process.pid": 4242,
                            "process.executable.name": "vllm", "network.peer.address": "10.0.0.2",
                            "network.peer.port": 40000 + i % 100, "server.port": 8000,
                            "http.response.status_code": 200, "sits.ttfb_ms": 1.0,
                            "sits.time_to_first_chunk_ms": 1.5 + runq / 2e3,
                            "sits.time_to_last_chunk_ms": dur / 1e6, "sits.stream.chunks": chunks,
                            "http.request.body.size": 500, "http.response.body.size": 40 * chunks,
                            "sits.tcp.retransmits": 0, "sits.tcp.srtt_us": 40,
                            "sits.cpu.runq_delay_us": int(runq), "sits.cpu.runq_threads": 1}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--window", type=float, default=10.0)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.time_ns() // SEC * SEC
    made = [spans(rng, t0 + s * SEC, a.rate, s >= 2 * a.seconds // 3) for s in range(a.seconds)]
    import pandas  # noqa: F401 - imported once at start-up by the agent, not per window

    eng = RcaEngine(RcaSettings(window_s=a.window), model=load())
    sampler = ProcSampler(clock_ns=lambda: 0)
    verdicts = 0
    cpu0 = time.process_time()
    for s, batch in enumerate(made):
        snap = sampler.snapshot()
        snap.t_ns = t0 + s * SEC
        eng.add_procs(snap)
        per_tick = len(batch) // 4
        for q in range(4):
            for sp in batch[q * per_tick:(q + 1) * per_tick]:
                eng.add(sp)
            verdicts += len(eng.advance(t0 + s * SEC + (q + 1) * SEC // 4))
    cpu = time.process_time() - cpu0
    print(f"rate {a.rate} spans/s, {a.seconds} s simulated, window {a.window:g} s: "
          f"{cpu:.2f} CPU s -> {100 * cpu / a.seconds:.2f}% of one core "
          f"({1e6 * cpu / (a.rate * a.seconds):.1f} us per span, {verdicts} verdicts)")


if __name__ == "__main__":
    main()
