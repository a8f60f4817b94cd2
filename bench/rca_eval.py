"""RCA accuracy on labelled fault runs (bench/rca_runs.py): train our model on some runs, score
it, the rules alone, NSigma, BARO and a random ranking on the other (held-out) runs.

  python bench/rca_eval.py train --runs runs/ --seeds 0,1 --out analyzers/rca/model_v1.json
  python bench/rca_eval.py eval --runs runs/ --seeds 2,3,4
  python bench/rca_eval.py fixture --run runs/run-2.jsonl.gz --cause cpu_starvation \
      --out tests/fixtures/rca/cpu_starvation.jsonl.gz

Per fault type: AC@1, AC@3, Avg@5 (mean of AC@1..5) over the episodes, the share of episodes
with a culprit whose top cause names it, and the verdict's delay after the end of the window it
judges. An episode is diagnosed by the first verdict whose window lies mostly inside the
fault (its middle does); none is a miss at every k. `ours@t` is given the fault's time as
NSigma and BARO are (RCAEval's protocol): the detector's first verdict in the fault, and
where it gave none, the verdict on the fault's first window asked for whether or not it
breached (`RcaEngine(asked=...)`, as `sits-trace rca --from FILE --at TIME` does). NSigma and BARO rank per-second metric tables of the same episodes (normal:
the 30 s before the fault; anomalous: the fault), each metric standing for the cause it would
indicate; a cause ranks where its best metric ranks.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sits_trace.analyzers.rca import causes as C
from sits_trace.analyzers.rca.engine import RcaEngine, RcaSettings
from sits_trace.analyzers.rca.model import LinearModel, load, train
from sits_trace.analyzers.rca.offline import frame_of, replay
from sits_trace.analyzers.rca.procs import delta
from sits_trace.analyzers.rca.rank import MODEL_FEATURES as FEATURES
from sits_trace.analyzers.rca.recording import Recording, read
from sits_trace.analyzers.rca.spantable import service_of, span_row, to_frame
from sits_trace.analyzers.rca.verdict import Verdict

WINDOW_S = 5.0
NORMAL_S = 30.0
CANDIDATES = tuple(c for c in C.VOCABULARY if c != C.UNKNOWN)


@dataclass(slots=True)
class Episode:
    run: str
    cause: str
    judge: str  # the spans whose verdict counts: SERVER, or CLIENT for network faults
    culprit: dict[str, Any] | None
    start_ns: int
    end_ns: int
    rankings: dict[str, list[str]] = field(default_factory=dict)  # method -> causes, best first
    culprit_ok: bool | None = None
    culprit_ok_t: bool | None = None  # ours@t's
    delay_s: float | None = None


def engine(model: LinearModel | None, rec: Recording,
           asked: Callable[[int, int], bool] | None = None) -> RcaEngine:
    ex = {int(rec.meta.get("agent_pid", 0))} - {0}
    t0 = min(s.end_time_unix_nano for s in rec.spans)
    return RcaEngine(RcaSettings(window_s=WINDOW_S), model=model, frame=frame_of(rec),
                     clock_ns=lambda: t0, exclude_pids=ex, asked=asked)


def asked(v: Verdict) -> bool:
    """A verdict given because its window was asked for, not because it breached."""
    return v.breach.objective.startswith("asked:")


def fault_windows(eps: Sequence[Episode]) -> Callable[[int, int], bool]:
    """The windows lying mostly inside a fault: diagnosed whether or not they breach."""
    return lambda t0, t1: any(e.start_ns <= (t0 + t1) // 2 < e.end_ns for e in eps)


def episodes(rec: Recording, run: str) -> list[Episode]:
    return [Episode(run, lab["cause"], lab.get("judge", "SERVER"), lab.get("culprit"),
                    int(lab["start_ns"]), int(lab["end_ns"])) for lab in rec.labels]


def _in(v: Verdict, ep: Episode) -> bool:
    """The verdict's window lies mostly inside the fault (its middle is)."""
    mid = (v.window_start_unix_nano + v.window_end_unix_nano) // 2
    return ep.start_ns <= mid < ep.end_ns


def first_verdict(vs: Sequence[Verdict], ep: Episode) -> Verdict | None:
    hits = [v for v in vs if _in(v, ep)
            and v.kind == ep.judge]
    return hits[0] if hits else None


def culprit_ok(v: Verdict, ep: Episode) -> bool | None:
    if not ep.culprit:
        return None
    top = v.causes[0]
    got = top.culprit or {}
    if "pids" in ep.culprit:
        # the label lists the competitor's processes seen 0.5 s after its start; workers it
        # forked later (stress-ng-cpu) count by name
        named = str(got.get("name", "")).startswith(str(ep.culprit.get("name", "?")))
        return top.cause == ep.cause and (got.get("pid") in set(ep.culprit["pids"]) or named)
    return top.cause == ep.cause and got.get("peer") == ep.culprit.get("peer")


# ---- NSigma and BARO on metric tables ----

def metric_table(rec: Recording, server_pid: int, kind: str = "SERVER") -> pd.DataFrame:
    """Per-second metrics of the run, each column named `<cause>|<metric>`: of the server's
    requests, or (kind CLIENT, network faults) of the load generator's."""
    df = to_frame(span_row(s, service_of(s)) for s in rec.spans)
    df["sec"] = (df["end_ns"] // 1e9).astype("int64")
    srv = df[(df["client"] == 0) & (df["pid"] == server_pid)] if kind == "SERVER" else \
        df[(df["client"] == 1) & (df["pid"] != server_pid)]
    dep = df[(df["client"] == 1) & (df["pid"] == server_pid)]
    g = srv.groupby("sec")
    cols = {
        f"{C.CPU_STARVATION}|runq_ms": g["runq_ms"].mean(),
        f"{C.NETWORK_LOSS}|retransmits": g["retrans"].sum(),
        f"{C.NETWORK_DELAY}|srtt_ms": g["srtt_ms"].mean(),
        f"{C.SERVER_QUEUEING}|requests_per_s": g.size().astype(float),
        f"{C.REQUEST_MIX_SHIFT}|chunks": g["chunks"].mean(),
        f"{C.REQUEST_MIX_SHIFT}|req_bytes": g["req_bytes"].mean(),
        f"{C.SLOW_DEPENDENCY}|dep_ms": dep.groupby("sec")["dur_ms"].mean(),
    }
    out = pd.DataFrame(cols)
    procs: dict[str, dict[int, float]] = defaultdict(dict)
    agent = int(rec.meta.get("agent_pid", 0))
    for a, b in zip(rec.procs, rec.procs[1:]):
        d = delta(a, b)
        sec = b.t_ns // 1_000_000_000
        for pid, cores in d.cpu_cores.items():
            if pid == agent:
                continue
            cause = C.SERVER_QUEUEING if pid == server_pid else C.CPU_STARVATION
            procs[f"{cause}|cpu_{d.comm.get(pid, '')}_{pid}"][sec] = cores
        for k, v in d.psi.items():
            cause = C.CPU_STARVATION if k.startswith("cpu") else C.HOST_MEMORY_PRESSURE
            procs[f"{cause}|psi_{k}"][sec] = v
        for pid, mb in d.rss_mb.items():
            if pid != agent:
                procs[f"{C.HOST_MEMORY_PRESSURE}|rss_mb_{pid}"][sec] = mb
    out = out.join(pd.DataFrame(procs), how="outer").sort_index()
    return out.ffill().fillna(0.0)


def _nsigma(normal: pd.DataFrame, anom: pd.DataFrame) -> pd.Series:
    mu, sd = normal.mean(), normal.std().replace(0, np.nan)
    return ((anom - mu) / sd).max().fillna(0.0)


def _baro(normal: pd.DataFrame, anom: pd.DataFrame) -> pd.Series:
    med = normal.median()
    iqr = (normal.quantile(0.75) - normal.quantile(0.25)).replace(0, np.nan)
    return ((anom - med) / iqr).max().fillna(0.0)


def baseline_method(name: str) -> Callable[[pd.DataFrame, pd.DataFrame], pd.Series]:
    """analyzers/baselines.py's ranking where this build has it, else the same formulas here."""
    try:
        from sits_trace.analyzers import baselines  # type: ignore[attr-defined]
    except ImportError:
        return _nsigma if name == "nsigma" else _baro

    def ranked(normal: pd.DataFrame, anom: pd.DataFrame) -> pd.Series:
        r = baselines.rank_table(normal.reset_index(names="time"),
                                 anom.reset_index(names="time"), name)
        items = r.items() if isinstance(r, dict) else r
        rows = [(x["metric"], x["score"]) if isinstance(x, dict) else (x[0], x[1]) for x in items]
        return pd.Series({m: float(s) for m, s in rows})

    return ranked


def cause_ranking(scores: pd.Series) -> list[str]:
    best: dict[str, float] = {}
    for metric, s in scores.items():
        cause = str(metric).split("|", 1)[0]
        best[cause] = max(best.get(cause, -np.inf), float(s))
    return [c for c, _ in sorted(best.items(), key=lambda kv: -kv[1])]


# ---- scoring ----

def ac_at(eps: Sequence[Episode], method: str, k: int) -> float:
    return float(np.mean([ep.cause in ep.rankings.get(method, [])[:k] for ep in eps]))


def random_ac(k: int) -> float:
    return min(1.0, k / len(CANDIDATES))


RECOVERY_S = 15.0  # after a fault ends, windows still holding its slow requests


@dataclass
class Alarms:
    """Verdicts of ours outside every fault (and its recovery): false alarms, over the
    seconds of normal traffic the runs hold."""

    count: int = 0
    normal_s: float = 0.0


def false_alarms(rec: Recording, vs: Sequence[Verdict], eps: Sequence[Episode]) -> Alarms:
    if not rec.spans:
        return Alarms()
    t0 = min(s.start_time_unix_nano for s in rec.spans)
    t1 = max(s.end_time_unix_nano for s in rec.spans)
    busy = [(e.start_ns, e.end_ns + int(RECOVERY_S * 1e9)) for e in eps]
    n = sum(1 for v in vs if not any(a < v.window_end_unix_nano and v.window_start_unix_nano < b
                                     for a, b in busy))
    fault_s = sum(min(b, t1) - max(a, t0) for a, b in busy if b > t0 and a < t1) / 1e9
    return Alarms(n, max(0.0, (t1 - t0) / 1e9 - fault_s))


def evaluate(paths: Sequence[Path], model: LinearModel | None,
             alarms: Alarms | None = None) -> list[Episode]:
    out: list[Episode] = []
    methods = {"nsigma": baseline_method("nsigma"), "baro": baseline_method("baro")}
    for p in paths:
        rec = read(p)
        eps = episodes(rec, p.name)
        ours = replay(rec, engine(model, rec))
        rules = replay(rec, engine(None, rec))
        given = replay(rec, engine(model, rec, fault_windows(eps)))
        if alarms is not None:
            fa = false_alarms(rec, ours, eps)
            alarms.count += fa.count
            alarms.normal_s += fa.normal_s
        tables = {k: metric_table(rec, int(rec.labels[0]["server_pid"]), k)
                  for k in {ep.judge for ep in eps}} if rec.labels else {}
        for ep in eps:
            table = tables.get(ep.judge)
            for name, vs in (("ours", ours), ("ours@t", given), ("rules", rules)):
                v = first_verdict(vs, ep)
                if name == "ours@t":  # the detector's verdict in the fault, else the asked one
                    v = first_verdict([x for x in vs if not asked(x)], ep) or v
                ep.rankings[name] = [c.cause for c in v.causes] if v else []
                if name == "ours" and v is not None:
                    ep.culprit_ok = culprit_ok(v, ep)
                    ep.delay_s = (v.time_unix_nano - v.window_end_unix_nano) / 1e9
                if name == "ours@t" and v is not None:
                    ep.culprit_ok_t = culprit_ok(v, ep)
            if table is not None:
                t = table.index.to_numpy() * 1_000_000_000
                normal = table[(t >= ep.start_ns - NORMAL_S * 1e9) & (t < ep.start_ns)]
                anom = table[(t >= ep.start_ns) & (t < ep.end_ns)]
                for name, fn in methods.items():
                    ep.rankings[name] = cause_ranking(fn(normal, anom))
            out.append(ep)
    return out


def table(eps: Sequence[Episode]) -> str:
    methods = ("ours", "ours@t", "rules", "nsigma", "baro", "random")
    lines = ["| fault | episodes | method | AC@1 | AC@3 | Avg@5 | culprit right | verdict delay s |",
             "|---|---|---|---|---|---|---|---|"]
    by: dict[str, list[Episode]] = defaultdict(list)
    for ep in eps:
        by[ep.cause].append(ep)
    by["all"] = list(eps)
    for cause, group in by.items():
        for m in methods:
            if m == "random":
                acs = [random_ac(k) for k in range(1, 6)]
            else:
                acs = [ac_at(group, m, k) for k in range(1, 6)]
            cul, dly = "", ""
            if m.startswith("ours"):
                c = [x for e in group
                     for x in [e.culprit_ok if m == "ours" else e.culprit_ok_t] if x is not None]
                cul = f"{np.mean(c):.2f} ({len(c)})" if c else "-"
            if m == "ours":
                d = [e.delay_s for e in group if e.delay_s is not None]
                dly = f"max {max(d):.2f}" if d else "-"
            lines.append(f"| {cause} | {len(group)} | {m} | {acs[0]:.2f} | {acs[2]:.2f} | "
                         f"{np.mean(acs):.2f} | {cul} | {dly} |")
    return "\n".join(lines)


def training_rows(paths: Sequence[Path]) -> tuple[np.ndarray, list[str]]:
    xs: list[list[float]] = []
    ys: list[str] = []
    for p in paths:
        rec = read(p)
        vs = replay(rec, engine(None, rec))
        for ep in episodes(rec, p.name):
            for v in vs:
                if v.kind == ep.judge and _in(v, ep):
                    xs.append([v.features.get(k, 0.0) for k in FEATURES])
                    ys.append(ep.cause)
    return np.array(xs, dtype=float), ys


def fixture(run: Path, cause: str, out: Path, before_s: float = 45.0, after_s: float = 5.0) -> int:
    """A small recording for tests: the run's lines from `before_s` before the first episode of
    `cause` to `after_s` after it, with that episode's label."""
    import gzip

    rec = read(run)
    lab = next(lab for lab in rec.labels if lab["cause"] == cause)
    lo, hi = int(lab["start_ns"] - before_s * 1e9), int(lab["end_ns"] + after_s * 1e9)
    n = 0
    with gzip.open(run, "rt") as src, gzip.open(out, "wt", compresslevel=9) as dst:
        for line in src:
            d = json.loads(line)
            t = d.get("t") or (d.get("span") or {}).get("end_time_unix_nano")
            keep = d["type"] == "meta" or (d["type"] == "label" and d["cause"] == cause and
                                           d["start_ns"] == lab["start_ns"])
            if keep or (t is not None and lo <= int(t) <= hi):
                dst.write(line)
                n += 1
    return n


def _runs(d: Path, seeds: str) -> list[Path]:
    """"3" is run-3.jsonl.gz (bench/rca_runs.py run --seed 3), "net-3" is net-3.jsonl.gz."""
    names = [s.strip() for s in seeds.split(",") if s.strip()]
    return [d / (f"{n}.jsonl.gz" if "-" in n else f"run-{n}.jsonl.gz") for n in names]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--runs", type=Path, required=True)
    t.add_argument("--seeds", required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--version", default="v1")
    e = sub.add_parser("eval")
    e.add_argument("--runs", type=Path, required=True)
    e.add_argument("--seeds", required=True)
    e.add_argument("--model", type=Path, default=None)
    f = sub.add_parser("fixture")
    f.add_argument("--run", type=Path, required=True)
    f.add_argument("--cause", required=True)
    f.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "fixture":
        print(f"{fixture(a.run, a.cause, a.out)} lines -> {a.out}")
        return
    if a.cmd == "train":
        x, y = training_rows(_runs(a.runs, a.seeds))
        cmd = "python bench/rca_eval.py " + " ".join(shlex.quote(s) for s in sys.argv[1:])
        m = train(x, y, FEATURES, a.version, cmd)
        a.out.write_text(json.dumps(m.to_json(), indent=1) + "\n")
        print(f"trained on {len(y)} verdicts ({dict(zip(*np.unique(y, return_counts=True)))})"
              f" -> {a.out}")
        return
    alarms = Alarms()
    eps = evaluate(_runs(a.runs, a.seeds), load(a.model), alarms)
    print(table(eps))
    print(f"\nfalse alarms (ours): {alarms.count} verdicts in {alarms.normal_s / 60:.1f} min of "
          f"normal traffic (outside the faults and {RECOVERY_S:g} s after each)")


if __name__ == "__main__":
    main()
