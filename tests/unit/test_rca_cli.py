"""`sits-trace rca` without root: a recording replayed, user errors as one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SITS = str(Path(sys.executable).parent / "sits-trace")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rca"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SITS, *args], check=False, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("cause", ["cpu_starvation", "host_memory_pressure"])
def test_rca_from_a_recording_prints_only_json_verdicts(cause: str) -> None:
    """Recorded fault runs (bench/rca_runs.py; host_memory_pressure: `run --mem`, a
    competitor squeezing the server's mmap'd weights out of its memory cgroup)."""
    fixture = FIXTURES / f"{cause}.jsonl.gz"
    p = run("rca", "--from", str(fixture), "--window", "5", "--json")
    assert p.returncode == 0, p.stderr
    verdicts = [json.loads(line) for line in p.stdout.splitlines()]
    assert verdicts, "the recorded fault must give at least one verdict"
    for v in verdicts:
        assert {"time_unix_nano", "service", "route", "breach", "causes"} <= set(v)
    labels = [json.loads(x) for x in _labels(fixture)]
    lab = labels[0]
    during = [v for v in verdicts if v["window"]["end_unix_nano"] > lab["start_ns"]
              and v["window"]["start_unix_nano"] < lab["end_ns"]]
    assert during and during[0]["causes"][0]["cause"] == cause
    assert during[0]["causes"][0]["culprit"]["pid"] in lab["culprit"]["pids"]


def _labels(path: Path) -> list[str]:
    import gzip

    with gzip.open(path, "rt") as f:
        return [line for line in f if '"type":"label"' in line.replace(" ", "")]


def test_rca_from_a_missing_file_is_one_line() -> None:
    p = run("rca", "--from", "/nonexistent.jsonl.gz")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_rca_normal_without_anomalous_is_one_line(tmp_path: Path) -> None:
    n = tmp_path / "n.csv"
    n.write_text("time,a\n1,2\n")
    p = run("rca", "--normal", str(n), "--json")
    assert p.returncode == 2 and "--anomalous" in p.stderr and "Traceback" not in p.stderr


def test_rca_help_has_examples() -> None:
    p = run("rca", "--help")
    assert p.returncode == 0 and "Examples" in p.stdout and "--from" in p.stdout


def test_rca_ranks_metric_tables_with_the_baselines(tmp_path: Path) -> None:
    n, a = tmp_path / "n.csv", tmp_path / "a.csv"
    n.write_text("time,a_cpu,b_cpu\n1,1,5\n2,1.1,5\n3,0.9,5.2\n4,1,4.9\n")
    a.write_text("time,a_cpu,b_cpu\n5,9,5\n6,8,5.1\n")
    for method in ("baro", "nsigma", "sits"):
        p = run("rca", "--normal", str(n), "--anomalous", str(a), "--method", method, "--json")
        assert p.returncode == 0, p.stderr
        ranking = json.loads(p.stdout)["ranking"]
        assert ranking[0]["metric"] == "a_cpu"
        assert set(ranking[0]) == {"metric", "score"}
    p = run("rca", "--normal", str(n), "--anomalous", str(a), "--method", "magic")
    assert p.returncode == 2 and "magic" in p.stderr


def test_rca_at_diagnoses_the_window_asked_for_breach_or_not() -> None:
    """`--at T`: only the window holding T, diagnosed even when it breached nothing (the
    engineer paged about 12:03 asks why 12:03 was slow; the detector may not have fired)."""
    fixture = FIXTURES / "cpu_starvation.jsonl.gz"
    lab = json.loads(_labels(fixture)[0])
    t_fault = (lab["start_ns"] + 6 * 10**9) / 1e9
    p = run("rca", "--from", str(fixture), "--window", "5", "--json", "--at", f"{t_fault:.3f}")
    assert p.returncode == 0, p.stderr
    vs = [json.loads(line) for line in p.stdout.splitlines()]
    assert vs and all(v["window"]["start_unix_nano"] <= t_fault * 1e9
                      < v["window"]["end_unix_nano"] for v in vs)
    assert vs[0]["causes"][0]["cause"] == "cpu_starvation"
    import datetime as dt

    t_normal = dt.datetime.fromtimestamp(lab["start_ns"] / 1e9 - 20, dt.UTC)
    p = run("rca", "--from", str(fixture), "--window", "5", "--json", "--at",
            t_normal.isoformat())
    assert p.returncode == 0, p.stderr
    vs = [json.loads(line) for line in p.stdout.splitlines()]
    assert vs and vs[0]["breach"]["objective"].startswith("asked:"), vs
    for bad in (["--at", "12"], ["--at", "yesterday"]):
        p = run("rca", "--from", str(fixture), *bad)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    p = run("rca", "--at", "12")
    assert p.returncode == 2 and "--from" in p.stderr
