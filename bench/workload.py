"""Replay an Azure LLM inference trace against an OpenAI-compatible server, open loop.

Trace: Azure LLM inference traces 2023 (Microsoft Azure, AzurePublicDataset, CC-BY 4.0; Patel et
al., "Splitwise", ISCA 2024): TIMESTAMP, ContextTokens, GeneratedTokens per request.

Each trace row becomes one request sent at its (scaled) arrival time whether or not earlier ones
have finished. The prompt is ContextTokens words (the reference server counts words), max_tokens
is GeneratedTokens, both times --token-scale and clamped. Knobs for fault runs: --rate-step-at
T --rate-step X (arrivals after T come X times faster) and --mix-shift-at T --mix-shift X (sizes
after T times X). Every request carries an x-request-id and becomes one JSON line in --log.

    python bench/workload.py --url http://127.0.0.1:8000 --trace conv --rate-scale 0.5 \\
        --duration 30 --token-scale 0.1 --max-output-tokens 64 --slo-ttft-ms 500

Importable: `load_trace`, `plan`, `replay` (returns the per-request records), `summarize`.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO


def _data_dir() -> Path:
    """$SITS_DATA_DIR, else ../shared/data beside the checkout (or a worktree's)."""
    env = os.environ.get("SITS_DATA_DIR")
    if env:
        return Path(env)
    for parent in Path(__file__).resolve().parents[1:4]:
        if (parent / "shared" / "data").is_dir():
            return parent / "shared" / "data"
    return Path(__file__).resolve().parents[2] / "shared" / "data"


DATA = _data_dir()
TRACES = {"conv": "azure_llm_inference_2023_conv.csv", "code": "azure_llm_inference_2023_code.csv"}
WORDS = ("the", "model", "token", "batch", "cache", "layer", "prompt", "stream", "queue", "node",
         "kernel", "copy", "tensor", "graph", "shard", "rank")


class WorkloadError(Exception):
    """A user error: one line, no traceback."""


# ---------------------------------------------------------------- trace


@dataclass(frozen=True)
class TraceRow:
    t_s: float  # seconds since the trace's first row
    context_tokens: int
    generated_tokens: int


def parse_timestamp(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' -> POSIX seconds (any number of fraction digits)."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.fromisoformat(whole).timestamp()
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


def load_trace(path: Path) -> list[TraceRow]:
    """Rows sorted by arrival, times relative to the first."""
    try:
        with path.open(newline="") as f:
            raw = [(parse_timestamp(r["TIMESTAMP"]), int(r["ContextTokens"]),
                    int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    except OSError as e:
        raise WorkloadError(f"cannot read trace {path}: {e.strerror}") from None
    except (KeyError, ValueError) as e:
        raise WorkloadError(f"{path}: not an Azure LLM trace (TIMESTAMP, ContextTokens, "
                            f"GeneratedTokens): {e}") from None
    if not raw:
        raise WorkloadError(f"{path}: no rows")
    raw.sort(key=lambda x: x[0])  # stable: ties keep the file's order
    t0 = raw[0][0]
    return [TraceRow(t - t0, c, g) for t, c, g in raw]


def trace_path(name: str, data_dir: Path = DATA) -> Path:
    return data_dir / TRACES[name] if name in TRACES else Path(name)


# ---------------------------------------------------------------- shaping


@dataclass(frozen=True)
class Shaping:
    rate_scale: float = 1.0  # 2.0: arrivals twice as fast
    max_rps: float | None = None  # slow the whole schedule so its mean rate is at most this
    token_scale: float = 1.0
    min_prompt_tokens: int = 1
    max_prompt_tokens: int = 4096
    min_output_tokens: int = 1
    max_output_tokens: int = 1024
    start_s: float = 0.0  # skip this much of the trace first
    duration_s: float | None = None
    max_requests: int | None = None
    rate_step_at_s: float | None = None
    rate_step: float = 1.0
    mix_shift_at_s: float | None = None
    mix_shift: float = 1.0
    stream_fraction: float = 1.0
    api: str = "chat"  # chat, completions or mix
    seed: int = 0
    id_prefix: str = "wl"

    def check(self) -> None:
        if not (self.rate_scale > 0 and self.token_scale > 0 and self.rate_step > 0
                and self.mix_shift > 0):
            raise WorkloadError("--rate-scale, --token-scale, --rate-step, --mix-shift must be > 0")
        if self.max_rps is not None and not self.max_rps > 0:
            raise WorkloadError("--max-rps must be > 0")
        if not 0.0 <= self.stream_fraction <= 1.0:
            raise WorkloadError("--stream-fraction must be in 0..1")
        if self.api not in ("chat", "completions", "mix"):
            raise WorkloadError("--api must be chat, completions or mix")
        if not (1 <= self.min_prompt_tokens <= self.max_prompt_tokens
                and 1 <= self.min_output_tokens <= self.max_output_tokens):
            raise WorkloadError("token clamps need 1 <= min <= max")


@dataclass(frozen=True)
class Planned:
    index: int
    request_id: str
    at_s: float  # send time, seconds after the replay starts
    prompt_tokens: int
    max_tokens: int
    stream: bool
    api: str


def _times(rows: list[TraceRow], s: Shaping, scale: float) -> list[tuple[float, TraceRow]]:
    """Scaled, stepped and bounded arrival times of the rows."""
    out: list[tuple[float, TraceRow]] = []
    first = next((r.t_s for r in rows if r.t_s >= s.start_s), None)
    for r in rows:
        if first is None or r.t_s < s.start_s:
            continue
        t = (r.t_s - first) / scale
        if s.rate_step_at_s is not None and t > s.rate_step_at_s:
            t = s.rate_step_at_s + (t - s.rate_step_at_s) / s.rate_step
        if s.duration_s is not None and t >= s.duration_s:
            break
        out.append((t, r))
        if s.max_requests is not None and len(out) >= s.max_requests:
            break
    return out


def mean_rate(times: list[float]) -> float:
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])


def _scaled_times(rows: list[TraceRow], s: Shaping) -> list[tuple[float, TraceRow]]:
    """Apply --rate-scale; when the mean rate is then above --max-rps, the fastest slower scale
    (bisection) whose mean rate is at most --max-rps. Slowing also changes which rows fit the
    duration, and traces are bursty, so the result is near the cap rather than on it."""
    timed = _times(rows, s, s.rate_scale)
    if s.max_rps is None or mean_rate([t for t, _ in timed]) <= s.max_rps:
        return timed
    lo, hi = s.rate_scale * 1e-4, s.rate_scale
    best = _times(rows, s, lo)
    for _ in range(24):
        mid = math.sqrt(lo * hi)
        trial = _times(rows, s, mid)
        if mean_rate([t for t, _ in trial]) <= s.max_rps:
            lo, best = mid, trial
        else:
            hi = mid
    return best


def _clamp(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(x)))


def plan(rows: list[TraceRow], s: Shaping) -> list[Planned]:
    """The replay schedule: who is sent when, how big, streamed or not, through which API."""
    s.check()
    rng = random.Random(s.seed)
    out = []
    for i, (t, r) in enumerate(_scaled_times(rows, s)):
        size = s.token_scale * (s.mix_shift if s.mix_shift_at_s is not None
                                and t >= s.mix_shift_at_s else 1.0)
        stream = rng.random() < s.stream_fraction
        api = rng.choice(("chat", "completions")) if s.api == "mix" else s.api
        out.append(Planned(
            i, f"{s.id_prefix}-{i:06d}", t,
            _clamp(r.context_tokens * size, s.min_prompt_tokens, s.max_prompt_tokens),
            _clamp(r.generated_tokens * size, s.min_output_tokens, s.max_output_tokens),
            stream, api))
    return out


def prompt_text(p: Planned, seed: int) -> str:
    """Exactly p.prompt_tokens whitespace-separated words, the same for the same seed."""
    rng = random.Random(seed * 1_000_003 + p.index)
    return " ".join(rng.choices(WORDS, k=p.prompt_tokens))


# ---------------------------------------------------------------- sending


@dataclass
class Record:
    """The client's view of one request; one JSON line in the client log."""

    request_id: str
    api: str
    stream: bool
    scheduled_s: float
    prompt_tokens: int
    max_tokens: int
    start_unix_ns: int = 0
    start_lag_s: float = 0.0  # how late the send started against its schedule
    ttft_s: float | None = None  # streamed only: first content chunk
    latency_s: float | None = None
    end_unix_ns: int | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    content_tokens: int = 0  # content chunks (streamed) or words (not streamed) received
    chunks: int = 0  # SSE data events received, [DONE] not counted
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass(frozen=True)
class Target:
    url: str = "http://127.0.0.1:8000"
    backend: str = "openai"  # openai (SDK) or httpx
    model: str = "sits-tiny"
    timeout_s: float = 120.0
    verify: bool | str = True  # False, or a CA bundle path, for a self-signed TLS server
    max_connections: int = 1000


def _body(p: Planned, text: str, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": p.max_tokens, "stream": p.stream}
    if p.api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if p.stream:
        body["stream_options"] = {"include_usage": True}
    return body


class Sender:
    """Sends one planned request and fills its record; never raises."""

    def __init__(self, target: Target, http: Any) -> None:
        self.target = target
        self.http = http
        self.openai: Any = None
        if target.backend == "openai":
            import openai
            self.openai = openai.AsyncOpenAI(base_url=target.url.rstrip("/") + "/v1",
                                             api_key="sits-trace", max_retries=0,
                                             timeout=target.timeout_s, http_client=http)

    async def send(self, p: Planned, text: str, rec: Record) -> None:
        start = time.perf_counter()
        rec.start_unix_ns = time.time_ns()
        try:
            if self.openai is not None:
                await self._via_openai(p, text, rec, start)
            else:
                await self._via_httpx(p, text, rec, start)
        except Exception as e:  # noqa: BLE001 - any failure is a result, recorded, not raised
            rec.status = getattr(e, "status_code", rec.status)
            rec.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        end = time.perf_counter()
        rec.latency_s = end - start
        rec.end_unix_ns = rec.start_unix_ns + round((end - start) * 1e9)

    def _first(self, rec: Record, start: float) -> None:
        rec.content_tokens += 1
        if rec.ttft_s is None:
            rec.ttft_s = time.perf_counter() - start

    def _usage(self, rec: Record, usage: Any) -> None:
        if usage is not None:
            rec.usage_prompt_tokens = int(_get(usage, "prompt_tokens"))
            rec.usage_completion_tokens = int(_get(usage, "completion_tokens"))

    async def _via_openai(self, p: Planned, text: str, rec: Record, start: float) -> None:
        body = _body(p, text, self.target.model)
        headers = {"x-request-id": rec.request_id}
        api = (self.openai.chat.completions if p.api == "chat" else self.openai.completions)
        kwargs = {k: v for k, v in body.items() if k != "model"}
        resp = await api.create(model=body["model"], extra_headers=headers, **kwargs)
        rec.status = 200
        if not p.stream:
            self._usage(rec, resp.usage)
            rec.content_tokens = len(_text_of(resp.choices[0], p.api).split())
            return
        async for chunk in resp:
            rec.chunks += 1
            if chunk.choices and _text_of(chunk.choices[0], p.api):
                self._first(rec, start)
            self._usage(rec, chunk.usage)

    async def _via_httpx(self, p: Planned, text: str, rec: Record, start: float) -> None:
        path = "/v1/chat/completions" if p.api == "chat" else "/v1/completions"
        url = self.target.url.rstrip("/") + path
        headers = {"x-request-id": rec.request_id}
        async with self.http.stream("POST", url, json=_body(p, text, self.target.model),
                                    headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:300]
                return
            if not p.stream:
                data = json.loads(await resp.aread())
                self._usage(rec, data.get("usage"))
                rec.content_tokens = len(_text_of(data["choices"][0], p.api).split())
                return
            async for line in resp.aiter_lines():
                self._sse_line(line, p, rec, start)

    def _sse_line(self, line: str, p: Planned, rec: Record, start: float) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        rec.chunks += 1
        if chunk.get("choices") and _text_of(chunk["choices"][0], p.api):
            self._first(rec, start)
        self._usage(rec, chunk.get("usage"))


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key)


def _text_of(choice: Any, api: str) -> str:
    """The content of a choice, chunk or whole, from the SDK's objects or plain JSON."""
    if api == "completions":
        return str(_get(choice, "text") or "")
    part = _get(choice, "delta") if _has(choice, "delta") else _get(choice, "message")
    return str(_get(part, "content") or "") if part is not None else ""


def _has(obj: Any, key: str) -> bool:
    return key in obj if isinstance(obj, dict) else getattr(obj, key, None) is not None


def _http_client(target: Target) -> Any:
    import httpx
    limits = httpx.Limits(max_connections=target.max_connections,
                          max_keepalive_connections=target.max_connections)
    return httpx.AsyncClient(limits=limits, timeout=target.timeout_s, verify=target.verify)


async def replay_async(planned: list[Planned], target: Target, seed: int = 0,
                       log: TextIO | None = None,
                       on_record: Callable[[Record], None] | None = None) -> list[Record]:
    """Send every planned request at its time (open loop); the records, in plan order."""
    records = [Record(p.request_id, p.api, p.stream, p.at_s, p.prompt_tokens, p.max_tokens)
               for p in planned]
    async with _http_client(target) as http:
        sender = Sender(target, http)

        async def one(p: Planned, rec: Record, lag: float) -> None:
            rec.start_lag_s = lag
            await sender.send(p, prompt_text(p, seed), rec)
            if log is not None:
                log.write(json.dumps(asdict(rec), separators=(",", ":")) + "\n")
                log.flush()
            if on_record is not None:
                on_record(rec)

        t0 = time.perf_counter()
        tasks = []
        for p, rec in zip(planned, records, strict=True):
            delay = t0 + p.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(p, rec, max(0.0, -delay))))
        await asyncio.gather(*tasks)
    return records


def replay(planned: list[Planned], target: Target, seed: int = 0,
           log_path: Path | None = None) -> list[Record]:
    """Blocking replay; the client log (JSON lines) is written as requests finish."""
    if log_path is None:
        return asyncio.run(replay_async(planned, target, seed))
    with log_path.open("a", encoding="utf-8") as log:
        return asyncio.run(replay_async(planned, target, seed, log))


# ---------------------------------------------------------------- summary


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def tpot(r: Record) -> float | None:
    """Time per output token after the first (streamed requests)."""
    if r.ttft_s is None or r.latency_s is None or r.content_tokens < 2:
        return None
    return (r.latency_s - r.ttft_s) / (r.content_tokens - 1)


def meets_slo(r: Record, ttft_s: float | None, tpot_s: float | None) -> bool:
    """OK and within the SLO. Without streaming the client sees its first token at the end,
    so its TTFT is the whole latency."""
    if not r.ok or r.latency_s is None:
        return False
    first = r.ttft_s if r.ttft_s is not None else r.latency_s
    if ttft_s is not None and first > ttft_s:
        return False
    per_token = tpot(r)
    return tpot_s is None or per_token is None or per_token <= tpot_s


def _pcts(values: Iterable[float | None]) -> dict[str, float | None]:
    v = [x for x in values if x is not None]
    return {f"p{q}": percentile(v, q) for q in (50, 95, 99)}


def summarize(records: list[Record], slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.end_unix_ns is not None]
    starts = [r.start_unix_ns for r in sent]
    ends = [r.end_unix_ns for r in sent if r.end_unix_ns is not None]
    wall = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    sched = [r.scheduled_s for r in records]
    good = sum(1 for r in records if meets_slo(r, slo_ttft_s, slo_tpot_s))
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "wall_s": wall, "offered_rps": mean_rate(sched),
        "throughput_rps": len(ok) / wall if wall else 0.0,
        "output_tokens_per_s": sum(r.content_tokens for r in ok) / wall if wall else 0.0,
        "latency_s": _pcts(r.latency_s for r in ok),
        "ttft_s": _pcts(r.ttft_s for r in ok),
        "tpot_s": _pcts(tpot(r) for r in ok),
        "start_lag_s": _pcts(r.start_lag_s for r in records),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "goodput_rps": good / wall if wall else 0.0,
        "slo_attainment": good / len(records) if records else 0.0,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def render(s: dict[str, Any]) -> str:
    lines = [(f"requests {s['requests']}  ok {s['ok']}  errors {s['errors']}  wall "
              f"{s['wall_s']:.1f}s  offered {s['offered_rps']:.2f} rps  done "
              f"{s['throughput_rps']:.2f} rps  {s['output_tokens_per_s']:.0f} tok/s")]
    for key in ("latency_s", "ttft_s", "tpot_s", "start_lag_s"):
        p = s[key]
        lines.append(f"{key[:-2]:<11} ms  p50 {_ms(p['p50'])}  p95 {_ms(p['p95'])}  "
                     f"p99 {_ms(p['p99'])}")
    slo = s["slo"]
    lines.append(f"goodput {s['goodput_rps']:.2f} rps ({s['slo_attainment']:.1%} of requests) "
                 f"at TTFT <= {_ms(slo['ttft_s'])} ms, TPOT <= {_ms(slo['tpot_s'])} ms")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--trace", default="conv", help="conv, code, or a CSV path")
    p.add_argument("--data-dir", type=Path, default=DATA)
    p.add_argument("--backend", choices=["openai", "httpx"], default="openai")
    p.add_argument("--api", choices=["chat", "completions", "mix"], default="chat")
    p.add_argument("--model", default="sits-tiny")
    p.add_argument("--stream-fraction", type=float, default=1.0)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--max-rps", type=float)
    p.add_argument("--token-scale", type=float, default=1.0)
    p.add_argument("--min-prompt-tokens", type=int, default=1)
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--min-output-tokens", type=int, default=1)
    p.add_argument("--max-output-tokens", type=int, default=1024)
    p.add_argument("--start", type=float, default=0.0, help="skip this many trace seconds")
    p.add_argument("--duration", type=float, help="replay seconds")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--rate-step-at", type=float, metavar="T")
    p.add_argument("--rate-step", type=float, default=1.0, metavar="X")
    p.add_argument("--mix-shift-at", type=float, metavar="T")
    p.add_argument("--mix-shift", type=float, default=1.0, metavar="X")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--id-prefix", help="x-request-id prefix (default: wl-<random>)")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--insecure", action="store_true", help="do not verify the TLS certificate")
    p.add_argument("--log", type=Path, help="client log, one JSON object a line (appended)")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--dry-run", action="store_true", help="print the plan's size and rate only")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p.parse_args(argv)


def shaping_from(a: argparse.Namespace) -> Shaping:
    prefix = a.id_prefix or f"wl-{uuid.uuid4().hex[:8]}"
    return Shaping(a.rate_scale, a.max_rps, a.token_scale, a.min_prompt_tokens,
                   a.max_prompt_tokens, a.min_output_tokens, a.max_output_tokens, a.start,
                   a.duration, a.max_requests, a.rate_step_at, a.rate_step, a.mix_shift_at,
                   a.mix_shift, a.stream_fraction, a.api, a.seed, prefix)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        if a.duration is None and a.max_requests is None:
            raise WorkloadError("give --duration or --max-requests (the traces run for an hour)")
        planned = plan(load_trace(trace_path(a.trace, a.data_dir)), shaping_from(a))
    except WorkloadError as e:
        print(f"workload: {e}", file=sys.stderr)
        return 2
    if a.dry_run or not planned:
        span = planned[-1].at_s if planned else 0.0
        print(f"{len(planned)} requests over {span:.1f}s, mean "
              f"{mean_rate([p.at_s for p in planned]):.2f} rps")
        return 0
    target = Target(a.url, a.backend, a.model, a.timeout, not a.insecure)
    records = replay(planned, target, a.seed, a.log)
    s = summarize(records, _s(a.slo_ttft_ms), _s(a.slo_tpot_ms))
    print(json.dumps(s) if a.json else render(s))
    return 0 if s["ok"] else 1


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)


__all__ = ["Planned", "Record", "Shaping", "Target", "TraceRow", "load_trace", "plan", "replay",
           "replay_async", "summarize"]
