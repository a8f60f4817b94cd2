"""The GPU scenario (run on the H200 machine, as root, BCC from .gpubundle):

  1. a PyTorch HTTP inference server (tests/gpu/server.py) on 127.0.0.1;
  2. phase 'untraced': client load, no agent (the tracing overhead's reference);
  3. the agent starts in this process (sits_trace.agent.daemon.Agent, CUDA probes + NVML);
  4. phase 'baseline': the same load, traced;
  5. phase 'contention': the same load while tests/gpu/competitor.py makes bulk pinned
     host->device copies (PCIe contention);
  6. phase 'after': the load again, competitor gone.
It writes $OUT (or --out): summary.json (per-phase latency and per-span CUDA/GPU signals, the
kernel's totals against the processes' own counts), spans.jsonl (a sample), features.csv (the
per-second frame), nvml_scenario.json.gz (the agent's NVML calls, recorded: the unit-test
fixture) and cuda_records.rec (EV_CUDA_* records as the ring delivered them).

    source .gpubundle/activate.sh && /opt/torch/.venv/bin/python3 tests/gpu/scenario.py
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import faulthandler
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable


def import_package() -> None:
    """Make `sits_trace.*` importable from the checkout without installing it."""
    try:
        import sits_trace.agent  # noqa: F401
        return
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="sitspkg"))
    (tmp / "sits_trace").mkdir()
    for name in ("agent", "bpf", "exporters", "analyzers"):
        (tmp / "sits_trace" / name).symlink_to(ROOT / name)
    sys.path.insert(0, str(tmp))


T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else float("nan")


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_proc(args: list[str], ready: str, timeout: float = 180.0) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([PY, *args], stdout=subprocess.PIPE, text=True, bufsize=1,
                         preexec_fn=_die_with_parent)  # noqa: PLW1509 - set before threads
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{args[0]} exited (rc={p.poll()}) before '{ready}'")
        if line.startswith(ready):
            return p, line.strip()
    raise TimeoutError(f"{args[0]}: no '{ready}' within {timeout}s")


def client(port: int, n: int, max_s: float) -> dict[str, Any]:
    out = subprocess.run([PY, str(HERE / "client.py"), "--port", str(port), "--requests", str(n),
                          "--max-seconds", str(max_s)], capture_output=True, text=True, check=True,
                         preexec_fn=_die_with_parent, timeout=max_s + 30)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


class CudaTee:
    """EventSource passing records through, keeping the first EV_CUDA_* ones."""

    def __init__(self, inner: Any, keep: int = 3000) -> None:
        self.inner, self.keep, self.kept = inner, keep, []  # type: ignore[var-annotated]

    def read(self, timeout_ms: int) -> list[bytes]:
        recs = self.inner.read(timeout_ms)
        if len(self.kept) < self.keep:
            self.kept += [r for r in recs if r[:1] in (b"\x09", b"\x0a", b"\x0b")][
                : self.keep - len(self.kept)]
        return list(recs)

    def close(self) -> None:
        self.inner.close()


def cet_status(pid: int) -> list[str]:
    """The x86_Thread_features* lines of /proc/<pid>/status (user shadow stack: 'shstk')."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return [f"unreadable: {exc}"]
    found = [ln for ln in lines if ln.startswith("x86_Thread_features")]
    return found or ["no x86_Thread_features line"]


NODE_PREFIXES = ("sits.tcp.", "sits.cpu.runq_")


def span_stats(spans: list[dict[str, Any]], input_bytes: int) -> dict[str, Any]:
    def col(k: str) -> list[float]:
        return [float(s["attributes"][k]) for s in spans if k in s["attributes"]]

    dur = [(s["end_time_unix_nano"] - s["start_time_unix_nano"]) / 1e6 for s in spans]
    out: dict[str, Any] = {"spans": len(spans), "p50_ms": pct(dur, 50), "p90_ms": pct(dur, 90),
                           "p99_ms": pct(dur, 99)}
    for k in ("sits.cuda.h2d_bytes", "sits.cuda.d2h_bytes", "sits.cuda.kernel_launches",
              "sits.cuda.sync_wait_ms", "sits.cuda.copy_call_ms", "sits.cuda.syncs",
              "sits.gpu.utilization_pct", "sits.gpu.sm_active_pct", "sits.gpu.sm_occupancy_pct",
              "sits.gpu.dram_active_pct", "sits.gpu.pcie_rx_bytes_per_s",
              "sits.gpu.pcie_tx_bytes_per_s", "sits.gpu.process_sm_pct",
              "sits.gpu.signal_age_ms", "sits.cpu.runq_delay_us", "sits.tcp.srtt_us",
              "sits.tcp.retransmits", "sampling.probability"):
        v = col(k)
        if v:
            out[k] = {"median": statistics.median(v), "p99": pct(v, 99), "n": len(v)}
    h2d = col("sits.cuda.h2d_bytes")
    out["spans_h2d_exact"] = sum(1 for v in h2d if v == input_bytes)
    for pre in NODE_PREFIXES:
        out[f"spans_with_{pre}*"] = sum(1 for s in spans
                                        if any(k.startswith(pre) for k in s["attributes"]))
    return out


def add_span_stats(phases: dict[str, dict[str, Any]], spans: list[dict[str, Any]], spid: int,
                   input_bytes: int) -> list[dict[str, Any]]:
    srv = [s for s in spans if s["kind"] == "SERVER" and s["attributes"].get("process.pid") == spid
           and s["attributes"].get("url.path") == "/infer"]
    for ph in phases.values():
        if "t" in ph:
            lo, hi = ph["t"]
            ph["spans"] = span_stats([s for s in srv if lo <= s["start_time_unix_nano"] <= hi],
                                     input_bytes)
    return srv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sits-gpu"))
    ap.add_argument("--port", type=int, default=8088)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--phase-seconds", type=float, default=20.0)
    ap.add_argument("--deadline-s", type=float, default=240.0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    faulthandler.enable()
    faulthandler.dump_traceback_later(a.deadline_s, exit=True)  # a hang shows every thread
    import_package()
    from sits_trace.agent import config
    from sits_trace.agent.capture.loader import Recorder
    from sits_trace.agent.daemon import Agent
    from sits_trace.agent.model import Span
    from sits_trace.agent.signals.cuda import doctor_checks
    from sits_trace.agent.signals.gpu import GpuSignalConfig
    from sits_trace.agent.signals.nvml import load_nvml
    sys.path.insert(0, str(ROOT))  # the checkout: tests.support is test code, not installed
    from sits_trace.analyzers.features import FeatureFrame
    from sits_trace.exporters.node_metrics import metric_samples

    from tests.support.nvml_replay import RecordingNvml

    summary: dict[str, Any] = {"uname": os.uname().release, "python": sys.version.split()[0]}
    try:
        summary["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                               text=True, check=False).stdout.strip()
    except OSError as exc:
        summary["nvidia_smi"] = str(exc)
    summary["libcuda"] = [c.as_dict() for c in doctor_checks()]
    server, line = start_proc([str(HERE / "server.py"), "--port", str(a.port)], "ready")
    spid = int(line.split("pid=")[1].split()[0])
    input_bytes = 256 * 16384 * 4
    phases: dict[str, dict[str, Any]] = {}
    try:
        t0 = time.time_ns()
        phases["untraced"] = {"client": client(a.port, a.requests // 3, a.phase_seconds / 2),
                              "t": [t0, time.time_ns()]}
        spans: list[dict[str, Any]] = []
        lock = threading.Lock()

        def sink(s: Span) -> None:
            with lock:
                spans.append(s.to_json())

        cfg = config.load(env={}, overrides={"trace.port": a.port})
        tee: dict[str, CudaTee] = {}

        def source(ring: Any) -> CudaTee:
            tee["t"] = CudaTee(ring)
            return tee["t"]

        log(f"untraced done: {phases['untraced']['client']}")
        t_load = time.monotonic()
        nv = load_nvml()
        rec = RecordingNvml(nv, meta={"device": summary["nvidia_smi"],
                                      "scenario": "tests/gpu/scenario.py"}) if nv else None
        agent = Agent(cfg, sink, wrap_source=source, gpu=GpuSignalConfig(nvml_module=rec))
        agent.start()
        summary["agent_start_s"] = time.monotonic() - t_load
        log(f"agent started in {summary['agent_start_s']:.1f}s")
        assert agent.kernel is not None and agent.gpu is not None
        summary["uprobes_failed"] = [s.name for s in agent.kernel.report.statuses
                                     if s.name.startswith("uprobe:") and not s.ok]
        summary["uprobes_ok"] = sum(1 for s in agent.kernel.report.statuses
                                    if s.name.startswith("uprobe:") and s.ok)
        summary["uprobe_libraries"] = sorted(agent.kernel.attached_libraries())
        gs = agent.gpu
        frame = agent.features  # the agent's own frame (GPU, CUDA and node signals)
        if frame is None:
            frame = FeatureFrame(sampler=gs.sampler, cuda=gs.cuda,
                                 clock_offset_ns=gs.sampler.offset_ns if gs.sampler else 0)
            frame.start()
        stop = threading.Event()
        th = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        th.start()
        time.sleep(1.0)
        def phase(name: str, n: int) -> None:
            log(f"phase {name}")
            with lock:
                add_span_stats(phases, list(spans), spid, input_bytes)
            (out / "summary.json").write_text(json.dumps({**summary, "phases": phases},
                                                         default=str))
            t0 = time.time_ns()
            phases[name] = {"client": client(a.port, n, a.phase_seconds)}
            phases[name]["t"] = [t0, time.time_ns()]

        phase("baseline", a.requests)
        comp, cline = start_proc([str(HERE / "competitor.py"), "--seconds", "120"], "ready")
        cpid = int(cline.split("pid=")[1])
        summary["cet"] = {"server": cet_status(spid), "competitor": cet_status(cpid),
                          "scenario": cet_status(os.getpid())}
        time.sleep(1.0)
        phase("contention", a.requests)
        log("contention done")
        comp.send_signal(signal.SIGTERM)
        cout, _ = comp.communicate(timeout=30)
        summary["competitor_self"] = json.loads(cout.strip().splitlines()[-1])
        time.sleep(1.0)
        phase("after", a.requests // 3)
        time.sleep(1.5)
        log("stopping the agent")
        stop.set()
        th.join(timeout=30)
        frame.stop()
        totals = gs.cuda.totals() if gs.cuda else {}
        summary["kernel_totals"] = {str(p): dataclasses.asdict(t) for p, t in totals.items()
                                    if p in (spid, cpid)}
        summary["server_pid"], summary["competitor_pid"] = spid, cpid
        summary["agent_stats"] = {k: v for k, v in agent.stats().to_json().items()
                                  if k in ("tracer", "kernel_seen", "kernel_lost", "probes",
                                           "node_signals")}
        src = tee["t"].inner if "t" in tee else None
        if src is not None:
            sh = agent.shedder
            assert sh is not None
            summary["shedding"] = {"reader": src.reader, "cpu_budget": sh.budget,
                                   **dataclasses.asdict(sh.state),
                                   "kernel_shed": sum(agent.kernel.shed_counts().values())}
        if gs.cuda:
            summary["cuda_signals"] = gs.cuda.stats()
        if rec is not None and gs.sampler is not None:
            rec.meta.update(clock_offset_ns=gs.sampler.offset_ns, interval_s=gs.sampler.interval_s,
                            passes=gs.sampler.passes, server_pid=spid, competitor_pid=cpid,
                            phases={k: v["t"] for k, v in phases.items()})
            rec.save(out / "nvml_scenario.json.gz")
        df = frame.frame()
        df.to_csv(out / "features.csv")
        summary["features"] = {"rows": len(df), "columns": len(df.columns),
                               "metrics_last_row": [list(m) for m in metric_samples(
                                   frame.latest(), gs.sampler.devices if gs.sampler else ())][:60]}
        if "t" in tee:
            r = Recorder(out / "cuda_records.rec")
            r.write(tee["t"].kept)
            r.close()
            summary["cuda_records_kept"] = len(tee["t"].kept)
    finally:
        server.terminate()
        server.wait(timeout=10)
    srv_spans = add_span_stats(phases, spans, spid, input_bytes)
    if srv_spans:
        summary["server_span_attribute_keys"] = sorted(srv_spans[len(srv_spans) // 2]["attributes"])
    summary["phases"] = phases
    summary["input_bytes"] = input_bytes
    summary["traced_requests"] = sum(ph["client"]["requests"] for n, ph in phases.items()
                                     if n != "untraced")
    with open(out / "spans.jsonl", "w") as f:
        for name, ph in phases.items():
            lo, hi = ph["t"]
            sel = [s for s in srv_spans if lo <= s["start_time_unix_nano"] <= hi]
            f.writelines(json.dumps({"phase": name, **s}) + "\n" for s in sel[:5] + sel[-5:])
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print_table(summary)


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'phase':<11} {'req':>5} {'n':>5} {'cli_p50':>8} {'cli_p99':>8} {'span_p50':>8} "
          f"{'span_p99':>8} {'h2d_B':>10} {'copy_ms':>8} {'sync_ms':>8} {'launch':>6} "
          f"{'util%':>6} {'sm%':>6} {'rxGB/s':>7} {'runq_us':>7} {'tcp':>5} {'runq':>5}")
    for name, ph in summary["phases"].items():
        c, s = ph["client"], ph.get("spans", {})

        def med(k: str, s: dict[str, Any] = s) -> float:
            return float(s.get(k, {}).get("median", float("nan")))

        print(f"{name:<11} {c['requests']:>5} {s.get('spans', 0):>5} {c['p50_ms']:>8.2f} "
              f"{c['p99_ms']:>8.2f} {s.get('p50_ms', float('nan')):>8.2f} "
              f"{s.get('p99_ms', float('nan')):>8.2f} {med('sits.cuda.h2d_bytes'):>10.0f} "
              f"{med('sits.cuda.copy_call_ms'):>8.3f} {med('sits.cuda.sync_wait_ms'):>8.3f} "
              f"{med('sits.cuda.kernel_launches'):>6.0f} {med('sits.gpu.utilization_pct'):>6.1f} "
              f"{med('sits.gpu.sm_active_pct'):>6.1f} "
              f"{med('sits.gpu.pcie_rx_bytes_per_s') / 1e9:>7.2f} "
              f"{med('sits.cpu.runq_delay_us'):>7.1f} {s.get('spans_with_sits.tcp.*', 0):>5} "
              f"{s.get('spans_with_sits.cpu.runq_*', 0):>5}")
    print("competitor:", summary.get("competitor_self"))
    print("kernel totals:", json.dumps(summary.get("kernel_totals")))
    print("uprobes ok:", summary.get("uprobes_ok"), "failed:", summary.get("uprobes_failed"))
    print_checks(summary)


def print_checks(summary: dict[str, Any]) -> None:
    """Per-request kernel totals, losses, shedding, node-signal attributes, CET state."""
    n = summary.get("traced_requests", 0)
    srv = (summary.get("kernel_totals") or {}).get(str(summary.get("server_pid")), {})
    if n and srv:
        print(f"server per traced request ({n}): " + ", ".join(
            f"{k}={srv[k] / n}" for k in ("launches", "h2d_copies", "h2d_bytes", "d2h_copies",
                                           "d2h_bytes") if k in srv))
    st = summary.get("agent_stats", {})
    t = st.get("tracer", {})
    print("agent: records", t.get("records"), "spans", t.get("spans"),
          "decode_errors", t.get("decode_errors"), "exchanges_shed", t.get("exchanges_shed"),
          "capture_shift", t.get("capture_shift"), "kernel_lost", st.get("kernel_lost"))
    print("shedding:", summary.get("shedding"))
    print("failed probes:", [p.get("name") for p in st.get("probes", [])])
    print("server span attribute keys:", summary.get("server_span_attribute_keys"))
    print("server pid", summary.get("server_pid"), "cet:", summary.get("cet"))


if __name__ == "__main__":
    main()
