"""Secrets never leave the node: every output is grepped for secrets placed in headers,
query strings, bodies and URL userinfo (issue 10).

Outputs checked: `trace --json` (Span.to_json), the JSONL exporter, the OTLP protobuf
request, the Prometheus text exposition, the agent's log records (DEBUG). The recording
(`--record`) holds raw bytes by design: it must be created 0600.
"""

from __future__ import annotations

import io
import logging
import os
import stat
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from sits_trace.agent.capture.loader import Recorder
from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role, Span
from sits_trace.agent.tracing.http1 import HttpConnParser
from sits_trace.agent.tracing.redact import REDACTED_VALUE, QueryRedactor, strip_userinfo
from sits_trace.agent.tracing.spans import SpanBuilder
from sits_trace.exporters._otlp_traces import encode
from sits_trace.exporters.jsonl import JsonlExporter
from sits_trace.exporters.prometheus import PrometheusExporter

SECRETS = {
    "authorization": "Bearer s3cr3t-bearer-AAAA",
    "cookie": "session=s3cr3t-cookie-BBBB",
    "proxy": "Basic s3cr3t-proxy-CCCC",
    "api_key": "s3cr3t-apikey-DDDD",
    "token": "s3cr3t-token-EEEE",
    "password": "s3cr3t-pass-FFFF",
    "sig": "s3cr3t-sig-GGGG",
    "encoded": "s3cr3t-encoded-HHHH",
    "userinfo": "s3cr3t-userinfo-IIII",
    "host_userinfo": "s3cr3t-hostinfo-JJJJ",
    "body": "s3cr3t-body-KKKK",
    "resp_body": "s3cr3t-respbody-LLLL",
    "set_cookie": "s3cr3t-setcookie-MMMM",
}


def _requests() -> list[bytes]:
    s = SECRETS
    body = f'{{"password":"{s["body"]}"}}'.encode()
    return [
        (f"POST /v1/chat?model=m&api_key={s['api_key']}&TOKEN={s['token']}&password={s['password']}"
         f"&sig={s['sig']}&access%5Ftoken={s['encoded']} HTTP/1.1\r\n"
         f"Host: user:{s['host_userinfo']}@api.example:8080\r\n"
         f"Authorization: {s['authorization']}\r\nCookie: {s['cookie']}\r\n"
         f"Proxy-Authorization: {s['proxy']}\r\nUser-Agent: curl/8\r\n"
         f"Content-Length: {len(body)}\r\n\r\n").encode() + body,
        (f"GET http://admin:{s['userinfo']}@proxy.example/p?key={s['api_key']} HTTP/1.1\r\n"
         "Host: proxy.example\r\n\r\n").encode(),
    ]


def _response() -> bytes:
    body = f"secret={SECRETS['resp_body']}".encode()
    return (f"HTTP/1.1 200 OK\r\nSet-Cookie: a={SECRETS['set_cookie']}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _spans() -> list[Span]:
    info = ConnInfo(conn_id=1, pid=42, fd=5, role=Role.SERVER, peer_address="10.0.0.2",
                    peer_port=5555, local_address="10.0.0.1", local_port=8080, comm="srv")
    exchanges: list[Exchange] = []
    parser = HttpConnParser(info, exchanges.append)
    t = 1_000_000
    for raw in _requests():
        parser.feed(Chunk(Direction.INGRESS, t, t + 10, raw, len(raw)))
        out = _response()
        parser.feed(Chunk(Direction.EGRESS, t + 100, t + 110, out, len(out)))
        t += 1000
    assert len(exchanges) == 2
    builder = SpanBuilder(clock_offset_ns=0, id_source=lambda n: b"\x01" * n)
    return [builder.build(ex) for ex in exchanges]


def _assert_clean(text: str, where: str) -> None:
    leaked = [k for k, v in SECRETS.items() if v in text]
    assert not leaked, f"{where} leaks {leaked}"


def test_no_output_carries_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    spans = _spans()
    # trace --json
    _assert_clean("".join(s.json_line() for s in spans), "trace --json")
    # JSONL exporter
    buf = io.StringIO()
    jsonl = JsonlExporter(stream=buf, batch_delay_s=0.01)
    jsonl.export(spans)
    jsonl.shutdown(5.0)
    assert buf.getvalue().count("\n") == 2
    _assert_clean(buf.getvalue(), "JSONL")
    # OTLP: the bytes that go on the wire
    raw = encode(spans, lambda s: {"service.name": "svc"})
    assert b"REDACTED" in raw
    _assert_clean(raw.decode("latin-1"), "OTLP")
    # Prometheus text
    prom = PrometheusExporter(0)
    prom.export(spans)
    _assert_clean(generate_latest(prom.registry).decode(), "Prometheus")
    # logs
    _assert_clean("\n".join(r.getMessage() for r in caplog.records), "logs")


def test_query_keys_keep_their_names_and_other_values() -> None:
    a = _spans()[0].attributes
    q = str(a["url.query"])
    assert q.startswith("model=m&api_key=REDACTED&TOKEN=REDACTED&password=REDACTED")
    assert "access%5Ftoken=REDACTED" in q
    assert a["server.address"] == "api.example" and a["server.port"] == 8080
    second = _spans()[1].attributes
    assert second["url.query"] == "key=REDACTED" and second["url.path"] == "/p"


@pytest.mark.parametrize(("query", "keys", "expected"), [
    ("a=1&b=2", None, "a=1&b=2"),
    ("code=xyz&state=1", None, f"code={REDACTED_VALUE}&state=1"),
    ("Api_Key=1&api_key", None, f"Api_Key={REDACTED_VALUE}&api_key"),  # a bare key has no value
    ("mine=1&token=2", ["mine"], f"mine={REDACTED_VALUE}&token=2"),  # the configured list only
    ("token=2", [], "token=2"),  # [] turns redaction off
    ("x=a=b&secret=a=b", None, f"x=a=b&secret={REDACTED_VALUE}"),
])
def test_query_redactor(query: str, keys: list[str] | None, expected: str) -> None:
    r = QueryRedactor() if keys is None else QueryRedactor(keys)
    assert r.query(query) == expected


def test_strip_userinfo() -> None:
    assert strip_userinfo("u:p@h:1") == "h:1"
    assert strip_userinfo("a@b@h") == "h"
    assert strip_userinfo("h:1") == "h:1"


def test_recording_is_private_even_over_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "rec.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    rec = Recorder(path)
    rec.write([b"GET /?token=x HTTP/1.1\r\n\r\n"])
    rec.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    fresh = tmp_path / "new.bin"
    old = os.umask(0)
    try:
        Recorder(fresh).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
