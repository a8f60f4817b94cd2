"""OpenTelemetry GenAI attributes of a model-serving exchange, read from the bytes on the node.

OpenAI-compatible servers (vLLM, SGLang, TGI's /v1, llama.cpp) and Ollama's API say the model,
the token budget and, in the response (the last streamed event with
`stream_options.include_usage`, or the JSON body), how many tokens went in and out. The
parser keeps a bounded head and tail of such bodies (agent/tracing/http1.py, TAP_BYTES); here a
few fields are picked out of them with anchored patterns. No prompt or completion text is kept:
only the model name, numbers and timings leave this module.

Timings come from the writes themselves: time to first token is the first body write after the
request began that carries output (an OpenAI chat stream's role-only first event, sent before
any token, is skipped: agent/tracing/http1.py `is_preamble`), time per output token the mean
gap between body writes after the first (each streamed event is its own write), and the
largest such gap.
"""

from __future__ import annotations

import re

from sits_trace.agent.model import AttrValue, RequestHead, ResponseHead

_NS_PER_MS = 1_000_000
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,200})"')
_MAX_TOKENS = re.compile(
    rb'"(?:max_tokens|max_completion_tokens|max_new_tokens|num_predict|max_output_tokens)"'
    rb"\s*:\s*(\d{1,9})")
_INPUT = re.compile(rb'"(?:prompt_tokens|input_tokens|prompt_eval_count)"\s*:\s*(\d{1,12})')
_OUTPUT = re.compile(
    rb'"(?:completion_tokens|output_tokens|eval_count|generated_tokens)"\s*:\s*(\d{1,12})')
_OPERATIONS = (("/chat/completions", "chat"), ("/api/chat", "chat"), ("/embeddings", "embeddings"),
               ("/completions", "text_completion"), ("/responses", "chat"),
               ("/generate_stream", "text_completion"), ("/generate", "text_completion"))


def operation(path: str) -> str | None:
    """gen_ai.operation.name for a model-serving path, else None."""
    for suffix, name in _OPERATIONS:
        if path.endswith(suffix):
            return name
    return None


def _last_int(pattern: re.Pattern[bytes], *blobs: bytes) -> int | None:
    for blob in reversed(blobs):  # the tail (the final usage event) wins over the head
        found = pattern.findall(blob)
        if found:
            return int(found[-1])
    return None


def _first_str(pattern: re.Pattern[bytes], *blobs: bytes) -> str | None:
    for blob in blobs:
        m = pattern.search(blob)
        if m:
            return m.group(1).decode("utf-8", "replace")
    return None


def genai_attributes(path: str, req: RequestHead, resp: ResponseHead | None
                     ) -> dict[str, AttrValue]:
    op = operation(path)
    if op is None:
        return {}
    attrs: dict[str, AttrValue] = {"gen_ai.operation.name": op}
    model = _first_str(_MODEL, req.body_head, req.body_tail)
    if model:
        attrs["gen_ai.request.model"] = model
    max_tokens = _last_int(_MAX_TOKENS, req.body_head, req.body_tail)
    if max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = max_tokens
    if resp is None:
        return attrs
    rmodel = _first_str(_MODEL, resp.body_tail)
    if rmodel:
        attrs["gen_ai.response.model"] = rmodel
    n_in = _last_int(_INPUT, resp.body_tail)
    n_out = _last_int(_OUTPUT, resp.body_tail)
    if n_in is not None:
        attrs["gen_ai.usage.input_tokens"] = n_in
    if n_out is not None:
        attrs["gen_ai.usage.output_tokens"] = n_out
    attrs.update(_stream_timings(req, resp))
    return attrs


def _stream_timings(req: RequestHead, resp: ResponseHead) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {}
    if resp.sse:
        out["sits.gen_ai.stream.events"] = resp.sse_events - (1 if resp.sse_done else 0)
    if resp.first_body_ns is None or not resp.streamed:
        return out
    first = resp.first_token_ns if resp.first_token_ns is not None else resp.first_body_ns
    out["sits.gen_ai.time_to_first_token_ms"] = (first - req.start_ns) / _NS_PER_MS
    if resp.body_chunks > 1 and resp.last_body_ns is not None:
        span = resp.last_body_ns - resp.first_body_ns
        out["sits.gen_ai.time_per_output_token_ms"] = span / (resp.body_chunks - 1) / _NS_PER_MS
        out["sits.gen_ai.max_token_gap_ms"] = resp.max_gap_ns / _NS_PER_MS
    return out
