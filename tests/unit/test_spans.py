"""Span assembly: identity, OTel HTTP attributes, status, routes and timing."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from sits_trace.agent.model import (
    Chunk,
    ConnInfo,
    Direction,
    Exchange,
    RequestHead,
    ResponseHead,
    Role,
)
from sits_trace.agent.tracing.http1 import HttpConnParser
from sits_trace.agent.tracing.spans import RouteTable, SpanBuilder, split_host_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "http"
OFFSET = 1_764_670_000_000_000_000  # Unix ns at monotonic 0
T0 = 5_000_000_000


def conn(role: Role = Role.SERVER, tls: bool = False) -> ConnInfo:
    return ConnInfo(conn_id=3, pid=4242, fd=11, role=role, peer_address="10.1.2.3",
                    peer_port=40404, local_address="10.0.0.1", local_port=8000,
                    comm="uvicorn", tls=tls)


def captured(name: str, role: Role = Role.SERVER) -> list[Exchange]:
    """Exchanges of a recorded capture (see tests/fixtures/http/capture.py)."""
    raw = (FIXTURES / f"{name}.trace").read_bytes()
    out: list[Exchange] = []
    parser = HttpConnParser(conn(role), out.append)
    pos = 0
    while pos < len(raw):
        nl = raw.index(b"\n", pos)
        tag, size, t = raw[pos:nl].split(b" ")
        data = raw[nl + 1 : nl + 1 + int(size)]
        pos = nl + 2 + int(size)
        to_server = tag == b">"
        d = Direction.INGRESS if to_server == (role == Role.SERVER) else Direction.EGRESS
        parser.feed(Chunk(d, T0 + int(t), T0 + int(t) + 1000, data, len(data)))
    parser.close(T0 + 10**10)
    return out


def counter_ids() -> Callable[[int], bytes]:
    """Deterministic, distinct, non-zero ids."""
    n = itertools.count(1)
    return lambda size: next(n).to_bytes(size, "big")


def builder(routes: RouteTable | None = None) -> SpanBuilder:
    return SpanBuilder(clock_offset_ns=OFFSET, id_source=counter_ids(), routes=routes)


def exchange(method: str = "GET", target: str = "/v1/models/llama?verbose=1",
             headers: list[tuple[str, str]] | None = None, status: int | None = 200,
             role: Role = Role.SERVER, error: str | None = None) -> Exchange:
    head = RequestHead(method, target, "1.1", headers if headers is not None else [("host", "api")],
                       start_ns=1_000, end_ns=2_000)
    resp = None if status is None else ResponseHead(status, "1.1", [], first_byte_ns=6_000,
                                                    end_ns=9_000, body_bytes=12)
    return Exchange(conn(role), head, resp, error)


# ---- recorded exchanges ----


def test_server_span_of_a_curl_get_to_nginx() -> None:
    (ex,) = captured("nginx_get")
    assert ex.response is not None
    span = builder().build(ex)
    assert (span.name, span.kind, span.status_code, span.parent_span_id) == ("GET", "SERVER",
                                                                             "UNSET", None)
    assert span.attributes == {
        "http.request.method": "GET",
        "url.path": "/index.html",
        "url.scheme": "http",
        "network.protocol.version": "1.1",
        "user_agent.original": "curl/7.88.1",
        "server.address": "127.0.0.1",
        "server.port": 8080,
        "client.address": "10.1.2.3",
        "client.port": 40404,
        "network.peer.address": "10.1.2.3",
        "network.peer.port": 40404,
        "process.pid": 4242,
        "process.executable.name": "uvicorn",
        "tls": False,
        "http.response.status_code": 200,
        "http.response.body.size": 615,
        "sits.ttfb_ms": pytest.approx((ex.response.first_byte_ns - ex.request.start_ns) / 1e6),
    }
    assert span.start_time_unix_nano == ex.request.start_ns + OFFSET
    assert span.end_time_unix_nano == ex.response.end_ns + OFFSET
    assert len(span.trace_id) == 32 and len(span.span_id) == 16


def test_sse_span_keeps_traceparent_and_stream_timings() -> None:
    (ex,) = captured("uvicorn_sse")
    span = builder().build(ex)
    assert span.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent_span_id == "00f067aa0ba902b7"
    a = span.attributes
    r = ex.response
    assert r is not None and r.first_body_ns is not None and r.last_body_ns is not None
    assert a["http.request.method"] == "POST" and a["url.path"] == "/v1/completions"
    assert a["http.request.body.size"] == 56
    assert a["sits.stream.chunks"] == 5
    assert a["sits.time_to_first_chunk_ms"] == pytest.approx(
        (r.first_body_ns - ex.request.start_ns) / 1e6)
    assert a["sits.time_to_last_chunk_ms"] == pytest.approx(
        (r.last_body_ns - ex.request.start_ns) / 1e6)
    assert a["sits.time_to_last_chunk_ms"] - a["sits.time_to_first_chunk_ms"] > 50
    assert "sk-test" not in repr(span.to_json())


def test_chunked_upload_trace_id_comes_from_x_request_id() -> None:
    (ex,) = captured("uvicorn_chunked_upload")
    rid = "9d7c5b1e-3f0a-4c2e-8d6b-1a2b3c4d5e6f"
    want = hashlib.sha256(b"sits-trace/x-request-id/" + rid.encode()).digest()[:16].hex()
    span = builder().build(ex)
    assert (span.trace_id, span.parent_span_id) == (want, None)
    assert span.attributes["http.request.header.x-request-id"] == rid
    assert span.attributes["http.request.body.size"] == 3000


def test_client_span_from_the_client_side_of_a_capture() -> None:
    spans = [builder().build(ex) for ex in captured("nginx_keepalive", Role.CLIENT)]
    assert [(s.kind, s.status_code, s.attributes.get("error.type")) for s in spans] == [
        ("CLIENT", "UNSET", None), ("CLIENT", "ERROR", "404"), ("CLIENT", "UNSET", None)]
    assert all("client.address" not in s.attributes for s in spans)
    assert spans[0].attributes["server.address"] == "127.0.0.1"
    assert spans[0].attributes["server.port"] == 8080


# ---- identity ----


def test_span_ids_are_fresh_and_never_zero() -> None:
    ids = iter([b"\x00" * 16, b"\x00" * 8, bytes(range(1, 17)), b"\x00" * 8, b"\x01" * 8])
    b = SpanBuilder(clock_offset_ns=0, id_source=lambda n: next(ids))
    span = b.build(exchange())
    assert span.trace_id == bytes(range(1, 17)).hex()
    assert span.span_id == "0101010101010101"


def test_same_request_id_same_trace_across_agents() -> None:
    ex = exchange(headers=[("x-request-id", "req-42")])
    one, two = builder().build(ex), SpanBuilder(clock_offset_ns=0).build(ex)
    assert one.trace_id == two.trace_id
    assert one.span_id != two.span_id
    assert one.trace_id != builder().build(exchange(headers=[("x-request-id", "req-43")])).trace_id


def test_valid_traceparent_wins_over_request_id() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = builder().build(exchange(headers=[("x-request-id", "r"), ("traceparent", tp)]))
    assert (span.trace_id, span.parent_span_id) == ("0af7651916cd43dd8448eb211c80319c",
                                                    "b7ad6b7169203331")


@pytest.mark.parametrize("tp", [
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # only version 00 handled
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero parent id
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
    "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",  # 31 digits
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
    "00-0af7651916cd43dd8448eb211c8031zz-b7ad6b7169203331-01",
    "",
])
def test_bad_traceparent_is_rejected(tp: str) -> None:
    span = builder().build(exchange(headers=[("traceparent", tp)]))
    assert span.parent_span_id is None
    assert span.trace_id == (1).to_bytes(16, "big").hex()  # the first random id


# ---- names, routes, attributes ----


def test_route_table_names_the_span() -> None:
    routes = RouteTable(["/v1/models/{id}", "/v1/models/default", "/v1/{kind}/{id}/stats"])
    b = builder(routes)
    named = b.build(exchange(target="/v1/models/llama?verbose=1"))
    assert named.name == "GET /v1/models/{id}"
    assert named.attributes["http.route"] == "/v1/models/{id}"
    assert named.attributes["url.query"] == "verbose=1"
    assert b.build(exchange(target="/v1/models/default/")).attributes["http.route"] == (
        "/v1/models/default")
    assert routes.match("/v1/jobs/7/stats") == "/v1/{kind}/{id}/stats"
    assert routes.match("/v1/models") is None
    assert routes.match("/v1/models//") is None
    unrouted = b.build(exchange(target="/health"))
    assert unrouted.name == "GET" and "http.route" not in unrouted.attributes
    assert "http.route" not in builder().build(exchange()).attributes


def test_bad_route_pattern_is_rejected() -> None:
    with pytest.raises(ValueError, match="must start with '/'"):
        RouteTable(["v1/models"])


def test_unknown_method_is_other() -> None:
    span = builder().build(exchange(method="PROPFIND"))
    assert span.name == "HTTP"
    assert span.attributes["http.request.method"] == "_OTHER"
    assert span.attributes["http.request.method_original"] == "PROPFIND"


@pytest.mark.parametrize(("host", "want"), [
    ("api.example.com:8443", ("api.example.com", 8443)),
    ("api.example.com", ("api.example.com", 8000)),  # no port: the connection's
    ("[2001:db8::1]:9000", ("2001:db8::1", 9000)),
    ("api:notaport", ("api", 8000)),
])
def test_server_address_from_host(host: str, want: tuple[str, int]) -> None:
    b = builder()
    a = b.build(exchange(headers=[("host", host)])).attributes
    assert (a["server.address"], a["server.port"]) == want
    again = b.build(exchange(headers=[("host", host)])).attributes  # the parsed value, kept
    assert (again["server.address"], again["server.port"]) == want
    if want[1] == 8000:  # no port in the header: the connection's, not the first span's
        client = b.build(exchange(headers=[("host", host)], role=Role.CLIENT)).attributes
        assert client["server.port"] == 40404


def test_a_host_header_with_userinfo_is_not_kept() -> None:
    from sits_trace.agent.tracing import spans

    a = builder().build(exchange(headers=[("host", "user:pw@api.example.com:81")])).attributes
    assert (a["server.address"], a["server.port"]) == ("api.example.com", 81)
    assert not any("pw" in k for k in spans._HOSTS)


def test_server_address_falls_back_to_the_connection() -> None:
    server = builder().build(exchange(headers=[])).attributes
    assert (server["server.address"], server["server.port"]) == ("10.0.0.1", 8000)
    client = builder().build(exchange(headers=[], role=Role.CLIENT)).attributes
    assert (client["server.address"], client["server.port"]) == ("10.1.2.3", 40404)


def test_split_host_port() -> None:
    assert split_host_port("[::1]") == ("::1", None)
    assert split_host_port("::1") == ("::1", None)
    assert split_host_port("h:0") == ("h", None)


def test_tls_and_absolute_target() -> None:
    ex = exchange(target="http://proxy.test/a/b?q=1")
    ex.conn.tls = True
    a = builder().build(ex).attributes
    assert (a["url.path"], a["url.query"], a["url.scheme"], a["tls"]) == ("/a/b", "q=1",
                                                                          "https", True)


# ---- status and timing ----


@pytest.mark.parametrize(("role", "status", "error", "want"), [
    (Role.SERVER, 200, None, ("UNSET", None)),
    (Role.SERVER, 404, None, ("UNSET", None)),
    (Role.SERVER, 503, None, ("ERROR", "503")),
    (Role.CLIENT, 404, None, ("ERROR", "404")),
    (Role.CLIENT, 302, None, ("UNSET", None)),
    (Role.SERVER, None, "connection_closed", ("ERROR", "connection_closed")),
    (Role.SERVER, 200, "response_incomplete", ("ERROR", "response_incomplete")),
    (Role.SERVER, 500, "response_incomplete", ("ERROR", "response_incomplete")),
])
def test_status_and_error_type(role: Role, status: int | None, error: str | None,
                               want: tuple[str, str | None]) -> None:
    span = builder().build(exchange(status=status, role=role, error=error))
    assert (span.status_code, span.attributes.get("error.type")) == want


def test_times_use_the_clock_offset() -> None:
    span = builder().build(exchange())
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (OFFSET + 1_000, OFFSET + 9_000)
    assert span.attributes["sits.ttfb_ms"] == pytest.approx(0.005)
    assert "sits.stream.chunks" not in span.attributes
    missing = builder().build(exchange(status=None, error="connection_closed"))
    assert missing.end_time_unix_nano == OFFSET + 2_000
    assert "http.response.status_code" not in missing.attributes
    assert "sits.ttfb_ms" not in missing.attributes


def test_json_shape() -> None:
    doc = builder().build(exchange()).to_json()
    assert doc["kind"] == "SERVER" and doc["status"] == {"code": "UNSET"}
    assert isinstance(doc["attributes"], dict)
    assert all(isinstance(v, str | bool | int | float) for v in doc["attributes"].values())
