"""The reference inference server under a short trace replay (no root needed).

Starts examples/inference_server.py on 127.0.0.1, replays a small trace through the openai SDK
and through httpx (streamed and not, chat and completions), then holds the client's log against
the server's: same ids, same token counts, SSE events that add up, and times that nest.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from .harness import interrupt

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install fastapi uvicorn)")
pytest.importorskip("openai", reason="the replay needs the openai SDK (pip install openai)")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "examples" / "inference_server.py"
CLOCK_SLACK_NS = 2_000_000  # time.time_ns read on each side of one host: a little jitter only


def _load_workload() -> types.ModuleType:
    name = "sits_bench_workload"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "workload.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


wl = _load_workload()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("server did not become healthy")


@pytest.fixture(params=["continuous", "window"])
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Generator[tuple[str, Path], None, None]:
    port = free_port()
    log = tmp_path / "server.jsonl"
    # a 3 ms step floor stands in for a bigger model, so requests overlap and batch; the
    # window batcher's 20 ms window gathers each burst of the trace below into batches
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port), "--log", str(log),
         "--hidden", "256", "--vocab", "4096", "--max-batch", "8", "--step-floor-ms", "3",
         "--batcher", request.param, "--batch-window-ms", "20",
         "--control-socket", str(tmp_path / "no-agent.sock")],
        stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, log
    finally:
        interrupt(proc)


def small_trace(tmp_path: Path, n: int) -> Path:
    """Bursts of four every 0.6 s with varied sizes: requests overlap in the server."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        t = (i // 4) * 0.6 + (i % 4) * 0.01
        lines.append(f"2023-11-16 18:15:{10 + t:09.6f},{7 + 37 * i % 300},{3 + 11 * i % 40}")
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_against_server(client: list[Any], server: dict[str, dict[str, Any]]) -> None:
    for r in client:
        assert r.ok, (r.request_id, r.status, r.error)
        s = server[r.request_id]
        assert s["status"] == 200
        assert s["path"] == ("/v1/chat/completions" if r.api == "chat" else "/v1/completions")
        assert s["stream"] == r.stream
        assert s["input_tokens"] == r.prompt_tokens == r.usage_prompt_tokens
        assert s["output_tokens"] == r.max_tokens == r.usage_completion_tokens == r.content_tokens
        if r.stream:
            # chat: a role chunk first; both: one chunk a token, then usage, then [DONE]
            expected = s["output_tokens"] + (1 if r.api == "chat" else 0) + 2
            assert s["sse_events"] == expected
            assert r.chunks == s["sse_events"] - 1  # the client does not count [DONE]
            assert s["ttft_s"] <= r.ttft_s + CLOCK_SLACK_NS / 1e9
        else:
            assert s["sse_events"] == 0 and r.chunks == 0
        # the server's interval sits inside the client's
        assert r.start_unix_ns - CLOCK_SLACK_NS <= s["arrival_unix_ns"]
        assert s["arrival_unix_ns"] <= s["first_token_unix_ns"] <= s["last_token_unix_ns"]
        assert s["last_token_unix_ns"] <= s["end_unix_ns"] <= r.end_unix_ns + CLOCK_SLACK_NS


def test_replay_matches_the_server_log(server: tuple[str, Path], tmp_path: Path) -> None:
    url, server_log = server
    rows = wl.load_trace(small_trace(tmp_path, 20))
    shaping = wl.Shaping(api="mix", stream_fraction=0.5, seed=1, id_prefix="it")
    planned = wl.plan(rows, shaping)
    assert len(planned) == 20 and {p.stream for p in planned} == {True, False}
    client_log = tmp_path / "client.jsonl"
    records = wl.replay(planned, wl.Target(url=url, backend="openai"), seed=1,
                        log_path=client_log)
    more = wl.plan(rows[:6], wl.Shaping(api="mix", stream_fraction=0.5, seed=2, id_prefix="hx"))
    records += wl.replay(more, wl.Target(url=url, backend="httpx"), seed=2, log_path=client_log)

    assert len(read_jsonl(client_log)) == 26
    by_id = {s["request_id"]: s for s in read_jsonl(server_log)}
    check_against_server(records, by_id)

    # open loop: each send starts on its schedule, not after the one before it finished
    # (within 0.5 s: a clean-clone CI run on the 2-core VM once started the second send
    # 0.25 s late, the first sends paying the client's lazy set-up)
    first = min(r.start_unix_ns for r in records[:20])
    for r in records[:20]:
        assert abs((r.start_unix_ns - first) / 1e9 - r.scheduled_s) < 0.5
    overlapping = sum(1 for a, b in itertools.pairwise(records[:20])
                      if b.start_unix_ns < a.end_unix_ns)
    assert overlapping >= 5


def test_errors_and_request_ids_are_logged(server: tuple[str, Path]) -> None:
    url, server_log = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "a b", "max_tokens": 0},
                   headers={"x-request-id": "bad-1"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert r.headers["x-request-id"] == "bad-1"
    r = httpx.post(url + "/v1/embeddings", json={"input": ["one two three", "four"]},
                   headers={"x-request-id": "emb-1"})
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    assert r.json()["usage"]["prompt_tokens"] == 4
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    generated_id = r.headers["x-request-id"]
    time.sleep(0.2)
    by_id = {s["request_id"]: s for s in read_jsonl(server_log)}
    assert by_id["bad-1"]["status"] == 400 and "max_tokens" in by_id["bad-1"]["error"]
    assert by_id["emb-1"]["input_tokens"] == 4 and by_id["emb-1"]["path"] == "/v1/embeddings"
    assert by_id[generated_id]["output_tokens"] == 2


class FakeAgent:
    """The agent's side of the control socket: a fixed decision; records the reports."""

    def __init__(self, path: str, decisions: dict[str, Any]) -> None:
        self.reports: list[dict[str, Any]] = []
        self.decisions = decisions
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                req = json.loads(line)
                if req["op"] == "report":
                    self.reports.append(req)
                    reply: dict[str, Any] = {"ok": True}
                else:
                    reply = {"ok": True, "version": 1, "decisions": self.decisions}
                conn.sendall(json.dumps(reply).encode() + b"\n")


def test_server_follows_the_agent_and_paces_its_bulk_loader(tmp_path: Path) -> None:
    sock = str(tmp_path / "control.sock")
    agent = FakeAgent(sock, {"batch_window_ms": 40.0, "stream_priority": None,
                             "copy_budget_bytes_per_s": 20e6, "cpu_actions": []})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port), "--hidden", "128", "--vocab", "1024",
         "--control-socket", sock, "--service", "llm-it", "--bulk-loader", "200e6",
         "--bulk-bytes", str(8 << 20), "--bulk-chunk", str(1 << 20)], stderr=subprocess.PIPE)
    try:
        wait_healthy(url, proc)
        time.sleep(0.5)
        before, t0 = httpx.get(url + "/health").json(), time.monotonic()
        time.sleep(2.0)
        after, t1 = httpx.get(url + "/health").json(), time.monotonic()
        assert after["batch_window_ms"] == 40.0  # the agent's window, not the 2 ms default
        rate = (after["bulk_bytes"] - before["bulk_bytes"]) / (t1 - t0)
        assert 10e6 < rate < 25e6  # the agent's 20 MB/s budget, not the 200 MB/s default
        assert agent.reports and agent.reports[-1]["service"] == "llm-it"
        # a lone request now waits out the agent's 40 ms window before its prefill
        t = time.perf_counter()
        httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert time.perf_counter() - t >= 0.04
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
