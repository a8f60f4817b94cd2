"""Servers and clients of the LLM-stack tests: each server logs its own view of every request.

One protocol everywhere: POST /v1/chat/completions with {"model", "max_tokens", "stream",
"messages"}; a streamed answer is `max_tokens` token events a few ms apart (the model's steps),
a usage event, then `data: [DONE]`; an unstreamed one is a JSON body with usage. Every server
writes one JSON line per request: x-request-id, its pid, the client's port, method, path,
status, model, token counts, the number of body writes of a stream and, for the first and the
last of them, the wall-clock time just before and just after the write call (`*_ns`,
`*_end_ns`), so a tracer's timings can be held to the server's own clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import Tracer, free_port, make_cert, wait_port

GAP_S = 0.003  # between token events: a small model's step
TIME_SLACK_NS = 1_000_000  # "within 1 ms of the server's record"

# ASGI: uvicorn (both loops, both parsers), hypercorn, granian, gunicorn's uvicorn workers
ASGI_APP = r'''
import asyncio, json, os, time

LOG = open(os.environ["SITS_TEST_LOG"], "a", buffering=1)
GAP = float(os.environ.get("SITS_TEST_GAP", "0.003"))


def sse(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    q = json.loads(body or b"{}")
    n = int(q.get("max_tokens") or 4)
    n_in = sum(len(str(x.get("content", "")).split()) for x in q.get("messages", []))
    rec = {"rid": dict(scope["headers"]).get(b"x-request-id", b"").decode(),
           "pid": os.getpid(), "port": int(scope["client"][1]), "method": scope["method"],
           "path": scope["path"], "status": 200, "model": q.get("model", ""),
           "input_tokens": n_in, "output_tokens": n, "stream": bool(q.get("stream")),
           "events": 0, "first_ns": None, "first_end_ns": None, "last_ns": None,
           "last_end_ns": None}
    usage = {"prompt_tokens": n_in, "completion_tokens": n, "total_tokens": n_in + n}

    async def write(data):
        t0 = time.time_ns()
        await send({"type": "http.response.body", "body": data, "more_body": True})
        t1 = time.time_ns()
        if rec["first_ns"] is None:
            rec["first_ns"], rec["first_end_ns"] = t0, t1
        rec["last_ns"], rec["last_end_ns"] = t0, t1
        rec["events"] += 1

    if rec["stream"]:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(n):
            await asyncio.sleep(GAP)
            await write(sse({"id": "c1", "model": rec["model"],
                             "choices": [{"index": 0, "delta": {"content": " w%d" % i}}]}))
        await write(sse({"id": "c1", "model": rec["model"], "choices": [], "usage": usage}))
        await write(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        await asyncio.sleep(GAP * n)
        out = json.dumps({"id": "c1", "object": "chat.completion", "model": rec["model"],
                          "choices": [{"index": 0, "finish_reason": "length",
                                       "message": {"role": "assistant", "content": "w" * n}}],
                          "usage": usage}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})
    LOG.write(json.dumps(rec) + "\n")
'''

AIOHTTP_APP = r'''
import asyncio, json, os, ssl, sys, time
from aiohttp import web

LOG = open(os.environ["SITS_TEST_LOG"], "a", buffering=1)
GAP = float(os.environ.get("SITS_TEST_GAP", "0.003"))


def sse(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def chat(request):
    q = await request.json()
    n = int(q.get("max_tokens") or 4)
    n_in = sum(len(str(x.get("content", "")).split()) for x in q.get("messages", []))
    rec = {"rid": request.headers.get("x-request-id", ""), "pid": os.getpid(),
           "port": request.transport.get_extra_info("peername")[1], "method": request.method,
           "path": request.path, "status": 200, "model": q.get("model", ""),
           "input_tokens": n_in, "output_tokens": n, "stream": bool(q.get("stream")),
           "events": 0, "first_ns": None, "first_end_ns": None, "last_ns": None,
           "last_end_ns": None}
    usage = {"prompt_tokens": n_in, "completion_tokens": n, "total_tokens": n_in + n}
    if not rec["stream"]:
        await asyncio.sleep(GAP * n)
        LOG.write(json.dumps(rec) + "\n")
        return web.json_response({"id": "c1", "object": "chat.completion", "model": rec["model"],
                                  "choices": [{"index": 0, "finish_reason": "length",
                                               "message": {"role": "assistant", "content": "w"}}],
                                  "usage": usage})
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)

    async def write(data):
        t0 = time.time_ns()
        await resp.write(data)
        t1 = time.time_ns()
        if rec["first_ns"] is None:
            rec["first_ns"], rec["first_end_ns"] = t0, t1
        rec["last_ns"], rec["last_end_ns"] = t0, t1
        rec["events"] += 1

    for i in range(n):
        await asyncio.sleep(GAP)
        await write(sse({"id": "c1", "model": rec["model"],
                         "choices": [{"index": 0, "delta": {"content": " w%d" % i}}]}))
    await write(sse({"id": "c1", "model": rec["model"], "choices": [], "usage": usage}))
    await write(b"data: [DONE]\n\n")
    await resp.write_eof()
    LOG.write(json.dumps(rec) + "\n")
    return resp


app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
ctx = None
if len(sys.argv) > 2:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(sys.argv[3], sys.argv[2])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), ssl_context=ctx, print=None,
            access_log=None)
'''

NODE_APP = r'''
const http = require("http"), https = require("https"), fs = require("fs");
const [port, log, key, cert] = process.argv.slice(2);
const GAP = Number(process.env.SITS_TEST_GAP || "0.003") * 1000;
// wall clock in ns: the monotonic clock plus an offset taken at the instant Date.now() ticks
// to its next millisecond (Date.now() alone has 1 ms steps, performance.timeOrigin drifts).
// The tick lies between the last read that saw the old millisecond and the first that saw
// the new one; a tick seen across a preemption (a loaded CI machine: the old read showed
// 1.0 ms late timings) is not used, nor is one that skipped a millisecond
const offset = (() => {
  for (;;) {
    let prev = Date.now(), before = process.hrtime.bigint();
    for (;;) {
      const d = Date.now(), after = process.hrtime.bigint();
      if (d !== prev) {
        if (d === prev + 1 && after - before < 20000n)
          return BigInt(d) * 1000000n - (before + after) / 2n;
        break;
      }
      before = after;
    }
  }
})();
const now = () => Number(offset + process.hrtime.bigint());
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const sse = (o) => "data: " + JSON.stringify(o) + "\n\n";

async function answer(req, res, body) {
  const q = JSON.parse(body || "{}");
  const n = Number(q.max_tokens || 4);
  const nIn = (q.messages || []).reduce(
    (a, m) => a + String(m.content || "").split(/\s+/).filter((w) => w).length, 0);
  const rec = {rid: req.headers["x-request-id"] || "", pid: process.pid,
    port: req.socket.remotePort, method: req.method, path: req.url, status: 200,
    model: q.model || "", input_tokens: nIn, output_tokens: n, stream: !!q.stream, events: 0,
    first_ns: null, first_end_ns: null, last_ns: null, last_end_ns: null};
  const usage = {prompt_tokens: nIn, completion_tokens: n, total_tokens: nIn + n};
  // node corks a response's writes until the next tick, and its TLS socket may hold them
  // longer behind a write still in flight (under load, tens of ms): a write's end is stamped
  // when node says the chunk was flushed (its callback, after SSL_write and the socket
  // write), the last chunk's when the response finished (the terminator flushed too)
  const write = (data) => {
    const t0 = now();
    const first = rec.first_ns === null;
    res.write(data, () => { if (first) rec.first_end_ns = now(); });
    if (first) rec.first_ns = t0;
    rec.last_ns = t0; rec.events += 1;
  };
  res.on("finish", () => {
    rec.last_end_ns = now();
    setImmediate(() => fs.appendFileSync(log, JSON.stringify(rec) + "\n"));
  });
  if (rec.stream) {
    res.writeHead(200, {"content-type": "text/event-stream"});
    for (let i = 0; i < n; i++) {
      await sleep(GAP);
      write(sse({id: "c1", model: rec.model, choices: [{index: 0, delta: {content: " w" + i}}]}));
    }
    write(sse({id: "c1", model: rec.model, choices: [], usage}));
    write("data: [DONE]\n\n");
    res.end();
  } else {
    await sleep(GAP * n);
    const out = JSON.stringify({id: "c1", object: "chat.completion", model: rec.model,
      choices: [{index: 0, finish_reason: "length", message: {role: "assistant",
        content: Array.from({length: n}, (_, i) => "w" + i).join(" ")}}],
      usage});
    res.writeHead(200, {"content-type": "application/json", "content-length": Buffer.byteLength(out)});
    res.end(out);
  }
}

function handler(req, res) {
  let body = "";
  req.on("data", (d) => { body += d; });
  req.on("end", () => { answer(req, res, body); });
}

const server = key
  ? https.createServer({key: fs.readFileSync(key), cert: fs.readFileSync(cert)}, handler)
  : http.createServer(handler);
server.keepAliveTimeout = 30000;
server.listen(Number(port), "127.0.0.1");
'''


@dataclass
class Server:
    """A running server: its URL, its processes and its request log."""

    name: str
    base: str
    proc: subprocess.Popen[bytes]
    log: Path
    tls: bool

    def rows(self) -> list[dict[str, Any]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [json.loads(x) for x in text.splitlines() if x.strip()]

    def logged(self, rids: list[str], timeout: float = 15.0) -> dict[str, dict[str, Any]]:
        """The server's rows for `rids`, once it logged all of them."""
        deadline = time.monotonic() + timeout
        want = set(rids)
        while True:
            got = {r["rid"]: r for r in self.rows() if r["rid"] in want}
            if len(got) == len(want) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        missing = want - set(got)
        assert not missing, f"{self.name}: server logged {len(got)} of {len(want)} requests"
        return got


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _env(log: Path) -> dict[str, str]:
    return {"SITS_TEST_LOG": str(log), "SITS_TEST_GAP": str(GAP_S), "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/root")}


def server_command(kind: str, port: int, d: Path, tls: bool) -> list[str]:
    """The command line of one server kind (see SERVER_KINDS), its app written into d."""
    (d / "sseapp.py").write_text(ASGI_APP)
    key, crt = make_cert(d) if tls else (None, None)
    py = sys.executable
    bind = ["--host", "127.0.0.1", "--port", str(port)]
    if kind.startswith("uvicorn"):
        _, loop, parser = kind.split("-")
        args = [py, "-m", "uvicorn", "sseapp:app", *bind, "--loop", loop, "--http", parser,
                "--log-level", "warning", "--no-access-log", "--timeout-keep-alive", "120"]
        return args + (["--ssl-keyfile", str(key), "--ssl-certfile", str(crt)] if tls else [])
    if kind == "hypercorn":
        args = [py, "-m", "hypercorn", "sseapp:app", "--bind", f"127.0.0.1:{port}",
                "--log-level", "warning"]
        return args + (["--keyfile", str(key), "--certfile", str(crt)] if tls else [])
    if kind == "granian":
        return [str(Path(py).parent / "granian"), "--interface", "asgi", *bind, "--workers", "1",
                "--log-level", "warning", "--no-ws", "sseapp:app"]
    if kind == "gunicorn":
        args = [str(Path(py).parent / "gunicorn"), "-k", "uvicorn.workers.UvicornWorker",
                "-w", "2", "-b", f"127.0.0.1:{port}", "--log-level", "warning", "sseapp:app"]
        return args + (["--keyfile", str(key), "--certfile", str(crt)] if tls else [])
    if kind == "aiohttp":
        (d / "aioapp.py").write_text(AIOHTTP_APP)
        return [py, "aioapp.py", str(port)] + ([str(key), str(crt)] if tls else [])
    if kind == "node":
        (d / "app.js").write_text(NODE_APP)
        node = shutil.which("node") or "node"
        return [node, "app.js", str(port), str(d / "server.log")] + \
            ([str(key), str(crt)] if tls else [])
    raise ValueError(kind)


@contextmanager
def run_server(kind: str, tls: bool, wrap: Callable[[list[str]], list[str]] = lambda a: a
               ) -> Iterator[Server]:
    """Start one server kind; `wrap` may rewrite its command line (e.g. exec through sh)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        log = d / "server.log"
        args = wrap(server_command(kind, port, d, tls))
        proc = subprocess.Popen(args, cwd=d, env=_env(log), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            wait_port(port, timeout=30)
            if kind == "gunicorn":
                time.sleep(1.0)  # both workers up, so both take connections
            yield Server(kind, f"{'https' if tls else 'http'}://127.0.0.1:{port}", proc, log, tls)
        finally:
            _stop(proc)


# ---------------------------------------------------------------- clients


@dataclass(frozen=True)
class Call:
    rid: str
    client: str  # a key of CLIENTS
    stream: bool
    model: str
    max_tokens: int
    prompt: str


def _body(c: Call) -> dict[str, Any]:
    b: dict[str, Any] = {"model": c.model, "max_tokens": c.max_tokens, "stream": c.stream,
                         "messages": [{"role": "user", "content": c.prompt}]}
    if c.stream:
        b["stream_options"] = {"include_usage": True}
    return b


def _check_sse(c: Call, text: str) -> None:
    events = text.count("data: ")
    assert events == c.max_tokens + 2, f"{c.client} {c.rid}: {events} events"


def call_httpx(base: str, c: Call) -> None:
    import httpx
    with httpx.Client(verify=False, timeout=30) as h, \
            h.stream("POST", base + "/v1/chat/completions", json=_body(c),
                     headers={"x-request-id": c.rid}) as r:
        text = b"".join(r.iter_bytes()).decode()
    assert r.status_code == 200
    if c.stream:
        _check_sse(c, text)


def call_requests(base: str, c: Call) -> None:
    import requests
    with requests.Session() as s:
        r = s.post(base + "/v1/chat/completions", json=_body(c), stream=c.stream,
                   headers={"x-request-id": c.rid}, verify=False, timeout=30)
        text = b"".join(r.iter_content(None)).decode()
    assert r.status_code == 200
    if c.stream:
        _check_sse(c, text)


def call_aiohttp(base: str, c: Call) -> None:
    import aiohttp

    async def go() -> tuple[int, str]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False)) as s, \
                s.post(base + "/v1/chat/completions", json=_body(c),
                       headers={"x-request-id": c.rid}) as r:
            chunks = [x async for x in r.content.iter_any()]
            return r.status, b"".join(chunks).decode()
    status, text = asyncio.run(go())
    assert status == 200
    if c.stream:
        _check_sse(c, text)


def call_curl(base: str, c: Call) -> None:
    out = subprocess.run(
        # --http1.1: a TLS server that offers h2 (hypercorn) would get HTTP/2, not traced
        ["curl", "-sSk", "-N", "--http1.1", "--max-time", "30", "-H", f"x-request-id: {c.rid}",
         "-H", "content-type: application/json", "-d", json.dumps(_body(c)),
         base + "/v1/chat/completions"], capture_output=True, text=True, check=True)
    if c.stream:
        _check_sse(c, out.stdout)


def _openai_kwargs(c: Call) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": c.model, "max_tokens": c.max_tokens, "stream": c.stream,
                          "messages": [{"role": "user", "content": c.prompt}],
                          "extra_headers": {"x-request-id": c.rid}}
    if c.stream:
        kw["stream_options"] = {"include_usage": True}
    return kw


def call_openai(base: str, c: Call) -> None:
    import httpx
    import openai
    with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                       http_client=httpx.Client(verify=False, timeout=30)) as o:
        r = o.chat.completions.create(**_openai_kwargs(c))
        if c.stream:
            chunks = list(r)
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == c.max_tokens
            assert len(chunks) == c.max_tokens + 1
        else:
            assert r.usage is not None and r.usage.completion_tokens == c.max_tokens


def call_openai_async(base: str, c: Call) -> None:
    import httpx
    import openai

    async def go() -> None:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                      http_client=httpx.AsyncClient(verify=False,
                                                                    timeout=30)) as o:
            r = await o.chat.completions.create(**_openai_kwargs(c))
            if c.stream:
                chunks = [x async for x in r]
                assert len(chunks) == c.max_tokens + 1
            else:
                assert r.usage is not None and r.usage.completion_tokens == c.max_tokens
    asyncio.run(go())


CLIENTS: dict[str, Callable[[str, Call], None]] = {
    "openai": call_openai, "openai_async": call_openai_async, "httpx": call_httpx,
    "requests": call_requests, "aiohttp": call_aiohttp, "curl": call_curl,
}
# (client, streamed): every SDK call shape, plain clients streaming
MIX: tuple[tuple[str, bool], ...] = (
    ("openai", True), ("openai", False), ("openai_async", True), ("openai_async", False),
    ("httpx", True), ("aiohttp", True), ("requests", True), ("curl", True))


def plan(tag: str, n: int, mix: tuple[tuple[str, bool], ...] = MIX) -> list[Call]:
    """n calls cycling through the mix, with varied models and sizes."""
    out = []
    for i in range(n):
        client, stream = mix[i % len(mix)]
        out.append(Call(rid=f"{tag}-{i}-{os.urandom(4).hex()}", client=client, stream=stream,
                        model=f"m-{i % 3}", max_tokens=4 + i % 9,
                        prompt=" ".join(["tok"] * (3 + i % 11))))
    return out


def run_concurrently(base: str, calls: list[Call]) -> None:
    """All calls at once, each on its own new connection; raises the first failure."""
    barrier = threading.Barrier(len(calls))
    errors: list[tuple[Call, BaseException]] = []

    def one(c: Call) -> None:
        try:
            barrier.wait(timeout=30)
            CLIENTS[c.client](base, c)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((c, exc))

    threads = [threading.Thread(target=one, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors, [(c.client, c.rid, repr(e)[:300]) for c, e in errors[:4]]


# ---------------------------------------------------------------- the check


@dataclass
class Verdict:
    bad: list[str] = field(default_factory=list)

    def expect(self, rid: str, what: str, got: object, want: object) -> None:
        if got != want:
            self.bad.append(f"{rid}: {what} {got!r} != {want!r}")

    late_ns: int = 0

    def within(self, rid: str, what: str, t: float | None, lo: int, hi: int) -> None:
        if t is None or not lo - TIME_SLACK_NS <= t <= hi + TIME_SLACK_NS + self.late_ns:
            off = None if t is None else min(abs(t - lo), abs(t - hi)) / 1e6
            side = "" if t is None else (" early" if t < lo else " late")
            self.bad.append(f"{rid}: {what} off by {off} ms{side}")


# servers whose wire write comes after the app's call returned, never before: granian
# writes from its Rust runtime (a thread hand-off). (node's app stamps a write's end when node
# says it was flushed: CI saw its TLS socket's SSL_write 20 ms after the next tick, and a
# 10 ms allowance had been the fix before)
LATE_WRITERS = {"granian": 5_000_000}


def _abs_ns(span: dict[str, Any], ms_attr: str) -> float | None:
    v = span["attributes"].get(ms_attr)
    return None if v is None else int(span["start_time_unix_nano"]) + float(v) * 1e6


# servers whose writes the runtime merges (node corks a tick's writes into one writev; granian's
# hyper buffers): their wire writes are fewer than their send calls, so only the SSE events
# are held to the server's count there
COALESCING = ("node", "granian")


def check_server_span(v: Verdict, span: dict[str, Any], row: dict[str, Any], tls: bool,
                      coalescing: bool = False) -> None:
    rid, a = row["rid"], span["attributes"]
    v.expect(rid, "client.port", a.get("client.port"), row["port"])
    v.expect(rid, "method", a.get("http.request.method"), row["method"])
    v.expect(rid, "path", a.get("url.path"), row["path"])
    v.expect(rid, "status", a.get("http.response.status_code"), row["status"])
    v.expect(rid, "scheme", a.get("url.scheme"), "https" if tls else "http")
    v.expect(rid, "error", (a.get("error.type"), span["status"]["code"]), (None, "UNSET"))
    v.expect(rid, "model", a.get("gen_ai.request.model"), row["model"])
    v.expect(rid, "max_tokens", a.get("gen_ai.request.max_tokens"), row["output_tokens"])
    v.expect(rid, "input_tokens", a.get("gen_ai.usage.input_tokens"), row["input_tokens"])
    v.expect(rid, "output_tokens", a.get("gen_ai.usage.output_tokens"), row["output_tokens"])
    if not row["stream"]:
        return
    if not coalescing:
        v.expect(rid, "chunks", a.get("sits.stream.chunks"), row["events"])
    v.expect(rid, "gen_ai events", a.get("sits.gen_ai.stream.events"), row["events"] - 1)
    v.within(rid, "first chunk", _abs_ns(span, "sits.time_to_first_chunk_ms"),
             row["first_ns"], row["first_end_ns"])
    v.within(rid, "first token", _abs_ns(span, "sits.gen_ai.time_to_first_token_ms"),
             row["first_ns"], row["first_end_ns"])
    v.within(rid, "last chunk", _abs_ns(span, "sits.time_to_last_chunk_ms"),
             row["last_ns"], row["last_end_ns"])


def spans_by_rid(tracer: Tracer, rids: list[str], per_rid: int, timeout: float = 15.0
                 ) -> dict[str, list[dict[str, Any]]]:
    """Spans of each x-request-id, once each has `per_rid` (or at the timeout), after a short
    settle so that a duplicate would show up."""
    want = set(rids)
    deadline = time.monotonic() + timeout

    def index() -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {r: [] for r in rids}
        for s in tracer.matching(
                lambda s: s["attributes"].get("http.request.header.x-request-id") in want):
            out[s["attributes"]["http.request.header.x-request-id"]].append(s)
        return out

    while time.monotonic() < deadline:
        if all(len(v) >= per_rid for v in index().values()):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    return index()


def _losses(tracer: Tracer) -> dict[str, Any]:
    """The agent's counters that say whether it lost or dropped anything (for a failure's
    message: a span missing after a ring overflow is not a parser bug)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        elif isinstance(v, int) and v and any(w in prefix for w in (
                "lost", "resync", "malformed", "internal", "orphan", "shed", "gap")):
            flat[prefix.rstrip(".")] = v

    walk("", tracer.counters(settle_s=6.0))
    return flat


def check_spans(tracer: Tracer, server: Server, calls: list[Call],
                client_spans: bool = True) -> None:
    """Each call: one SERVER span from the process that logged it, matching its row; one
    CLIENT span not marked as an error."""
    rows = server.logged([c.rid for c in calls])
    by_rid = spans_by_rid(tracer, [c.rid for c in calls], 2 if client_spans else 1)
    v = Verdict(late_ns=LATE_WRITERS.get(server.name, 0))
    declared: list[str] = []  # spans whose records the agent lost (ring full) and said so
    for c in calls:
        row, spans = rows[c.rid], by_rid[c.rid]
        srv = [s for s in spans if s["kind"] == "SERVER"]
        if [s["attributes"].get("process.pid") for s in srv] != [row["pid"]]:
            v.bad.append(f"{c.rid}: SERVER spans from pids "
                         f"{[s['attributes'].get('process.pid') for s in srv]}, "
                         f"server pid {row['pid']}")
        elif srv[0]["attributes"].get("error.type") == "capture_gap":
            # the exchange went on in records the kernel could not queue (a loaded CI VM
            # under wrk: 1 in ~5000): the span says so instead of guessing; a few are
            # allowed, never a silent wrong span
            declared.append(c.rid)
        else:
            check_server_span(v, srv[0], row, server.tls, server.name in COALESCING)
        if client_spans:
            cli = [s for s in spans if s["kind"] == "CLIENT"]
            errs = [(s["attributes"].get("error.type"), s["status"]["code"]) for s in cli]
            v.expect(c.rid, f"CLIENT spans ({c.client})", errs, [(None, "UNSET")])
    wrong = sorted({b.split(":")[0] for b in v.bad})
    assert not v.bad, (f"{server.name}: {len(wrong)} of {len(calls)} calls wrong "
                       f"({len(v.bad)} findings): {v.bad[:8]}; agent: {_losses(tracer)}")
    assert len(declared) <= len(calls) // 500, (
        f"{server.name}: {len(declared)} of {len(calls)} spans lost records: {declared[:8]}")
