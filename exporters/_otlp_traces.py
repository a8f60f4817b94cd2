"""OTLP traces without the SDK's span objects: a batch of our spans straight into one
``ExportTraceServiceRequest`` (opentelemetry-proto's messages), sent over HTTP/protobuf (one
kept-alive ``http.client`` connection) or gRPC (grpcio, ``TraceService/Export``).

Why not the SDK's span exporter: it takes ``ReadableSpan`` objects, so every span was built
twice (ours, then the SDK's with its SpanContext, Status, Resource and scope objects) before
the SDK's encoder walked them again; that path was the largest stage of the agent's CPU per
span (docs/performance.md, `bench/span_cost.py`). The messages and the wire format are the
same; the SDK still exports the metrics.

What a collector gets, field by field as the SDK's encoder wrote it: trace, span and parent
ids; name; kind; start and end; attributes (process.* move to the resource); status ERROR
or UNSET; flags ("has is_remote", and "is_remote" for a parent: our parents come from a
traceparent header, another process); spans grouped per resource, one scope ``sits-trace``.
tests/unit/test_exporters_otlp.py holds the two encoders to the same spans, field for field.
"""

from __future__ import annotations

import gzip
import http.client
import logging
import ssl
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus
from sits_trace.agent.model import AttrValue, Span

from ._resource import PROCESS_KEYS

log = logging.getLogger(__name__)

SCOPE_NAME, SCOPE_VERSION = "sits-trace", "0.1.0"
_KINDS = {"INTERNAL": PbSpan.SPAN_KIND_INTERNAL, "SERVER": PbSpan.SPAN_KIND_SERVER,
          "CLIENT": PbSpan.SPAN_KIND_CLIENT, "PRODUCER": PbSpan.SPAN_KIND_PRODUCER,
          "CONSUMER": PbSpan.SPAN_KIND_CONSUMER}
_HAS_IS_REMOTE = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_ERROR = PbStatus(code=PbStatus.STATUS_CODE_ERROR)
_UNSET = PbStatus()
_SKIP = frozenset(PROCESS_KEYS)


def any_value(v: AttrValue) -> AnyValue:
    if isinstance(v, bool):  # before int: a bool is an int
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=str(v))


def key_values(attrs: Mapping[str, AttrValue], skip: frozenset[str] = frozenset()) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attrs.items() if k not in skip]


class KeyValueCache:
    """The KeyValue message of each (key, value) seen before, built once and reused: most of a
    span's attributes repeat from span to span (method, route, server address, status,
    user agent), and building a KeyValue and its AnyValue was most of the encoder's time
    (bench/span_cost.py). A message given to a span is copied into it, so the cached one is
    never changed. Floats (durations) and strings over `max_len` are never cached; the
    cache empties itself when it holds `limit` entries, so values seen once (request ids,
    body sizes) cost a dict entry for a while and no more."""

    __slots__ = ("_kv", "_limit", "_max_len")

    def __init__(self, limit: int = 4096, max_len: int = 256) -> None:
        self._kv: dict[object, KeyValue] = {}
        self._limit = limit
        self._max_len = max_len

    def __call__(self, attrs: Mapping[str, AttrValue], skip: frozenset[str]) -> list[KeyValue]:
        kv = self._kv
        out = []
        for k, v in attrs.items():
            if k in skip:
                continue
            cls = v.__class__
            # the class is in the key: True, 1 and 1.0 are equal keys of a dict
            key = (k, cls, v)
            m = kv.get(key)
            if m is None:
                m = KeyValue(key=k, value=any_value(v))
                if cls is not float and (cls is not str or len(v) <= self._max_len):  # type: ignore[arg-type]
                    if len(kv) >= self._limit:
                        kv.clear()
                    kv[key] = m
            out.append(m)
        return out


def _id(text: str | None, digits: int) -> bytes:
    """Raw id bytes from hex; b"" (absent) for anything that is not `digits` hex digits."""
    if not text or len(text) != digits:
        return b""
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""


ResourceOf = Callable[[Span], Mapping[str, AttrValue]]
_CACHE = KeyValueCache()


def encode(batch: Iterable[Span], resource_of: ResourceOf,
           kvs: KeyValueCache = _CACHE) -> ExportTraceServiceRequest:
    """One request for a batch; spans grouped by their resource's attributes. Each span is
    built in place in the request (`add`), not built and then copied into it."""
    groups: dict[tuple[tuple[str, AttrValue], ...], list[Span]] = {}
    attrs_of: dict[tuple[tuple[str, AttrValue], ...], Mapping[str, AttrValue]] = {}
    for s in batch:
        attrs = resource_of(s)
        key = tuple(sorted(attrs.items()))
        group = groups.get(key)
        if group is None:
            group = groups[key] = []
            attrs_of[key] = attrs
        group.append(s)
    req = ExportTraceServiceRequest()
    for key, spans in groups.items():
        rs = req.resource_spans.add()
        rs.resource.CopyFrom(PbResource(attributes=key_values(attrs_of[key])))
        ss = rs.scope_spans.add()
        ss.scope.CopyFrom(InstrumentationScope(name=SCOPE_NAME, version=SCOPE_VERSION))
        add = ss.spans.add
        for s in spans:
            parent = _id(s.parent_span_id, 16)
            add(trace_id=_id(s.trace_id, 32), span_id=_id(s.span_id, 16), parent_span_id=parent,
                name=s.name, kind=_KINDS.get(s.kind, PbSpan.SPAN_KIND_INTERNAL),
                start_time_unix_nano=s.start_time_unix_nano,
                end_time_unix_nano=s.end_time_unix_nano,
                attributes=kvs(s.attributes, _SKIP),
                status=_ERROR if s.status_code == "ERROR" else _UNSET,
                flags=_HAS_IS_REMOTE | (_IS_REMOTE if parent else 0))
    return req


@dataclass(frozen=True, slots=True)
class Transport:
    """Where and how: the endpoint (http: the full URL; grpc: scheme://host:port), headers,
    per-request timeout, gzip or not, TLS files (PEM paths; "" is none)."""

    endpoint: str
    headers: Mapping[str, str]
    timeout_s: float
    gzip: bool = False
    certificate: str = ""
    client_key: str = ""
    client_certificate: str = ""


class HttpSender:
    """POST application/x-protobuf to the traces URL over one kept-alive connection (a
    connection the collector dropped is opened again once per request)."""

    def __init__(self, t: Transport) -> None:
        u = urlparse(t.endpoint)
        self._t = t
        self._https = u.scheme == "https"
        self._host = u.hostname or "localhost"
        self._port = u.port or (443 if self._https else 80)
        self._path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self._headers = {"Content-Type": "application/x-protobuf", **t.headers}
        if t.gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False

    def _connect(self) -> http.client.HTTPConnection:
        """To the collector, or through $https_proxy/$http_proxy unless $no_proxy names it
        (as the SDK's requests-based exporter did): CONNECT for https, absolute URLs for
        http."""
        proxy = None
        if not urllib.request.proxy_bypass(self._host):
            proxy = urllib.request.getproxies().get("https" if self._https else "http")
        p = urlparse(proxy) if proxy else None
        host, port = (p.hostname or self._host, p.port or 80) if p else (self._host, self._port)
        if self._https:
            ctx = ssl.create_default_context(cafile=self._t.certificate or None)
            if self._t.client_certificate:
                ctx.load_cert_chain(self._t.client_certificate, self._t.client_key or None)
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=self._t.timeout_s, context=ctx)
            if p:
                conn.set_tunnel(self._host, self._port)
            return conn
        if p:
            self._path = self._t.endpoint  # a proxy is asked for the absolute URL
        return http.client.HTTPConnection(host, port, timeout=self._t.timeout_s)

    def send(self, req: ExportTraceServiceRequest) -> bool:
        body = req.SerializeToString()
        if self._t.gzip:
            body = gzip.compress(body)
        for attempt in range(2):
            if self._closed:
                return False
            conn = self._conn = self._conn or self._connect()
            try:
                conn.request("POST", self._path, body=body, headers=self._headers)
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                if attempt:
                    log.debug("otlp http: %s", exc)
                continue
            if 200 <= resp.status < 300:
                return True
            log.debug("otlp http: %s %s", resp.status, resp.reason)
            return False  # the queue retries with backoff until its deadline
        return False

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Also cuts a request in progress short (shutdown)."""
        self._closed = True
        self._drop()


class GrpcSender:
    """opentelemetry.proto.collector.trace.v1.TraceService/Export on one channel."""

    def __init__(self, t: Transport) -> None:
        import grpc  # noqa: PLC0415 - the protocol asked for only
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (  # noqa: PLC0415
            TraceServiceStub,
        )

        self._grpc: Any = grpc
        u = urlparse(t.endpoint)
        target = u.netloc or u.path
        compression = grpc.Compression.Gzip if t.gzip else None
        if u.scheme == "https":
            creds = grpc.ssl_channel_credentials(
                _read(t.certificate), _read(t.client_key), _read(t.client_certificate))
            self._channel = grpc.secure_channel(target, creds, compression=compression)
        else:
            self._channel = grpc.insecure_channel(target, compression=compression)
        self._stub = TraceServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata: Sequence[tuple[str, str]] = tuple((k.lower(), v)
                                                          for k, v in t.headers.items())
        self._timeout = t.timeout_s

    def send(self, req: ExportTraceServiceRequest) -> bool:
        try:
            self._stub.Export(req, metadata=self._metadata, timeout=self._timeout)
            return True
        except self._grpc.RpcError as exc:
            log.debug("otlp grpc: %s", exc.code() if hasattr(exc, "code") else exc)
            return False
        except ValueError as exc:  # the channel was closed by shutdown
            log.debug("otlp grpc: %s", exc)
            return False

    def close(self) -> None:
        self._channel.close()


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def sender(protocol: str, t: Transport) -> HttpSender | GrpcSender:
    return GrpcSender(t) if protocol == "grpc" else HttpSender(t)
