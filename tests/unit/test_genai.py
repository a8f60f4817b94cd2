"""GenAI attributes and OpenAI-style streams, fed through the real parser and span builder.

The byte streams are what an OpenAI-compatible server writes (one SSE event per write, chunked
encoding) and what the openai SDK does as a client: it stops reading after `data: [DONE]` and
closes without reading the chunked terminator.
"""

from __future__ import annotations

import json

import pytest
from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role
from sits_trace.agent.tracing.http1 import HttpConnParser, is_preamble
from sits_trace.agent.tracing.spans import SpanBuilder

MS = 1_000_000
PROMPT = "tell me a secret about the moon " * 300  # longer than the captured head


def _conn(role: Role) -> ConnInfo:
    return ConnInfo(conn_id=1, pid=7, fd=9, role=role, peer_address="127.0.0.1", peer_port=5555,
                    local_address="127.0.0.1", local_port=8000, comm="python3")


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _request(stream: bool) -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}],
                       "model": "llama-3-8b", "max_tokens": 40, "stream": stream,
                       "stream_options": {"include_usage": True}}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: r1\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def _events(n: int) -> list[bytes]:
    ev = [b"data: " + json.dumps({"model": "llama-3-8b", "choices": [{"delta": {
        "content": f"tok{i}"}}]}).encode() + b"\n\n" for i in range(n)]
    ev.append(b"data: " + json.dumps({"model": "llama-3-8b", "choices": [], "usage": {
        "prompt_tokens": 2101, "completion_tokens": n, "total_tokens": 2101 + n}}).encode()
        + b"\n\n")
    ev.append(b"data: [DONE]\n\n")
    return ev


def _run(role: Role, n: int, read_terminator: bool, gap_ms: int = 20) -> list[Exchange]:
    """A streamed exchange as seen by `role`; each event its own write `gap_ms` apart."""
    out: list[Exchange] = []
    p = HttpConnParser(_conn(role), out.append)
    req_dir = Direction.INGRESS if role is Role.SERVER else Direction.EGRESS
    resp_dir = Direction.EGRESS if role is Role.SERVER else Direction.INGRESS
    t = 1_000 * MS
    req = _request(True)
    for i in range(0, len(req), 4096):  # reads of at most the capture size
        p.feed(Chunk(req_dir, t, t + 1000, req[i:i + 4096], len(req[i:i + 4096])))
    t += 30 * MS
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    p.feed(Chunk(resp_dir, t, t + 1000, head, len(head)))
    for ev in _events(n):
        t += gap_ms * MS
        data = _chunked(ev)
        p.feed(Chunk(resp_dir, t, t + 1000, data, len(data)))
    if read_terminator:
        p.feed(Chunk(resp_dir, t + MS, t + MS + 1000, b"0\r\n\r\n", 5))
    p.close(t + 5 * MS)
    return out


def _span(ex: Exchange) -> dict[str, object]:
    return SpanBuilder(clock_offset_ns=0).build(ex).attributes


def test_server_span_has_genai_attributes_and_token_timings() -> None:
    [ex] = _run(Role.SERVER, n=30, read_terminator=True)
    a = _span(ex)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "llama-3-8b"  # found past the long prompt
    assert a["gen_ai.request.max_tokens"] == 40
    assert a["gen_ai.usage.input_tokens"] == 2101
    assert a["gen_ai.usage.output_tokens"] == 30
    assert a["sits.gen_ai.stream.events"] == 31  # 30 tokens + the usage event, not [DONE]
    assert a["sits.stream.chunks"] == 32
    assert abs(float(a["sits.gen_ai.time_per_output_token_ms"]) - 20.0) < 0.01  # type: ignore[arg-type]
    assert abs(float(a["sits.gen_ai.max_token_gap_ms"]) - 20.0) < 0.01  # type: ignore[arg-type]
    assert "error.type" not in a


def test_no_prompt_or_completion_text_in_span() -> None:
    [ex] = _run(Role.SERVER, n=5, read_terminator=True)
    blob = json.dumps(_span(ex))
    assert "moon" not in blob and "tok1" not in blob


def test_sdk_client_closing_after_done_is_not_an_error() -> None:
    [ex] = _run(Role.CLIENT, n=12, read_terminator=False)
    a = _span(ex)
    assert "error.type" not in a, a
    assert a["gen_ai.usage.output_tokens"] == 12


def test_stream_cut_before_done_is_still_an_error() -> None:
    out: list[Exchange] = []
    p = HttpConnParser(_conn(Role.CLIENT), out.append)
    req = _request(True)
    p.feed(Chunk(Direction.EGRESS, MS, MS + 1, req[:4096], len(req)))
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    p.feed(Chunk(Direction.INGRESS, 2 * MS, 2 * MS + 1, head, len(head)))
    data = _chunked(_events(3)[0])
    p.feed(Chunk(Direction.INGRESS, 3 * MS, 3 * MS + 1, data, len(data)))
    p.close(4 * MS)
    assert _span(out[0])["error.type"] == "response_incomplete"


def test_prometheus_histograms_of_ttft_and_tpot() -> None:
    from prometheus_client import generate_latest
    from sits_trace.exporters.prometheus import PrometheusExporter

    [ex] = _run(Role.SERVER, n=30, read_terminator=True)
    span = SpanBuilder(clock_offset_ns=0).build(ex)
    exp = PrometheusExporter(service_name="llm")
    exp.export([span, span])
    text = generate_latest(exp.registry).decode()
    ttft = ('gen_ai_server_time_to_first_token_seconds_count{gen_ai_operation_name="chat",'
            'gen_ai_request_model="llama-3-8b",service_name="llm"} 2.0')
    assert ttft in text
    # 20 ms between tokens falls in the 25 ms bucket, not the 10 ms one
    assert ('gen_ai_server_time_per_output_token_seconds_bucket{gen_ai_operation_name="chat",'
            'gen_ai_request_model="llama-3-8b",le="0.025",service_name="llm"} 2.0') in text
    assert ('gen_ai_server_time_per_output_token_seconds_bucket{gen_ai_operation_name="chat",'
            'gen_ai_request_model="llama-3-8b",le="0.01",service_name="llm"} 0.0') in text


@pytest.mark.parametrize(("event", "preamble"), [
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
     b'"logprobs":null,"finish_reason":null}]}\n\n', True),  # vLLM, the reference server
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n', True),
    (b'data: {"choices":[{"delta":{}}]}\n\n', True),
    (b'data: {"choices":[{"index":0,"delta":{"content":" the"}}]}\n\n', False),
    (b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n', False),
    (b'data: {"choices":[{"index":0,"text":" the"}]}\n\n', False),  # completions
    (b'data: {"choices":[{"delta":{"content":""}}]}\n\n', False),  # an empty token, no role
    (b"data: [DONE]\n\n", False),
    (b"", False),
])
def test_role_only_first_event_is_a_preamble(event: bytes, preamble: bool) -> None:
    assert is_preamble(event) is preamble
