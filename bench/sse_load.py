"""Agent cost on a streaming (SSE) workload: uvicorn + uvloop + httptools, OpenAI-shaped events.

    .venv/bin/python bench/sse_load.py [--streams 200] [--rate 50] [--tokens 50] [--seconds 10]
                                       [--rounds 3] [--baseline /path/to/main/.venv/bin/python]
                                       [--baseline-env NAME=VALUE]

`--streams` clients each stream a chat completion of `--tokens` events at `--rate` events/s
(each event its own write, then a usage event, `data: [DONE]` and the chunked terminator),
then ask again on the same connection, for `--seconds`. In each round the same load runs with
no agent, with this checkout's `sits-trace trace --json --pid <server>` at the default budget,
and (with --baseline) with another checkout's agent, or (with --baseline-env, e.g. SITS_NATIVE=0)
this checkout's in that environment: interleaved, so noise hits all alike.
Prints, per agent: its CPU (cores), records read per response, spans, exchanges shed, and
the events/s the server really delivered (a loaded machine may not reach the asked rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

APP = r'''
import asyncio, json, os
N = int(os.environ["SSE_TOKENS"]); DT = 1.0 / float(os.environ["SSE_RATE"])
EV = [b"data: " + json.dumps({"id": "c", "model": "tiny", "choices": [{"delta": {"content": f" t{i}"}}]}).encode() + b"\n\n" for i in range(N)]
USAGE = b"data: " + json.dumps({"id": "c", "model": "tiny", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": N, "total_tokens": N + 9}}).encode() + b"\n\n"
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    loop = asyncio.get_running_loop(); t = loop.time()
    for e in EV:
        await send({"type": "http.response.body", "body": e, "more_body": True})
        t += DT
        await asyncio.sleep(max(0.0, t - loop.time()))
    await send({"type": "http.response.body", "body": USAGE, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
'''

REQ = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
       b"content-length: 49\r\n\r\n" + b'{"model": "tiny", "stream": true, "messages": []}')


async def one_client(port: int, deadline: float, done: list[int], events: list[int]) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            w.write(REQ)
            buf = b""
            while not buf.endswith(b"0\r\n\r\n"):
                data = await r.read(65536)
                if not data:
                    return
                buf = buf[-8:] + data if len(buf) > 65536 else buf + data
                events[0] += data.count(b"data: ")
            done[0] += 1
    finally:
        w.close()


async def drive(port: int, streams: int, seconds: float) -> tuple[int, int]:
    done, events = [0], [0]
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(one_client(port, deadline, done, events) for _ in range(streams)),
                         return_exceptions=True)
    return done[0], events[0]


def load(port: int, streams: int, seconds: float) -> tuple[int, int]:
    """Client in its own process (uvloop if present), so its CPU is not the bench's."""
    code = (f"import asyncio,sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import sse_load as s; "
            f"print(*s._run_drive({port}, {streams}, {seconds}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    done, ev = out.stdout.split()
    return int(done), int(ev)


def _run_drive(port: int, streams: int, seconds: float) -> tuple[int, int]:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(drive(port, streams, seconds))


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def start_agent(py: str, pid: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    sits = str(Path(py).parent / "sits-trace")
    p = subprocess.Popen([sits, "trace", "--json", "--pid", str(pid)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert p.stderr is not None
    for line in p.stderr:
        if line.startswith("sits-trace: tracing;"):  # not a path in a warning
            return p
    raise SystemExit("bench: agent did not start")


def stats_of(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"\b(records|spans|exchanges_shed|lost_in_kernel)=(\d+)",
                                             text)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", help="another checkout's venv python (e.g. main's)")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of the baseline agent (repeatable), e.g. SITS_NATIVE=0")
    a = ap.parse_args()
    port = 20000 + os.getpid() % 20000
    benv = dict(kv.split("=", 1) for kv in a.baseline_env)
    agents = {"after": sys.executable} | (
        {"base": a.baseline or sys.executable} if a.baseline or benv else {})
    rows: dict[str, list[dict[str, float]]] = {"off": []} | {k: [] for k in agents}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "sseapp.py").write_text(APP)
        env = dict(os.environ, SSE_TOKENS=str(a.tokens), SSE_RATE=str(a.rate))
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "sseapp:app", "--port", str(port), "--loop", "uvloop",
             "--http", "httptools", "--log-level", "warning", "--no-access-log",
             "--backlog", "4096"], cwd=d, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            time.sleep(2)
            load(port, 4, 1)  # warm-up
            for rnd in range(a.rounds):
                for name, done_rows in rows.items():
                    agent = (start_agent(agents[name], server.pid, benv if name == "base" else None)
                             if name != "off" else None)
                    c0 = cpu_seconds(agent.pid) if agent else 0.0
                    s0 = cpu_seconds(server.pid)
                    t0 = time.monotonic()
                    done, evs = load(port, a.streams, a.seconds)
                    wall = time.monotonic() - t0
                    row: dict[str, float] = {"responses": done, "events_per_s": evs / wall,
                                             "server_cores": (cpu_seconds(server.pid) - s0) / wall}
                    if agent is not None:
                        time.sleep(0.5)
                        row["agent_cores"] = (cpu_seconds(agent.pid) - c0) / (wall + 0.5)
                        agent.send_signal(signal.SIGINT)
                        _, err = agent.communicate(timeout=60)
                        st = stats_of(next((x for x in reversed(err.strip().splitlines())
                                            if "records=" in x), ""))
                        row.update({k: float(v) for k, v in st.items()})
                        if st.get("spans"):
                            row["records_per_response"] = st["records"] / st["spans"]
                    done_rows.append(row)
                    print(f"round {rnd + 1} [{name}]: " + " ".join(
                        f"{k}={v:.3g}" for k, v in row.items()), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=10)
    summary = {name: {k: statistics.median(r[k] for r in rs if k in r) for k in rs[0]}
               for name, rs in rows.items() if rs}
    print(json.dumps({"args": vars(a), "median": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
