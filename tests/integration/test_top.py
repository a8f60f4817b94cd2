"""`sits-trace top` against real traffic: the textual app driven by its pilot over an in-process
agent, and the installed command (--once, --once --json, and the live view in tmux) over a
`sits-trace run` daemon's API socket."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sits_trace.agent.config import load
from sits_trace.agent.top import LocalSource, make_app

from .harness import SITS, SitsRun, curl, python_server

pytestmark = pytest.mark.bpf

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"traceparent: 00-{TRACE_ID}-00f067aa0ba902b7-01"


def _rows(app: Any) -> list[list[str]]:
    """The routes table as drawn on the screen, a list of cells per line."""
    text = str(app.query_one("#routes").render())
    return [line.split() for line in text.splitlines()[1:] if line.strip() and not line.startswith("(")]


async def _until(pilot: Any, pred: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "the screen never showed it"
        await pilot.pause(0.2)


def _screen_text(app: Any) -> str:
    from textual.widgets import Static

    return "\n".join(str(w.render()) for w in app.screen.query(Static))


def test_pilot_request_appears_filter_hides_drilldown_shows_trace_id() -> None:
    with python_server() as (port, server):
        # only the server's process: other processes' traffic on a busy machine stays out
        cfg = load(env={}, overrides={"trace.pids": [server.pid], "trace.cpu_budget": 0,
                                      "export.jsonl_path": "", "api.socket": ""})
        source = LocalSource(cfg)
        source.start()
        try:
            asyncio.run(_drive(make_app(source, interval_s=0.25), port))
        finally:
            source.close()


async def _drive(app: Any, port: int) -> None:
    async with app.run_test(size=(180, 45)) as pilot:
        await pilot.pause(0.5)
        curl(f"http://127.0.0.1:{port}/pilot/alpha", "-H", TRACEPARENT)
        for _ in range(3):
            curl(f"http://127.0.0.1:{port}/pilot/beta")

        def row(route: str, kind: str = "SERVER") -> list[str] | None:  # [service, route, ...]
            return next((r for r in _rows(app) if r[1] == route and r[2] == kind), None)

        await _until(pilot, lambda: row("/pilot/alpha") and row("/pilot/beta"))
        alpha = row("/pilot/alpha")
        assert alpha is not None and alpha[3] == str(port)
        assert float(alpha[4]) > 0  # its rate
        await pilot.press("slash")
        await pilot.press(*"route", "colon", *"alpha", "enter")
        await pilot.pause(0.3)
        routes = {r[1] for r in _rows(app)}
        assert routes == {"/pilot/alpha"}, (routes, app.filter.text)
        server_row = next(i for i, r in enumerate(_rows(app)) if r[2] == "SERVER")
        for _ in range(server_row):
            await pilot.press("down")
        await pilot.press("enter")
        await pilot.pause(0.3)
        text = _screen_text(app)
        assert f"trace_id  {TRACE_ID}" in text
        assert "url.path" in text and "/pilot/alpha" in text and "sits.ttfb_ms" in text
        await pilot.press("escape")
        await pilot.press("q")


def test_installed_top_once_json_and_tmux(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "api.sock"
    cfg = tmp_path / "c.toml"
    with python_server() as (port, server):
        cfg.write_text(f'[trace]\ncpu_budget = 0\npids = [{server.pid}]\n[export]\n'
                       f'jsonl_path = ""\n[api]\nsocket = "{sock}"\n')
        daemon = SitsRun(cfg)
        try:
            curl(f"http://127.0.0.1:{port}/once/route", "-H", TRACEPARENT)
            curl(f"http://127.0.0.1:{port}/chunked")
            time.sleep(1.0)
            _check_once(sock, port)
            if shutil.which("tmux"):
                _check_tmux(sock, port)
        finally:
            assert daemon.stop() == 0
    assert not sock.exists()  # removed on stop


def _check_once(sock: Path, port: int) -> None:
    p = subprocess.run([SITS, "top", "--once", "--socket", str(sock), "--filter", f"port:{port}"],
                       check=False, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("AGENT daemon")
    row = next(x.split() for x in lines if "/once/route" in x and "SERVER" in x)
    assert row[2:4] == ["SERVER", str(port)]
    chunked = next(x.split() for x in lines if "/chunked" in x and "SERVER" in x)
    assert chunked[9] != "-"  # TTFT p50 of a streamed response
    p = subprocess.run([SITS, "top", "--once", "--json", "--socket", str(sock)],
                       check=False, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    snap = json.loads(p.stdout)
    assert snap["source"] == "daemon" and snap["verdicts"] == [] and snap["actions"] == []
    mine = [r for r in snap["routes"] if r["route"] == "/once/route" and r["kind"] == "SERVER"]
    assert mine and mine[0]["slowest"][0]["trace_id"] == TRACE_ID
    assert mine[0]["latency_p50_ms"] > 0
    assert "tracer" in snap["agent"]


def _check_tmux(sock: Path, port: int) -> None:
    name = f"sits-top-{port}"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "200", "-y", "50",
                    f"{SITS} top --socket {sock} --interval 0.5 --filter port:{port}"], check=True)
    try:
        deadline = time.monotonic() + 30
        screen = ""
        # the route's row, the table's header and the footer keys, on one screen (a capture
        # may catch textual between two paints under load: keep looking until the deadline)
        while not all(x in screen for x in ("/once/route", "REQ/S", "Quit", "Filter")):
            assert time.monotonic() < deadline, screen
            time.sleep(0.5)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name],
                                    check=False, capture_output=True, text=True).stdout
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        deadline = time.monotonic() + 10
        while subprocess.run(["tmux", "has-session", "-t", name],
                             check=False, capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "top did not quit on q"
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], check=False, capture_output=True)
