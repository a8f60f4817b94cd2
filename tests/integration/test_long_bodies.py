"""Long request bodies (10 KB and 300 KB prompts) to the reference server, plain and over TLS
(uvloop's memory BIOs). A read or write longer than the 4 KiB captured sends its last bytes as a
second record; past its first 64 KiB a body's reads send only their last bytes (bpf/events.h
SITS_BODY_HEAD). Each span keeps the body's exact size and the GenAI fields the prompt
carries at its end (the openai SDK writes "max_tokens" after the messages; "model" is put
there too, as other clients do), the request after
them on the same connection is traced, and nothing is lost in the ring."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Nginx, Tracer, curl, free_port, interrupt, make_cert, wait_port

pytestmark = pytest.mark.bpf
for _m in ("fastapi", "uvicorn", "uvloop"):
    pytest.importorskip(_m)

SERVER = Path(__file__).resolve().parents[2] / "examples" / "inference_server.py"


def _reference_server(port: int, tmp_path: Path, tls: bool = False) -> subprocess.Popen[bytes]:
    """examples/inference_server.py on uvloop, a tiny numpy model, no agent to ask; with
    `tls`, HTTPS on the test's own certificate."""
    extra: list[str] = []
    if tls:
        key, crt = make_cert(tmp_path)
        extra = ["--tls-cert", str(crt), "--tls-key", str(key)]
    return subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port), "--loop", "uvloop", *extra,
         "--backend", "numpy", "--hidden", "64", "--vocab", "1024",
         "--control-socket", str(tmp_path / "no-agent.sock")], stderr=subprocess.PIPE)


def _connect(port: int, tls: bool, timeout: float = 60) -> http.client.HTTPConnection:
    """A keep-alive connection to 127.0.0.1:port, over TLS (the test's own cert) or not."""
    if tls:
        return http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout,
                                           context=ssl._create_unverified_context())
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_long_prompt_keeps_its_size_and_trailing_fields(tmp_path: Path, tls: bool) -> None:
    port = free_port()
    tracer = Tracer("--pid", str(os.getpid()))
    server = _reference_server(port, tmp_path, tls=tls)
    sent: list[tuple[str, int]] = []
    try:
        wait_port(port, timeout=60)
        time.sleep(1.5)  # the exec rescans find libssl
        conn = _connect(port, tls, timeout=30)
        for i, n in enumerate((10_000, 300_000, 300_000)):
            # the fields GenAI attributes read come last (max_tokens as the openai SDK writes it),
            # after 10 KB of prompt (one read longer than the 4 KiB captured: its last bytes
            # go out as a second record) or 300 KB (most reads past the first 64 KiB)
            body = json.dumps({"messages": [{"role": "user", "content": "w" * n}],
                               "model": f"tail-model-{i}", "max_tokens": 3 + i}).encode()
            rid = f"long-{tls}-{i}-{time.time_ns()}"
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json", "x-request-id": rid})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()[:200]
            resp.read()
            sent.append((rid, len(body)))
        after = f"long-after-{tls}-{time.time_ns()}"
        conn.request("GET", "/v1/models", headers={"x-request-id": after})
        assert conn.getresponse().read()
        conn.close()
        for i, (rid, size) in enumerate(sent):
            spans = tracer.by_request_id(rid, kind="SERVER")
            assert len(spans) == 1, (rid, spans)
            a = spans[0]["attributes"]
            assert a["http.request.body.size"] == size, a
            assert a.get("gen_ai.request.model") == f"tail-model-{i}", a
            assert a.get("gen_ai.request.max_tokens") == 3 + i, a
            assert a.get("error.type") is None, a
        assert len(tracer.by_request_id(after, kind="SERVER")) == 1
    finally:
        interrupt(server)
        err = tracer.stop()
    assert any("lost_in_kernel=0 " in x for x in err.splitlines()), err[-800:]


@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs the openai SDK")
def test_the_openai_sdk_max_tokens_after_a_long_prompt(tmp_path: Path) -> None:
    """The openai SDK writes "model" before the messages and "max_tokens" after them: with a
    prompt longer than the 4 KiB captured, max_tokens is in the read's last bytes only (it
    was missing from the span before they were sent)."""
    import openai

    port = free_port()
    tracer = Tracer("--pid", str(os.getpid()))
    server = _reference_server(port, tmp_path)
    try:
        wait_port(port, timeout=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for n in (10_000, 300_000):
            rid = f"sdk-{n}-{time.time_ns()}"
            client.chat.completions.create(
                model="sdk-model", messages=[{"role": "user", "content": "w" * n}],
                max_tokens=4, extra_headers={"x-request-id": rid})
            spans = tracer.by_request_id(rid, kind="SERVER")
            assert len(spans) == 1, (rid, spans)
            a = spans[0]["attributes"]
            assert a.get("gen_ai.request.model") == "sdk-model", a
            assert a.get("gen_ai.request.max_tokens") == 4, a
            assert a["http.request.body.size"] > n, a
    finally:
        interrupt(server)
        tracer.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_long_response_keeps_its_trailing_usage(tmp_path: Path, tls: bool) -> None:
    """A non-streamed completion whose JSON is longer than the 4 KiB captured: "usage" comes
    last in it (after the choices), so the server's write of the body sends its last bytes as
    a second record (850 tokens: a 4.4 KB body, the 0.3 KB after the capture); the SERVER
    span has the output tokens and the body's exact size."""
    port = free_port()
    tracer = Tracer("--pid", str(os.getpid()))
    server = _reference_server(port, tmp_path, tls=tls)
    try:
        wait_port(port, timeout=60)
        time.sleep(1.5)  # the exec rescans find libssl
        conn = _connect(port, tls)
        for tokens in (850, 2000, 4000):
            rid = f"long-out-{tls}-{tokens}-{time.time_ns()}"
            body = json.dumps({"messages": [{"role": "user", "content": "hello"}],
                               "model": "m", "max_tokens": tokens}).encode()
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json", "x-request-id": rid})
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == 200, data[:200]
            out = json.loads(data)
            assert out["usage"]["completion_tokens"] == tokens
            assert len(data) > (8192 if tokens > 1000 else 4096), len(data)
            spans = tracer.by_request_id(rid, kind="SERVER")
            assert len(spans) == 1, (rid, spans)
            a = spans[0]["attributes"]
            assert a.get("gen_ai.usage.output_tokens") == tokens, a
            assert a.get("gen_ai.usage.input_tokens") == out["usage"]["prompt_tokens"], a
            assert a["http.response.body.size"] == len(data), a
        conn.close()
    finally:
        interrupt(server)
        err = tracer.stop()
    assert any("lost_in_kernel=0 " in x for x in err.splitlines()), err[-800:]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_long_response_written_with_writev_keeps_its_trailing_usage(tmp_path: Path,
                                                                       tls: bool) -> None:
    """node corks a response's head and body into one writev: the body's last bytes are in
    the last iovec entry, sent as the second record; over TLS node's SSL_write."""
    from .stacks import NODE_APP

    port = free_port()
    (tmp_path / "app.js").write_text(NODE_APP)
    log = tmp_path / "server.log"
    tls_args = [str(p) for p in make_cert(tmp_path)] if tls else []
    tracer = Tracer("--pid", str(os.getpid()))
    server = subprocess.Popen(
        [shutil.which("node") or "node", "app.js", str(port), str(log), *tls_args],
        cwd=tmp_path, env={"PATH": os.environ["PATH"], "SITS_TEST_GAP": "0.0001"},
        stderr=subprocess.PIPE)
    try:
        wait_port(port, timeout=30)
        time.sleep(1.5)  # the exec rescans find libssl
        conn = _connect(port, tls)
        for tokens in (2000, 4000):
            rid = f"writev-out-{tls}-{tokens}-{time.time_ns()}"
            body = json.dumps({"messages": [{"role": "user", "content": "two words"}],
                               "model": "m", "max_tokens": tokens}).encode()
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json", "x-request-id": rid})
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == 200, data[:200]
            assert json.loads(data)["usage"]["completion_tokens"] == tokens
            assert len(data) > 8192, len(data)
            spans = tracer.by_request_id(rid, kind="SERVER")
            assert len(spans) == 1, (rid, spans)
            a = spans[0]["attributes"]
            assert a.get("gen_ai.usage.output_tokens") == tokens, a
            assert a.get("gen_ai.usage.input_tokens") == 2, a
            assert a["http.response.body.size"] == len(data), a
        conn.close()
    finally:
        interrupt(server)
        err = tracer.stop()
    assert any("lost_in_kernel=0 " in x for x in err.splitlines()), err[-800:]


def _embeddings_json(size: int) -> bytes:
    """An OpenAI embeddings response of exactly `size` bytes ("usage" last, as the API
    writes it; the padding is JSON whitespace before it)."""
    rows = [{"object": "embedding", "index": i,
             "embedding": [round((i * 64 + j) * 0.000123 - 0.5, 9) for j in range(64)]}
            for i in range(size // 1500)]
    head = json.dumps({"object": "list", "data": rows})[:-1].encode()
    end = b', "model": "emb-model", "usage": {"prompt_tokens": 731, "total_tokens": 731}}'
    assert len(head) + len(end) <= size
    return head + b" " * (size - len(head) - len(end)) + end


@pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx")
def test_a_long_response_written_in_pieces_keeps_its_trailing_usage(tmp_path: Path) -> None:
    """nginx sends a 300 KB embeddings response from a file (sendfile off) 32 KiB a writev,
    over TLS 16 KiB an SSL_write. Past the response's first 64 KiB a write longer than the
    capture sends its last bytes, not its first (bpf/events.h): the last write, which holds
    "usage", keeps it. The size leaves a last write of ~12 KB either way (a write of 4.5 KB
    or less is captured whole)."""
    tracer = Tracer()
    nginx = Nginx(tmp_path)
    try:
        body = _embeddings_json(9 * 32768 + 12000)
        (tmp_path / "www" / "v1").mkdir()
        (tmp_path / "www" / "v1" / "embeddings").write_bytes(body)
        for scheme, port in (("https", nginx.https_port), ("http", nginx.http_port)):
            rid = f"emb-{scheme}-{time.time_ns()}"
            r = curl(f"{scheme}://127.0.0.1:{port}/v1/embeddings", "-o", "/dev/null",
                     "-w", "%{http_code} %{size_download}", rid=rid)
            assert r.stdout == f"200 {len(body)}", r
            spans = tracer.by_request_id(rid, kind="SERVER")
            assert len(spans) == 1, (rid, spans)
            a = spans[0]["attributes"]
            assert a["http.response.body.size"] == len(body), a
            assert a.get("gen_ai.usage.input_tokens") == 731, (scheme, a)
            assert a.get("error.type") is None, a
    finally:
        nginx.stop()
        err = tracer.stop()
    assert any("lost_in_kernel=0 " in x for x in err.splitlines()), err[-800:]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_slow_upload_is_folded_and_keeps_its_size_and_trailing_fields(tmp_path: Path,
                                                                        tls: bool) -> None:
    """A 1 MB prompt sent in 64 KiB pieces over ~2.5 s: past its first 64 KiB the reads
    (`read`, or over TLS `SSL_read`) are folded in the kernel (bpf/fold.h body_folds) and
    sent once a second and when the response begins; the span has the body's exact size and
    the fields after the prompt, and the server's reads came as a few records, not one per
    read."""
    port = free_port()
    rec = tmp_path / "records.bin"
    tracer = Tracer("--pid", str(os.getpid()), "--record", str(rec))
    server = _reference_server(port, tmp_path, tls=tls)
    try:
        wait_port(port, timeout=60)
        time.sleep(1.5 if tls else 0)  # the exec rescans find libssl
        body = json.dumps({"messages": [{"role": "user", "content": "w" * 1_000_000}],
                           "model": "slow-model", "max_tokens": 7}).encode()
        pieces = [body[i:i + 65536] for i in range(0, len(body), 65536)]

        def paced() -> Iterator[bytes]:
            for p in pieces:
                yield p
                time.sleep(0.16)

        rid = f"slow-upload-{time.time_ns()}"
        conn = _connect(port, tls)
        conn.request("POST", "/v1/chat/completions", body=paced(),
                     headers={"content-type": "application/json", "x-request-id": rid,
                              "content-length": str(len(body))})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:200]
        resp.read()
        conn.close()
        spans = tracer.by_request_id(rid, kind="SERVER")
        assert len(spans) == 1, (rid, spans)
        a = spans[0]["attributes"]
        assert a["http.request.body.size"] == len(body), a
        assert a.get("gen_ai.request.model") == "slow-model", a
        assert a.get("gen_ai.request.max_tokens") == 7, a
        assert a.get("error.type") is None, a
    finally:
        interrupt(server)
        err = tracer.stop()
    assert any("lost_in_kernel=0 " in x for x in err.splitlines()), err[-800:]
    # the server's reads of the request, as the ring carried them: the head's (the first
    # 64 KiB: a record and its split tail each), then a fold a second and one when the
    # response began. Before the fold: a record per read past the head (17 in all here;
    # over TLS one per SSL_read, 16 KiB or less: 60 or more)
    from sits_trace.agent.capture.events import DataEvent, DecodeError, decode
    from sits_trace.agent.capture.loader import RecordedSource
    from sits_trace.agent.capture.wire import Source
    from sits_trace.agent.model import Direction, Role

    src, reads = RecordedSource(rec), []
    while not src.exhausted:
        for raw in src.read(0):
            try:
                e = decode(raw)
            except DecodeError:
                continue  # TCP and scheduler records: their own decoders
            if (isinstance(e, DataEvent) and e.pid == server.pid and e.role == Role.SERVER
                    and e.direction == Direction.INGRESS
                    and e.source == (Source.TLS if tls else Source.SYSCALL)):  # not the handshake
                reads.append(e)
    assert sum(e.length for e in reads) == len(body) + reads[0].payload.index(b"\r\n\r\n") + 4
    folds = [e for e in reads if e.tail]
    head = [e for e in reads if not e.tail]
    assert 2 <= len(folds) <= 4, [(e.length, e.tail) for e in reads]
    assert sum(e.length for e in head) <= 65536 + 2 * 16384, [(e.length, e.tail) for e in reads]
