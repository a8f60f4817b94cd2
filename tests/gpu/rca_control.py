"""RCA and the closed loop on the GPU machine (as root, BCC from .gpubundle):

  part A (control.mode = observe): the PyTorch server (tests/gpu/server.py) under a steady client
     load, traced by the agent with [rca] on; then a bulk host->device copier
     (tests/gpu/competitor.py) and, after a pause, a compute competitor
     (tests/gpu/compute_competitor.py). Each fault must come out of the live RCA as its cause
     (pcie_contention, gpu_compute_contention) naming the competitor's pid.
  part B (control.mode = act): the same server and load, then the copier again: the loop throttles
     the culprit named by the verdict (cgroup cpu.max, which slows the rate it issues copies) and
     the server's p99 recovers; the action is undone when the copier goes.
It writes $OUT/rca_control.json (verdicts, actions, latency per phase) and prints a table.

    source .gpubundle/activate.sh && /opt/torch/.venv/bin/python3 tests/gpu/rca_control.py
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scenario import import_package, log, pct, start_proc


class Load:
    """Sequential GET /infer over keep-alive connections, one thread each; latencies stamped."""

    def __init__(self, port: int, threads: int = 2) -> None:
        self.port = port
        self.samples: list[tuple[float, float]] = []  # (wall time s, latency ms)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/infer")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                continue
            self.samples.append((time.time(), (time.perf_counter() - t0) * 1e3))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def window(self, lo: float, hi: float) -> dict[str, float]:
        xs = [ms for t, ms in self.samples if lo <= t < hi]
        return {"n": len(xs), "p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99),
                "mean_ms": statistics.fmean(xs) if xs else 0.0}


def make_agent(port: int, mode: str, window_s: float, baseline: int) -> tuple[Any, list[Any],
                                                                                list[Any]]:
    from sits_trace.agent import config
    from sits_trace.agent.daemon import Agent
    from sits_trace.agent.model import Span

    cfg = config.load(env={}, overrides={
        "trace.port": port, "trace.cpu_budget": 0, "rca.enabled": True, "rca.window_s": window_s,
        "rca.baseline_windows": baseline, "control.mode": mode, "control.socket_path": "",
        "control.clear_after_s": 6.0, "control.cpu_fraction": 0.1,
        "control.state_path": f"/tmp/sits-ctl-{mode}.json", "export.jsonl_path": ""})
    verdicts: list[Any] = []
    actions: list[Any] = []

    def sink(_s: Span) -> None:
        pass

    agent = Agent(cfg, sink)
    assert agent.rca is not None
    agent.rca.sinks.append(lambda v: verdicts.append(v.to_json()))
    if agent.control is not None:
        agent.control.loop._on_action.append(actions.append)  # the loop's action records
    return agent, verdicts, actions


def run_agent(agent: Any) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    agent.start()
    th = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    th.start()
    return stop, th


def verdicts_between(verdicts: list[dict[str, Any]], lo: float, hi: float) -> list[dict[str, Any]]:
    return [v for v in verdicts if lo * 1e9 <= v["time_unix_nano"] <= hi * 1e9 + 3e9]


def top(v: dict[str, Any]) -> tuple[str, Any]:
    c = v["causes"][0] if v["causes"] else {"cause": "unknown", "culprit": None}
    return c["cause"], c.get("culprit")


def fault_phase(name: str, script: str, seconds: float, load: Load, verdicts: list[Any],
                want: str) -> dict[str, Any]:
    proc, _ = start_proc([str(HERE / script), "--seconds", str(seconds + 30)], "ready")
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    proc.terminate()
    out = proc.communicate(timeout=30)[0]
    vs = verdicts_between(verdicts, t0, t1)
    right = [v for v in vs if top(v)[0] == want]
    culprit_ok = [v for v in right if (top(v)[1] or {}).get("pid") == proc.pid]
    first = min((v["time_unix_nano"] / 1e9 - t0 for v in right), default=None)
    log(f"{name}: {len(vs)} verdicts, {len(right)} {want}, {len(culprit_ok)} naming pid {proc.pid}")
    return {"phase": name, "pid": proc.pid, "t": [t0, t1], "latency": load.window(t0, t1),
            "verdicts": vs, "top_causes": [top(v)[0] for v in vs], "right": len(right),
            "culprit_right": len(culprit_ok), "first_right_after_s": first,
            "competitor_self": out.strip().splitlines()[-1:] if out else []}


def part_a(port: int, window_s: float, baseline: int, fault_s: float,
           faults: str = "copy,compute") -> dict[str, Any]:
    agent, verdicts, _ = make_agent(port, "observe", window_s, baseline)
    load = Load(port)
    stop, th = run_agent(agent)
    try:
        load.start()
        t0 = time.time()
        time.sleep(window_s * (baseline + 1.5))
        base = load.window(t0 + window_s, time.time())
        log(f"baseline: {base}")
        out: dict[str, Any] = {"baseline": base}
        if "copy" in faults:
            out["copy"] = fault_phase("copy", "competitor.py", fault_s, load, verdicts,
                                      "pcie_contention")
            time.sleep(window_s * 2.5)
        if "compute" in faults:
            out["compute"] = fault_phase("compute", "compute_competitor.py", fault_s, load,
                                         verdicts, "gpu_compute_contention")
            time.sleep(window_s)
    finally:
        load.stop()
        stop.set()
        th.join(timeout=60)
    out["all_verdicts"] = verdicts
    return out


def part_b(port: int, window_s: float, baseline: int, fault_s: float) -> dict[str, Any]:
    agent, verdicts, actions = make_agent(port, "act", window_s, baseline)
    load = Load(port)
    stop, th = run_agent(agent)
    try:
        load.start()
        t0 = time.time()
        time.sleep(window_s * (baseline + 1.5))
        base = load.window(t0 + window_s, time.time())
        proc, _ = start_proc([str(HERE / "competitor.py"), "--seconds", str(fault_s + 30)], "ready")
        tf = time.time()
        time.sleep(fault_s)
        t_end = time.time()
        proc.terminate()
        proc.communicate(timeout=30)
        time.sleep(window_s * 1.5)
    finally:
        load.stop()
        stop.set()
        th.join(timeout=60)
    acts = [a for a in actions if a.get("kind") == "cpu_throttle" and a.get("applied")]
    t_act = min((float(a.get("time_unix", 0)) for a in acts if float(a.get("time_unix", 0)) >= tf),
                default=None)
    out: dict[str, Any] = {"baseline": base, "competitor_pid": proc.pid, "actions": actions,
                           "verdicts": verdicts_between(verdicts, tf, t_end)}
    if t_act is not None:
        out["before_action"] = load.window(tf, t_act)
        out["after_action"] = load.window(t_act + 2, t_end)
        out["action_after_s"] = t_act - tf
    else:
        out["during_fault"] = load.window(tf, t_end)
    out["after_fault"] = load.window(t_end + 2, time.time())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sits-gpu"))
    ap.add_argument("--port", type=int, default=8089)
    ap.add_argument("--window-s", type=float, default=4.0)
    ap.add_argument("--baseline-windows", type=int, default=5)
    ap.add_argument("--fault-s", type=float, default=24.0)
    ap.add_argument("--parts", default="ab")
    ap.add_argument("--faults", default="copy,compute", help="part A's faults, in order")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import_package()
    server, line = start_proc([str(HERE / "server.py"), "--port", str(a.port)], "ready")
    result: dict[str, Any] = {"server_pid": int(line.split("pid=")[1].split()[0])}
    try:
        if "a" in a.parts:
            result["a"] = part_a(a.port, a.window_s, a.baseline_windows, a.fault_s, a.faults)
        if "b" in a.parts:
            result["b"] = part_b(a.port, a.window_s, a.baseline_windows, a.fault_s)
    finally:
        server.terminate()
        server.wait(timeout=30)
        (out / "rca_control.json").write_text(json.dumps(result, indent=1, default=str))
    summary(result)


def summary(r: dict[str, Any]) -> None:
    if "a" in r:
        a = r["a"]
        print("part A (observe): baseline", a["baseline"])
        for k in ("copy", "compute"):
            if k not in a:
                continue
            p = a[k]
            print(f"  {k}: verdicts={len(p['verdicts'])} right={p['right']} "
                  f"culprit_right={p['culprit_right']} first_after_s={p['first_right_after_s']} "
                  f"top={p['top_causes']} latency={p['latency']}")
    if "b" in r:
        b = r["b"]
        print("part B (act): baseline", b["baseline"])
        for k in ("before_action", "after_action", "during_fault", "after_fault",
                  "action_after_s"):
            if k in b:
                print(f"  {k}: {b[k]}")
        print("  actions:", [(x.get("kind"), x.get("cause"), x.get("pid")) for x in b["actions"]])
        print("  top causes:", [top(v)[0] for v in b["verdicts"]])


if __name__ == "__main__":
    main()
