"""Reference LLM inference server: OpenAI-compatible HTTP over a small random-weight model.

    python examples/inference_server.py --port 8000 --log /tmp/server.jsonl
    python examples/inference_server.py --device cuda --bulk-loader 2e9   # GPU node

Endpoints: POST /v1/completions, /v1/chat/completions (`stream: true` gives Server-Sent Events,
`stream_options.include_usage` a final usage event, then `data: [DONE]`), /v1/embeddings;
GET /v1/models, /health. Every request, including errors, is one JSON line in `--log`:
its x-request-id, status, token counts, wall-clock times (time.time_ns) and intervals
(perf_counter) for first and last token, and the number of SSE events written.

Token counts: prompt tokens are the whitespace-separated words of the prompt (token-id lists
count one each, at least 1), or the request's `prompt_tokens` field when given; the output is
always exactly `max_tokens` tokens. The batcher (inference_model.Engine: continuous batching, or
with `--batcher window` whole batches dispatched when the window closes, run side by side) asks
the agent for its batch window through sits_trace.client and reports queue depth and batch
size to it.
`--bulk-loader BYTES_PER_S` adds a background bulk host-to-device copier (a memcpy on CPU),
paced by CopyPacer: the PCIe competitor of the latency-critical copies.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one BLAS thread: the engine thread is the model's core

import argparse
import asyncio
import base64
import contextlib
import importlib
import importlib.util
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_model import (
    BATCHERS,
    Engine,
    Event,
    Sequence,
    Shape,
    build_model,
    prompt_token_ids,
    text_hash,
)

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as _e:  # one line, not a traceback
    sys.exit(f"inference_server: {_e.name} is missing: pip install fastapi uvicorn uvloop httptools")

ROOT = Path(__file__).resolve().parents[1]


def _load_client() -> ModuleType:
    """sits_trace.client, or the repo's client/ folder when the package is not installed."""
    try:
        return importlib.import_module("sits_trace.client")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "sits_trace_client", ROOT / "client" / "__init__.py",
            submodule_search_locations=[str(ROOT / "client")])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["sits_trace_client"] = module
        spec.loader.exec_module(module)
        return module


sits_client = _load_client()


# ---------------------------------------------------------------- request log


@dataclass
class Record:
    """The server's own view of one request; one JSON line in the log."""

    request_id: str
    method: str
    path: str
    arrival_unix_ns: int
    arrival_perf: float
    status: int = 0
    model: str | None = None
    stream: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    first_token_perf: float | None = None
    last_token_perf: float | None = None
    end_perf: float | None = None
    sse_events: int = 0
    error: str | None = None

    def token(self) -> None:
        now = time.perf_counter()
        if self.first_token_perf is None:
            self.first_token_perf = now
        self.last_token_perf = now
        self.output_tokens += 1

    def _unix(self, perf: float | None) -> int | None:
        if perf is None:
            return None
        return self.arrival_unix_ns + round((perf - self.arrival_perf) * 1e9)

    def _since(self, perf: float | None) -> float | None:
        return None if perf is None else perf - self.arrival_perf

    def line(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("arrival_perf", "first_token_perf", "last_token_perf", "end_perf"):
            d.pop(k)
        d.update(first_token_unix_ns=self._unix(self.first_token_perf),
                 last_token_unix_ns=self._unix(self.last_token_perf),
                 end_unix_ns=self._unix(self.end_perf),
                 ttft_s=self._since(self.first_token_perf),
                 last_token_s=self._since(self.last_token_perf),
                 duration_s=self._since(self.end_perf))
        return d


class RequestLog:
    def __init__(self, out: TextIO | None) -> None:
        self.out = out

    def write(self, rec: Record) -> None:
        if self.out is not None:
            self.out.write(json.dumps(rec.line(), separators=(",", ":")) + "\n")
            self.out.flush()


class LogMiddleware:
    """Stamps arrival, takes or makes the x-request-id (echoed back), logs at the end."""

    def __init__(self, app: ASGIApp, log: RequestLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode() or uuid.uuid4().hex
        rec = Record(rid, scope["method"], scope["path"], time.time_ns(), time.perf_counter())
        scope.setdefault("state", {})["record"] = rec

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            rec.end_perf = time.perf_counter()
            self.log.write(rec)


# ---------------------------------------------------------------- API shapes


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = "sits-tiny"
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    prompt_tokens: int | None = None  # hint: count this many prompt tokens, whatever the text


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] = ""


class ChatBody(_Body):
    messages: list[dict[str, Any]]


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = "sits-tiny"
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    prompt_tokens: int | None = None


def count_tokens(prompt: str | list[str] | list[int]) -> tuple[int, int]:
    """(prompt tokens, hash of the text): words of text, one per token id."""
    if isinstance(prompt, str):
        return len(prompt.split()), text_hash(prompt)
    if all(isinstance(p, int) for p in prompt):
        return len(prompt), text_hash(repr(prompt))
    texts = [str(p) for p in prompt]
    return sum(len(t.split()) for t in texts), text_hash("\n".join(texts))


def chat_text(messages: list[dict[str, Any]]) -> str:
    parts: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [str(p.get("text", "")) for p in content if isinstance(p, dict)]
    return "\n".join(parts)


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def word(token: int) -> str:
    return f" w{token}"


# ---------------------------------------------------------------- serving


@dataclass
class Options:
    model_name: str
    max_batch: int
    batch_window_ms: float
    max_tokens_default: int
    max_tokens_limit: int
    max_prompt_tokens: int
    max_queue: int
    service: str


class Service:
    """The engine, the agent link and the bulk loader, bound to the event loop at start-up."""

    def __init__(self, opts: Options, engine_factory: Callable[[Callable[[list[Event]], None]],
                                                                Engine],
                 control: Any, loader: BulkLoader | None, control_interval_s: float) -> None:
        self.opts = opts
        self.control = control
        self.loader = loader
        self.engine = engine_factory(self._deliver)
        self.control_interval_s = control_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._control_thread = threading.Thread(target=self._control_loop, name="control",
                                                daemon=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        self._control_thread.start()
        if self.loader is not None:
            self.loader.start()

    def stop(self) -> None:
        self._stop.set()
        if self.loader is not None:
            self.loader.stop()
        self.engine.stop()
        self._control_thread.join(timeout=2)
        self.control.close()

    def _deliver(self, events: list[Event]) -> None:
        """Engine thread -> event loop, once per step."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(_dispatch, events)

    def _control_loop(self) -> None:
        """Follow the agent's decisions and tell it the load; blocking I/O stays off the loop."""
        while not self._stop.wait(self.control_interval_s):
            self.engine.window_ms = self.control.batch_window_ms(self.opts.batch_window_ms)
            self.control.report(self.engine.queue_depth(), self.engine.stats.last_batch,
                                self.opts.service, arrivals=self.engine.stats.submitted)
            if self.loader is not None:
                self.loader.follow(self.control)

    def submit(self, ids: np.ndarray[Any, Any], max_tokens: int,
               rec: Record) -> Sequence:
        if self.opts.max_queue and self.engine.queue_depth() >= self.opts.max_queue:
            raise ApiError(429, "server queue is full", "rate_limit_exceeded")
        seq = Sequence(ids, max_tokens, arrival=rec.arrival_perf, sink=asyncio.Queue())
        self.engine.submit(seq)
        return seq


def _dispatch(events: list[Event]) -> None:
    for e in events:
        e.seq.sink.put_nowait(e)


async def tokens(seq: Sequence) -> AsyncIterator[Event]:
    """The sequence's events as they come; cancels it in the engine if the consumer stops."""
    try:
        while True:
            event: Event = await seq.sink.get()
            yield event
            if event.finished:
                return
    finally:
        seq.cancelled = True  # no-op when finished; frees the batch slot on disconnect


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Generation:
    """One completion or chat request, streamed or not."""

    def __init__(self, svc: Service, rec: Record, body: _Body, chat: bool,
                 counted: tuple[int, int]) -> None:
        opts = svc.opts
        n_prompt = body.prompt_tokens if body.prompt_tokens is not None else counted[0]
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens)
                           if m is not None), opts.max_tokens_default)
        if not 1 <= max_tokens <= opts.max_tokens_limit:
            raise ApiError(400, f"max_tokens must be 1..{opts.max_tokens_limit}")
        n_prompt = max(1, n_prompt)
        if n_prompt > opts.max_prompt_tokens:
            raise ApiError(400, f"prompt is {n_prompt} tokens, the limit is "
                                f"{opts.max_prompt_tokens}")
        self.svc, self.rec, self.chat = svc, rec, chat
        self.model = body.model
        self.max_tokens = max_tokens
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        rec.model, rec.stream, rec.input_tokens = body.model, body.stream, n_prompt
        ids = prompt_token_ids(counted[1], n_prompt, svc.engine.model.shape.vocab)
        self.seq = svc.submit(ids, max_tokens, rec)

    def usage(self) -> dict[str, int]:
        n_in, n_out = self.rec.input_tokens, self.rec.output_tokens
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice] if choice is not None else []}

    def _token_choice(self, text: str, finished: bool) -> dict[str, Any]:
        reason = "length" if finished else None
        if self.chat:
            return {"index": 0, "delta": {"content": text}, "logprobs": None,
                    "finish_reason": reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    async def events(self) -> AsyncIterator[bytes]:
        """SSE: (chat) a role chunk, one chunk a token, (asked) usage, [DONE]."""
        rec = self.rec
        if self.chat:
            rec.sse_events += 1
            yield sse(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}))
        async for e in tokens(self.seq):
            assert e.token is not None
            rec.token()
            rec.sse_events += 1
            yield sse(self._chunk(self._token_choice(word(e.token), e.finished)))
        if self.include_usage:
            rec.sse_events += 1
            yield sse({**self._chunk(None), "usage": self.usage()})
        rec.sse_events += 1
        yield b"data: [DONE]\n\n"

    async def whole(self) -> dict[str, Any]:
        words: list[str] = []
        async for e in tokens(self.seq):
            assert e.token is not None
            self.rec.token()
            words.append(word(e.token))
        text = "".join(words)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    async def response(self, stream: bool) -> Response:
        if stream:
            return StreamingResponse(self.events(), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        return JSONResponse(await self.whole())


async def embed(svc: Service, rec: Record, body: EmbeddingBody) -> dict[str, Any]:
    counts = [count_tokens(i) for i in _embedding_inputs(body.input)]
    if not counts:
        raise ApiError(400, "input is empty")
    if body.prompt_tokens is not None:
        counts = [(body.prompt_tokens, h) for _, h in counts]
    vocab = svc.engine.model.shape.vocab
    seqs = [svc.submit(prompt_token_ids(h, max(1, n), vocab), 0, rec) for n, h in counts]
    rec.model, rec.input_tokens = body.model, sum(max(1, n) for n, _ in counts)
    data = []
    for i, seq in enumerate(seqs):
        vector = await _vector(seq)
        data.append({"object": "embedding", "index": i,
                     "embedding": _encode(vector, body.encoding_format)})
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": rec.input_tokens, "total_tokens": rec.input_tokens}}


def _embedding_inputs(raw: str | list[str] | list[int] | list[list[int]]
                      ) -> list[str | list[int]]:
    """One prompt per embedding: a string, a token-id list, or a list of either."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(i, int) for i in raw):
        return [[int(i) for i in raw if isinstance(i, int)]]
    return [i for i in raw if isinstance(i, (str, list))]


async def _vector(seq: Sequence) -> np.ndarray[Any, Any]:
    async for e in tokens(seq):
        if e.vector is not None:
            return e.vector
    raise ApiError(500, "embedding sequence ended without a vector", "server_error")


def _encode(vector: np.ndarray[Any, Any], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return [float(x) for x in vector]


def record_of(request: Request) -> Record:
    rec: Record = request.scope["state"]["record"]
    return rec


def build_app(svc: Service, log: RequestLog) -> ASGIApp:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        svc.start()
        yield
        svc.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        record_of(request).error = str(exc)
        return JSONResponse(error_body(str(exc), exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        message = f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg', 'invalid')}"
        record_of(request).error = message
        return JSONResponse(error_body(message), status_code=400)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        gen = Generation(svc, record_of(request), body, False, count_tokens(body.prompt))
        return await gen.response(body.stream)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        gen = Generation(svc, record_of(request), body, True, count_tokens(chat_text(body.messages)))
        return await gen.response(body.stream)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingBody, request: Request) -> dict[str, Any]:
        return await embed(svc, record_of(request), body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": svc.opts.model_name, "object": "model",
                                            "created": 0, "owned_by": "sits-trace"}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = svc.engine.stats
        return {"status": "ok", "queue_depth": svc.engine.queue_depth(), "active": s.active,
                "steps": s.steps, "tokens": s.tokens, "prefill_tokens": s.prefill_tokens,
                "last_batch": s.last_batch, "batch_window_ms": svc.engine.window_ms,
                "bulk_bytes": svc.loader.copied if svc.loader is not None else 0}

    return LogMiddleware(app, log)


# ---------------------------------------------------------------- bulk loader


class BulkLoader:
    """Copies a host buffer to the device over and over, paced: the PCIe competitor."""

    def __init__(self, pacer: Any, nbytes: int, default_budget: float | None,
                 torch: ModuleType | None, device: str) -> None:
        self.pacer = pacer
        self.nbytes = nbytes
        self.default_budget = default_budget
        self.copied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bulk-loader", daemon=True)
        self._copy_range = self._make_copier(torch, device)

    def _make_copier(self, torch: ModuleType | None, device: str) -> Callable[[int, int], None]:
        if torch is not None and device == "cuda":
            src = torch.empty(self.nbytes, dtype=torch.uint8).pin_memory()
            dst = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
            stream = torch.cuda.Stream()

            def copy_cuda(off: int, n: int) -> None:
                with torch.cuda.stream(stream):
                    dst[off:off + n].copy_(src[off:off + n], non_blocking=True)
                stream.synchronize()
            return copy_cuda
        host = np.ones(self.nbytes, dtype=np.uint8)
        dev = np.empty_like(host)

        def copy_host(off: int, n: int) -> None:
            dev[off:off + n] = host[off:off + n]
        return copy_host

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def follow(self, control: Any) -> None:
        self.pacer.set_budget(control.copy_budget_bytes_per_s(self.default_budget))

    def _count(self, off: int, n: int) -> None:
        self._copy_range(off, n)
        self.copied += n

    def _run(self) -> None:
        while not self._stop.is_set():
            self.pacer.copy(self.nbytes, self._count, stop=self._stop)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: inference_server.py --port 8000 --log s.jsonl")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    p.add_argument("--tls-cert", help="PEM certificate (TLS when given with --tls-key)")
    p.add_argument("--tls-key")
    p.add_argument("--log", help="request log, one JSON object a line (appended)")
    p.add_argument("--model-name", default="sits-tiny")
    p.add_argument("--backend", choices=["auto", "torch", "numpy"], default="auto")
    p.add_argument("--device", default="cpu", help="cpu or cuda (needs PyTorch)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-window-ms", type=float, default=2.0,
                   help="default admission window; the agent's decision replaces it")
    p.add_argument("--batcher", choices=BATCHERS, default="continuous",
                   help="continuous (requests join the running batch) or window (whole "
                        "batches dispatched when the window closes, run side by side)")
    p.add_argument("--instances", type=int, default=0,
                   help="window batcher: batches running at once (0: no bound)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per step")
    p.add_argument("--step-floor-ms", type=float, default=0.0,
                   help="sleep so a step takes at least this long (a bigger model's pace)")
    p.add_argument("--max-tokens-default", type=int, default=16)
    p.add_argument("--max-tokens-limit", type=int, default=4096)
    p.add_argument("--max-prompt-tokens", type=int, default=32768)
    p.add_argument("--max-queue", type=int, default=1024, help="429 beyond this (0: no bound)")
    p.add_argument("--control-socket", default=sits_client.DEFAULT_SOCKET)
    p.add_argument("--control-interval-ms", type=float, default=100.0)
    p.add_argument("--service", default="inference")
    p.add_argument("--bulk-loader", type=float, metavar="BYTES_PER_S",
                   help="run the paced bulk copier at this budget (inf: unpaced)")
    p.add_argument("--bulk-bytes", type=int, default=64 << 20)
    p.add_argument("--bulk-chunk", type=int, default=4 << 20)
    return p.parse_args(argv)


def validate(a: argparse.Namespace) -> str | None:
    if bool(a.tls_cert) != bool(a.tls_key):
        return "--tls-cert and --tls-key go together"
    for path in (a.tls_cert, a.tls_key):
        if path and not os.path.isfile(path):
            return f"no such file: {path}"
    if a.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        return "--loop uvloop: uvloop is not installed (pip install uvloop)"
    if a.max_batch < 1 or a.prefill_chunk < 1 or a.batch_window_ms < 0 or a.instances < 0:
        return "--max-batch and --prefill-chunk must be >= 1, --batch-window-ms and --instances >= 0"
    if a.bulk_loader is not None and not a.bulk_loader > 0:
        return "--bulk-loader must be > 0 bytes/s (inf: unpaced)"
    return None


def make_service(a: argparse.Namespace) -> Service:
    control = sits_client.ControlClient(a.control_socket)
    shape = Shape(a.hidden, a.layers, a.vocab)
    model = build_model(a.backend, a.device, shape,
                        lambda torch: sits_client.stream_priority(torch, control))
    opts = Options(a.model_name, a.max_batch, a.batch_window_ms, a.max_tokens_default,
                   a.max_tokens_limit, a.max_prompt_tokens, a.max_queue, a.service)
    loader = None
    if a.bulk_loader is not None:
        budget = None if a.bulk_loader == float("inf") else a.bulk_loader
        torch = getattr(model, "torch", None)
        loader = BulkLoader(sits_client.CopyPacer(budget, a.bulk_chunk), a.bulk_bytes, budget,
                            torch, a.device)

    def engine(deliver: Callable[[list[Event]], None]) -> Engine:
        return Engine(model, deliver, a.max_batch, a.batch_window_ms, a.prefill_chunk,
                      a.step_floor_ms, batcher=a.batcher, instances=a.instances)
    return Service(opts, engine, control, loader, a.control_interval_ms / 1000)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    problem = validate(a)
    if problem is not None:
        print(f"inference_server: {problem}", file=sys.stderr)
        return 2
    try:
        svc = make_service(a)
    except ValueError as e:
        print(f"inference_server: {e}", file=sys.stderr)
        return 2
    out = open(a.log, "a", encoding="utf-8") if a.log else None  # noqa: SIM115 - server lifetime
    app = build_app(svc, RequestLog(out))
    try:
        uvicorn.run(app, host=a.host, port=a.port, loop=a.loop, http="auto",
                    ssl_certfile=a.tls_cert, ssl_keyfile=a.tls_key, log_level="warning",
                    access_log=False, lifespan="on")
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
