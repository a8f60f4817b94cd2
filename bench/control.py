"""The closed loop against the reference inference server, replaying the Azure LLM traces.

Two experiments, each printing a table and writing JSON (and an SVG plot) under --out:

  window  SLO attainment and goodput (requests/s meeting the TTFT SLO) of static batch windows
          (5, 10, 20, 50, 100 ms), the published rule, Clipper-style AIMD and ours, each
          repeated, on the same replay with a load step (--step-at/--step) in it.
  cpu     a CPU competitor (stress-ng in the server's scheduling group, bench/faults) starts
          mid-replay; the loop in `act` throttles it, in `observe` only logs. p99 TTFT before,
          during the fault until the action, after the action, and the time to recover.

Trace: Azure LLM inference traces 2023 (Microsoft Azure, AzurePublicDataset, CC-BY 4.0;
Patel et al., "Splitwise", ISCA 2024), scaled to this machine (--rate-scale, --token-scale).

The loop runs in this process exactly as in the agent (ControlLoop, DecisionBoard, the
control socket the server's sits_trace.client asks), fed the client's TTFT of each request
as it finishes. There is no RCA in this process: in `window` no verdicts are given; in `cpu`
the verdict is what the RCA is expected to say on a breach (cpu_starvation, culprit = the
competitor's pid), given by the fault injector that knows the culprit: it measures the loop
and the actuator, not the RCA's accuracy.

    python bench/control.py window --repeats 2 --duration 30      # ~10 min on 2 cores
    python bench/control.py window --server-arg=--batcher --server-arg=window ...  # window batcher
    python bench/control.py cpu --duration 60                     # act, then observe; root
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import workload as wl  # noqa: E402 - bench/ on the path first
from sits_trace.agent.config import ControlConfig  # noqa: E402
from sits_trace.analyzers.control.actuators import (  # noqa: E402
    CgroupCpuActuator,
    find_cpu_hierarchy,
)
from sits_trace.analyzers.control.api import ControlServer  # noqa: E402
from sits_trace.analyzers.control.board import DecisionBoard  # noqa: E402
from sits_trace.analyzers.control.deadline import DeadlineReserver  # noqa: E402
from sits_trace.analyzers.control.loop import ControlLoop  # noqa: E402
from sits_trace.analyzers.control.verdicts import PushedVerdicts  # noqa: E402
from sits_trace.analyzers.control.window import (  # noqa: E402
    Aimd,
    Bounds,
    PublishedRule,
    StaticWindow,
    VerdictWindow,
    WindowController,
)

SERVICE = "llm"


class BenchError(Exception):
    """A user error: one line."""


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except (OSError, ValueError):
        return None


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    sock: Path

    @classmethod
    def start(cls, sock: Path, extra: list[str]) -> Server:
        port = free_port()
        argv = [sys.executable, str(ROOT / "examples" / "inference_server.py"), "--port",
                str(port), "--backend", "numpy", "--control-socket", str(sock),
                "--control-interval-ms", "100", "--service", SERVICE, *extra]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while health(url) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode()[-300:] if proc.stderr else ""
                raise BenchError(f"the reference server did not start: {err.strip()}")
            time.sleep(0.3)
        return cls(proc, url, sock)

    def idle(self, timeout: float = 60) -> None:
        """Wait until the server has nothing queued or running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = health(self.url)
            if h is not None and h.get("queue_depth") == 0 and h.get("active") == 0:
                return
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- one controlled replay


@dataclass
class Run:
    name: str
    repeat: int
    records: list[wl.Record]
    windows: list[tuple[float, float | None]]  # (s since start, window ms)
    actions: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[tuple[float, str]] = field(default_factory=list)  # (s, the controller's why)
    started: float = 0.0  # time.monotonic() of the replay's start


def controller(name: str, slo_ms: float, start_ms: float, ours_min_ms: float) -> WindowController:
    if name.startswith("static-"):
        return StaticWindow(float(name.removeprefix("static-").removesuffix("ms")))
    if name == "rule":
        return PublishedRule(slo_ms, max(10.0, start_ms))
    if name == "aimd":
        return Aimd(slo_ms, max(10.0, start_ms))
    if name == "ours" or name.startswith("ours@"):  # ours@10: ours with a 10 ms floor
        floor = float(name.partition("@")[2] or ours_min_ms)
        ctl = VerdictWindow(slo_ms, start_ms, Bounds(floor, 500.0))
        ctl.name = name
        return ctl
    raise BenchError(f"unknown controller {name!r}")


def feed_ms(r: wl.Record) -> float | None:
    """What the loop sees of a finished request: its TTFT (the SLO's metric)."""
    t = r.ttft_s if r.ttft_s is not None else r.latency_s
    return None if t is None else t * 1000.0


def controlled_replay(server: Server, ctl: WindowController, planned: list[wl.Planned],
                      mode: str, slo_ms: float, interval_s: float,
                      actuator: CgroupCpuActuator | None = None,
                      each_tick: Callable[[ControlLoop, PushedVerdicts, float], None] | None = None,
                      reserver: DeadlineReserver | None = None) -> Run:
    board = DecisionBoard()
    opts = ControlConfig(mode=mode, service=SERVICE, slo_ms=slo_ms, interval_s=interval_s,
                         clear_after_s=5.0, cpu_reservation=reserver is not None)
    verdicts = PushedVerdicts()
    actions: list[dict[str, Any]] = []
    loop = ControlLoop(opts, board, actuator=actuator, reserver=reserver, verdicts=verdicts,
                       controller=ctl, on_action=[actions.append])
    api = ControlServer(board, server.sock)
    api.start()
    if mode != "observe":
        board.publish(batch_window_ms=ctl.window_ms)
    time.sleep(0.8)  # the server's client re-asks every 0.5 s
    windows: list[tuple[float, float | None]] = []
    reasons: list[tuple[float, str]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def ticker() -> None:
        while not stop.wait(interval_s):
            loop.tick()
            windows.append((time.monotonic() - t0, loop.window_ms))
            why = getattr(ctl, "last_reason", None)
            if why is not None:
                reasons.append((round(time.monotonic() - t0, 2), why))
            if each_tick is not None:
                each_tick(loop, verdicts, time.monotonic() - t0)

    th = threading.Thread(target=ticker, daemon=True)
    th.start()

    def on_record(r: wl.Record) -> None:
        ms = feed_ms(r)
        if ms is not None:  # the served process, as a span would name it
            loop.latency.add(SERVICE, ms, server.proc.pid)

    target = wl.Target(server.url, backend="httpx", timeout_s=60.0)
    try:
        records = asyncio.run(wl.replay_async(planned, target, seed=0, on_record=on_record))
    finally:
        stop.set()
        th.join(5)
        loop.stop()
        api.close()
    return Run(ctl.name, 0, records, windows, actions, reasons, t0)


# ---------------------------------------------------------------- numbers


def ttft_s(r: wl.Record) -> float | None:
    t = r.ttft_s if r.ttft_s is not None else r.latency_s
    return None if t is None else float(t)


def phase(records: list[wl.Record], lo: float, hi: float, slo_s: float) -> dict[str, Any]:
    """Attainment and p99 TTFT of requests scheduled in [lo, hi)."""
    rs = [r for r in records if lo <= r.scheduled_s < hi]
    good = sum(1 for r in rs if wl.meets_slo(r, slo_s, None))
    t = [x for x in (ttft_s(r) for r in rs if r.ok) if x is not None]
    return {"requests": len(rs), "attainment": good / len(rs) if rs else None,
            "p50_ms": _ms(wl.percentile(t, 50)), "p99_ms": _ms(wl.percentile(t, 99))}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def summary(run: Run, slo_s: float, step_at: float | None) -> dict[str, Any]:
    s = wl.summarize(run.records, slo_s, None)
    out = {"controller": run.name, "repeat": run.repeat, "requests": s["requests"],
           "errors": s["errors"], "goodput_rps": round(s["goodput_rps"], 3),
           "attainment": round(s["slo_attainment"], 4),
           "ttft_p50_ms": _ms(s["ttft_s"]["p50"]), "ttft_p99_ms": _ms(s["ttft_s"]["p99"]),
           "mean_window_ms": _mean([w for _, w in run.windows if w is not None])}
    if step_at is not None:
        out["before_step"] = phase(run.records, 0, step_at, slo_s)
        out["after_step"] = phase(run.records, step_at, math.inf, slo_s)
    return out


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 1) if xs else None


# ---------------------------------------------------------------- window experiment


def window_experiment(a: argparse.Namespace) -> dict[str, Any]:
    slo_s = a.slo_ttft_ms / 1000
    shaping = wl.Shaping(rate_scale=a.rate_scale, token_scale=a.token_scale,
                         max_prompt_tokens=a.max_prompt_tokens,
                         max_output_tokens=a.max_output_tokens, start_s=a.start,
                         duration_s=a.duration, rate_step_at_s=a.step_at, rate_step=a.step,
                         id_prefix="ctl")
    planned = wl.plan(wl.load_trace(wl.trace_path(a.trace)), shaping)
    if not planned:
        raise BenchError("the replay plan is empty: check --trace/--start/--duration")
    names = [f"static-{w:g}" for w in a.static] + a.controllers
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="sits-ctl-") as tmp:
        server = Server.start(Path(tmp) / "control.sock", a.server_arg)
        try:
            warm_up(server, planned, a)
            for rep in range(a.repeats):
                order = names if rep % 2 == 0 else names[::-1]  # drift hits both ends alike
                for name in order:
                    ctl = controller(name, a.slo_ttft_ms, a.start_window_ms, a.ours_min_ms)
                    run = controlled_replay(server, ctl, planned, "advise", a.slo_ttft_ms,
                                            a.interval)
                    run.repeat = rep
                    server.idle()
                    row = summary(run, slo_s, a.step_at)
                    print(_row_line(row), flush=True)
                    rows.append(row)
                    runs.append(run)
        finally:
            server.stop()
    return {"experiment": "window", "args": _jsonable(vars(a)), "requests": len(planned),
            "offered_rps": round(wl.mean_rate([p.at_s for p in planned]), 3), "rows": rows,
            "windows": {f"{r.name}#{r.repeat}": r.windows for r in runs},
            "reasons": {f"{r.name}#{r.repeat}": r.reasons for r in runs if r.reasons}}


def warm_up(server: Server, planned: list[wl.Planned], a: argparse.Namespace) -> None:
    """The plan's first --warmup seconds, not measured: the first requests to a fresh server
    pay for connection set-up and first-touch allocations."""
    head = [p for p in planned if p.at_s < a.warmup]
    if head:
        asyncio.run(wl.replay_async(head, wl.Target(server.url, backend="httpx")))
        server.idle()


def _row_line(r: dict[str, Any]) -> str:
    extra = ""
    if "after_step" in r:
        extra = (f"  before/after step: {_pct(r['before_step']['attainment'])} / "
                 f"{_pct(r['after_step']['attainment'])}")
    return (f"{r['controller']:<12} #{r['repeat']}  goodput {r['goodput_rps']:.2f} rps  "
            f"attainment {_pct(r['attainment'])}  p99 TTFT {r['ttft_p99_ms']} ms  "
            f"mean window {r['mean_window_ms']} ms{extra}")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()
            if k != "func"}


# ---------------------------------------------------------------- cpu experiment


def cpu_experiment(a: argparse.Namespace) -> dict[str, Any]:
    from faults.competitors import start_cpu_competitor

    if os.geteuid() != 0:
        raise BenchError("the cpu experiment moves processes between cgroups: run as root")
    hier = find_cpu_hierarchy()
    if hier is None:
        raise BenchError("no cpu cgroup controller is mounted")
    slo_s = a.slo_ttft_ms / 1000
    shaping = wl.Shaping(rate_scale=a.rate_scale, token_scale=a.token_scale,
                         max_prompt_tokens=a.max_prompt_tokens,
                         max_output_tokens=a.max_output_tokens, start_s=a.start,
                         duration_s=a.duration, id_prefix="cpu")
    planned = wl.plan(wl.load_trace(wl.trace_path(a.trace)), shaping)
    out: dict[str, Any] = {"experiment": "cpu", "args": _jsonable(vars(a)), "runs": []}
    with tempfile.TemporaryDirectory(prefix="sits-ctl-") as tmp:
        server = Server.start(Path(tmp) / "control.sock", a.server_arg)
        try:
            warm_up(server, planned, a)
            for mode in a.modes:
                res = _cpu_run(server, hier, planned, mode, a, slo_s, start_cpu_competitor)
                print(_cpu_line(res), flush=True)
                out["runs"].append(res)
                server.idle()
        finally:
            server.stop()
    return out


def _cpu_run(server: Server, hier: Any, planned: list[wl.Planned], mode: str,
             a: argparse.Namespace, slo_s: float, start: Any) -> dict[str, Any]:
    """mode: act (throttle the culprit), act-reserve (reserve CPU for the server's threads
    with SCHED_DEADLINE instead), observe, advise."""
    reserver = DeadlineReserver() if mode == "act-reserve" else None
    actuator = None if reserver is not None else \
        CgroupCpuActuator(hier, protected={server.proc.pid}, cpu_fraction=a.cpu_fraction)
    state: dict[str, Any] = {"comp": None, "fault_at": None, "action_at": None,
                             "fault_end": None}

    def each_tick(loop: ControlLoop, verdicts: PushedVerdicts, t: float) -> None:
        comp = state["comp"]
        if comp is None and a.fault_at <= t < a.fault_at + a.fault_for:
            state["comp"] = start(server.proc.pid, intensity=a.intensity,
                                  duration_s=a.fault_for + 30)
            state["fault_at"] = t
        elif comp is not None and t >= a.fault_at + a.fault_for and state["fault_end"] is None:
            comp.stop()
            state["fault_end"] = t
        comp = state["comp"]
        breach = loop.last_p95_ms is not None and loop.last_p95_ms > a.slo_ttft_ms
        if comp is not None and state["fault_end"] is None and breach:
            # what the RCA is expected to say on this breach (see the module's doc)
            verdicts.push({
                "time_unix_nano": time.time_ns(), "service": SERVICE, "route": "",
                "breach": True, "causes": [{"cause": "cpu_starvation", "score": 0.9,
                                            "culprit": {"pid": comp.pid, "name": comp.name}}]})
        if state["action_at"] is None and (actuator.active if actuator else reserver.active):
            state["action_at"] = t

    ctl = VerdictWindow(a.slo_ttft_ms, a.start_window_ms, Bounds(a.ours_min_ms, 500.0))
    try:
        run = controlled_replay(server, ctl, planned, mode.removesuffix("-reserve"),
                                a.slo_ttft_ms, a.interval, actuator=actuator,
                                each_tick=each_tick, reserver=reserver)
    finally:
        if state["comp"] is not None:
            state["comp"].stop()
        if actuator is not None:
            actuator.revert_all()
        if reserver is not None:
            reserver.revert_all()
    return _cpu_result(mode, run, state, slo_s, a)


def _cpu_result(mode: str, run: Run, st: dict[str, Any], slo_s: float,
                a: argparse.Namespace) -> dict[str, Any]:
    f0 = st["fault_at"] if st["fault_at"] is not None else a.fault_at
    f1 = st["fault_end"] if st["fault_end"] is not None else a.fault_at + a.fault_for
    act = st["action_at"]
    res: dict[str, Any] = {
        "mode": mode, "fault_at_s": _r(f0), "fault_end_s": _r(f1), "action_at_s": _r(act),
        "before": phase(run.records, 0, f0, slo_s),
        "during_until_action": phase(run.records, f0, act if act is not None else f1, slo_s),
        "after_action": phase(run.records, act + 2.0, f1, slo_s) if act is not None else None,
        "after_fault": phase(run.records, f1, math.inf, slo_s),
        "recovered_after_s": _recovery(run.records, f0, f1, slo_s),
        "actions": [x for x in run.actions if x["kind"] != "batch_window"],
        "overall": wl.summarize(run.records, slo_s, None)["slo_attainment"],
    }
    return res


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _recovery(records: list[wl.Record], f0: float, f1: float, slo_s: float,
              hold_s: int = 3) -> float | None:
    """Seconds from the fault's start until the p99 TTFT of requests sent in each 1 s bin is
    back under the SLO for `hold_s` bins running, after it first broke it, while the fault
    lasts. 0.0: it never broke the SLO; None: it never recovered."""
    bins: dict[int, list[float]] = {}
    for r in records:
        if f0 <= r.scheduled_s < f1:
            t = ttft_s(r) if r.ok else None
            bins.setdefault(int(r.scheduled_s - f0), []).append(math.inf if t is None else t)
    good = [(wl.percentile(bins.get(i, []), 99) or 0.0) <= slo_s for i in range(int(f1 - f0))]
    if all(good):
        return 0.0
    first_bad = good.index(False)
    for i in range(first_bad + 1, len(good) - hold_s + 1):
        if all(good[i:i + hold_s]):
            return float(i)
    return None


def _cpu_line(r: dict[str, Any]) -> str:
    def p(x: dict[str, Any] | None) -> str:
        return "-" if x is None else f"{x['p99_ms']} ms ({_pct(x['attainment'])})"
    return (f"{r['mode']:<8} p99 TTFT before {p(r['before'])}  during {p(r['during_until_action'])}"
            f"  after action {p(r['after_action'])}  after fault {p(r['after_fault'])}  "
            f"action at {r['action_at_s']} s (fault {r['fault_at_s']}..{r['fault_end_s']} s)  "
            f"recovered after {r['recovered_after_s']} s")


# ---------------------------------------------------------------- plots (SVG, no matplotlib)


def svg_window(result: dict[str, Any], path: Path) -> None:
    """Goodput per controller (mean, min-max whiskers) and the window over time."""
    rows = result["rows"]
    names = list(dict.fromkeys(r["controller"] for r in rows))
    g = {n: [r["goodput_rps"] for r in rows if r["controller"] == n] for n in names}
    top = max(max(v) for v in g.values()) * 1.15 or 1.0
    w, h, left, bottom = 760, 560, 60, 250
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="11">'),
           (f'<text x="{left}" y="16" font-size="13">Goodput at the TTFT SLO '
           '(requests/s meeting it; bar = mean, whisker = min..max of repeats)</text>')]
    bw = (w - left - 20) / len(names)
    for i, n in enumerate(names):
        vals = g[n]
        mean = sum(vals) / len(vals)
        x = left + i * bw + bw * 0.15
        y = bottom - (bottom - 30) * mean / top
        color = "#d62728" if n.startswith("ours") else "#1f77b4" if n in ("published-rule", "aimd") else "#999"
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw * 0.7:.1f}" '
                   f'height="{bottom - y:.1f}" fill="{color}"/>')
        lo = bottom - (bottom - 30) * min(vals) / top
        hi = bottom - (bottom - 30) * max(vals) / top
        cx = x + bw * 0.35
        out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{lo:.1f}" y2="{hi:.1f}" '
                   'stroke="black"/>')
        out.append(f'<text x="{cx:.1f}" y="{y - 4:.1f}" text-anchor="middle">{mean:.2f}</text>')
        out.append(f'<text x="{cx:.1f}" y="{bottom + 14}" text-anchor="middle">{n}</text>')
    out.append(f'<line x1="{left}" x2="{w - 10}" y1="{bottom}" y2="{bottom}" stroke="black"/>')
    out += _svg_timeline(result, left, 300, w - left - 20, 220)
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def _svg_timeline(result: dict[str, Any], x0: int, y0: int, width: int,
                  height: int) -> list[str]:
    series = {k: v for k, v in result["windows"].items()
              if k.split("#")[0] in ("published-rule", "aimd", "ours", "ours@10")
              and k.endswith("#0")}
    if not series:
        return []
    tmax = max((t for v in series.values() for t, _ in v), default=1.0) or 1.0
    wmax = max((x for v in series.values() for _, x in v if x), default=1.0) * 1.1
    out = [(f'<text x="{x0}" y="{y0 - 8}" font-size="13">Batch window over time (repeat 0); '
           f'max {wmax / 1.1:.0f} ms</text>'),
           (f'<rect x="{x0}" y="{y0}" width="{width}" height="{height}" fill="none" '
           'stroke="#ccc"/>')]
    step_at = result["args"].get("step_at")
    if step_at:
        sx = x0 + width * step_at / tmax
        out.append(f'<line x1="{sx:.1f}" x2="{sx:.1f}" y1="{y0}" y2="{y0 + height}" '
                   'stroke="#888" stroke-dasharray="4"/>')
        out.append(f'<text x="{sx + 3:.1f}" y="{y0 + 12}">load step</text>')
    colors = {"published-rule": "#1f77b4", "aimd": "#2ca02c", "ours": "#d62728",
              "ours@10": "#ff7f0e"}
    for i, (k, pts) in enumerate(sorted(series.items())):
        name = k.split("#")[0]
        xy = " ".join(f"{x0 + width * t / tmax:.1f},{y0 + height - height * (v or 0) / wmax:.1f}"
                      for t, v in pts)
        out.append(f'<polyline points="{xy}" fill="none" stroke="{colors[name]}" '
                   'stroke-width="1.5"/>')
        out.append(f'<text x="{x0 + width - 90}" y="{y0 + 16 + 14 * i}" '
                   f'fill="{colors[name]}">{name}</text>')
    out.append(f'<text x="{x0}" y="{y0 + height + 14}">0 s</text>')
    out.append(f'<text x="{x0 + width}" y="{y0 + height + 14}" text-anchor="end">'
               f'{tmax:.0f} s</text>')
    return out


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("experiment", choices=["window", "cpu"])
    p.add_argument("--trace", default="conv")
    p.add_argument("--start", type=float, default=0.0, help="skip this many trace seconds")
    p.add_argument("--duration", type=float, default=30.0, help="replay seconds per run")
    p.add_argument("--rate-scale", type=float, default=3.0)
    p.add_argument("--token-scale", type=float, default=0.1)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--interval", type=float, default=0.5, help="control interval, seconds")
    p.add_argument("--start-window-ms", type=float, default=20.0)
    p.add_argument("--ours-min-ms", type=float, default=2.0,
                   help="ours' floor (the server's own default window; the rule's is 10 ms)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for examples/inference_server.py (repeatable)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--warmup", type=float, default=8.0, help="unmeasured replay seconds first")
    # window
    p.add_argument("--static", type=float, nargs="+", default=[5, 10, 20, 50, 100])
    p.add_argument("--controllers", nargs="+", default=["rule", "aimd", "ours", "ours@10"],
                   help="adaptive ones after the static windows; ours@N: ours, N ms floor")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--step-at", type=float, help="load step at this replay second")
    p.add_argument("--step", type=float, default=2.0, help="arrivals this much faster after it")
    # cpu
    p.add_argument("--modes", nargs="+", default=["act", "observe"],
                   help="act (throttle the culprit), act-reserve (SCHED_DEADLINE for the "
                        "server's threads), observe, advise")
    p.add_argument("--fault-at", type=float, default=15.0)
    p.add_argument("--fault-for", type=float, default=30.0)
    p.add_argument("--intensity", type=float, default=1.0, help="stress-ng workers per CPU")
    p.add_argument("--cpu-fraction", type=float, default=0.25, help="the culprit's CPU cap")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        result = window_experiment(a) if a.experiment == "window" else cpu_experiment(a)
    except (BenchError, wl.WorkloadError) as e:
        print(f"control bench: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = a.out / f"control-{a.experiment}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {path}")
    if a.experiment == "window":
        svg = path.with_suffix(".svg")
        svg_window(result, svg)
        print(f"plot: {svg}")
        print(markdown_table(result))
    return 0


def markdown_table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    names = list(dict.fromkeys(r["controller"] for r in rows))
    head = ("| controller | goodput rps (mean; runs) | SLO attainment | p99 TTFT ms | "
            "attainment after the step | mean window ms |")
    lines = [head, "|---|---|---|---|---|---|"]
    for n in names:
        rs = [r for r in rows if r["controller"] == n]
        g = [r["goodput_rps"] for r in rs]
        att = [r["attainment"] for r in rs]
        after = [r["after_step"]["attainment"] for r in rs
                 if r.get("after_step") and r["after_step"]["attainment"] is not None]
        p99 = [r["ttft_p99_ms"] for r in rs if r["ttft_p99_ms"] is not None]
        win = [r["mean_window_ms"] for r in rs if r["mean_window_ms"] is not None]
        lines.append(f"| {n} | {sum(g) / len(g):.2f} ({', '.join(f'{x:.2f}' for x in g)}) | "
                     f"{_pct(sum(att) / len(att))} | {_mean(p99)} | "
                     f"{_pct(sum(after) / len(after)) if after else '-'} | {_mean(win)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
