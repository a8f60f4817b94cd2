"""CLI behaviour that needs no root: errors are one line, replay prints only JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SITS = str(Path(sys.executable).parent / "sits-trace")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "events"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SITS, *args], capture_output=True, text=True, timeout=60)


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[trace]\ncapture_bytes = 3\n")
    p = run("trace", "--config", str(bad))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0
    assert "trace.capture_bytes" in p.stderr and "Traceback" not in p.stderr


def test_replay_json_is_only_json() -> None:
    p = run("trace", "--json", "--replay", str(FIXTURES / "nginx_pipelined.rec"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    spans = [json.loads(line) for line in lines]
    assert len(spans) == 3
    for s in spans:
        assert set(s) >= {"trace_id", "span_id", "parent_span_id", "name", "kind",
                          "start_time_unix_nano", "end_time_unix_nano", "attributes"}
        assert s["kind"] == "SERVER"


def test_replay_table_and_port_filter() -> None:
    p = run("trace", "--replay", str(FIXTURES / "nginx_pipelined.rec"), "--port", "1")
    assert p.returncode == 0
    assert len(p.stdout.splitlines()) == 1  # the header only: no span on port 1


def test_help_has_examples() -> None:
    p = run("trace", "--help")
    assert "Examples" in p.stdout and "--json" in p.stdout
