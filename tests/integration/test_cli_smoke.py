"""Each command starts and stops cleanly on SIGINT/SIGTERM (bcc tools' smoke-test style)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .harness import RUN_READY, SITS, TRACE_READY, curl, python_server

pytestmark = pytest.mark.bpf


def test_doctor_exit_zero_and_json() -> None:
    p = subprocess.run([SITS, "doctor", "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    checks = {c["name"]: c for c in json.loads(p.stdout)}
    for name in ("privileges", "bcc", "bpf", "tracefs", "kernel headers", "tracepoints (http)"):
        assert checks[name]["ok"], checks[name]


def test_trace_stops_on_sigint_with_stats() -> None:
    p = subprocess.Popen([SITS, "trace", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stderr is not None
    deadline = time.monotonic() + 60
    for line in p.stderr:
        if line.startswith(TRACE_READY) or time.monotonic() > deadline:
            break
    p.send_signal(signal.SIGINT)
    _out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "records=" in err and "lost_in_kernel=" in err


def test_run_flushes_pending_spans_on_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "spans.jsonl"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[export]\njsonl_path = "{out}"\n')
    with python_server() as (port, _):
        p = subprocess.Popen([SITS, "run", "--config", str(cfg)], stderr=subprocess.PIPE, text=True)
        assert p.stderr is not None
        for line in p.stderr:
            if line.startswith(RUN_READY):
                break
        curl(f"http://127.0.0.1:{port}/flush-me", rid="run-smoke")
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        assert p.returncode == 0
    spans = [json.loads(line) for line in out.read_text().splitlines()]
    mine = [s for s in spans if s["attributes"].get("http.request.header.x-request-id") == "run-smoke"]
    assert {s["kind"] for s in mine} == {"SERVER", "CLIENT"}


def test_trace_without_root_is_one_line(tmp_path: Path) -> None:
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SITS, "trace"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert p.returncode == 2
    assert "root" in p.stderr and "Traceback" not in p.stderr, p.stderr
