"""OTLP traces without the SDK's span objects: a batch of our spans written straight into the
bytes of one ``ExportTraceServiceRequest``, sent over HTTP/protobuf (one kept-alive
``http.client`` connection) or gRPC (grpcio, ``TraceService/Export``, the bytes as they are).

Why not the SDK's span exporter: it takes ``ReadableSpan`` objects, so every span was built
twice (ours, then the SDK's with its SpanContext, Status, Resource and scope objects) before
the SDK's encoder walked them again; that path was the largest stage of the agent's CPU per
span (docs/performance.md, `bench/span_cost.py`). Then opentelemetry-proto's messages were
filled per span (a KeyValue message per attribute, copied in); now each attribute's bytes
are written once and reused, and a span is a join of byte strings. The wire format is the
same; the SDK still exports the metrics.

What a collector gets, field by field as the SDK's encoder wrote it: trace, span and parent
ids; name; kind; start and end; attributes (process.* move to the resource); status ERROR
or UNSET; flags ("has is_remote", and "is_remote" for a parent: our parents come from a
traceparent header, another process); spans grouped per resource, one scope ``sits-trace``.
tests/unit/test_exporters_otlp.py holds the bytes to the SDK encoder's spans, field for
field, and to what protobuf's own serializer writes for the same messages, byte for byte.
"""

from __future__ import annotations

import gzip
import http.client
import logging
import ssl
import struct
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlparse

from sits_trace.agent.model import AttrValue, Span

from ._resource import PROCESS_KEYS

log = logging.getLogger(__name__)

SCOPE_NAME, SCOPE_VERSION = "sits-trace", "0.1.0"
_HAS_IS_REMOTE = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_SKIP = frozenset(PROCESS_KEYS)


# ---- the protobuf wire format, written directly ----
# Field numbers (opentelemetry-proto): ExportTraceServiceRequest.resource_spans 1;
# ResourceSpans.resource 1, .scope_spans 2; Resource.attributes 1; ScopeSpans.scope 1,
# .spans 2; InstrumentationScope.name 1, .version 2; Span.trace_id 1, .span_id 2,
# .parent_span_id 4, .name 5, .kind 6, .start_time_unix_nano 7 (fixed64), .end_time 8
# (fixed64), .attributes 9, .status 15, .flags 16 (fixed32); Status.code 3; KeyValue.key 1,
# .value 2; AnyValue.string_value 1, .bool_value 2, .int_value 3, .double_value 4 (a oneof:
# written even when zero). Bytes in field order, defaults left out, as protobuf's own
# serializer writes them (tests/unit/test_exporters_otlp.py compares the two byte for byte).

_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_I32 = struct.Struct("<I")
_SMALL = [bytes((n,)) for n in range(128)]


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    if n < 16384:  # a span's length, mostly
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the length, the payload."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else _varint(n)) + payload


def _any_value(v: AttrValue) -> bytes:
    if isinstance(v, bool):  # before int: a bool is an int
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        if -(1 << 63) <= v < (1 << 63):
            return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)
        # past int64 (protobuf's serializer refused the whole request): its digits
        return _field(b"\x0a", str(v).encode())
    if isinstance(v, float):
        return b"\x21" + _F64.pack(v)
    return _field(b"\x0a", _utf8(str(v)))


def _utf8(text: str) -> bytes:
    # a lone surrogate has no UTF-8 (protobuf's serializer refused the whole request): "?"
    return text.encode("utf-8", "replace")


def key_value(k: str, v: AttrValue, tag: bytes) -> bytes:
    """One KeyValue as the field `tag` of its parent (Span.attributes: 9, Resource's: 1)."""
    key = _field(b"\x0a", _utf8(k)) if k else b""
    return _field(tag, key + _field(b"\x12", _any_value(v)))


def _resource_attributes(attrs: Mapping[str, AttrValue]) -> bytes:
    """A Resource message: its attributes (field 1), uncached (once per batch and resource)."""
    return b"".join(key_value(k, v, b"\x0a") for k, v in attrs.items())


class KeyValueCache:
    """The encoded Span.attributes field of each (key, value) seen before, written once and
    reused: most of a span's attributes repeat from span to span (method, route, server
    address, status, user agent), and writing a KeyValue was most of the encoder's time
    (bench/span_cost.py). Looked up by key, then by value, in a table per value type (True,
    1 and 1.0 are equal keys of one dict, and must not share an encoding), so a hit costs two
    dict lookups and no object. An attribute the caller skips (process.*: the resource's)
    is held as b"", so skipping costs no lookup of its own. Floats (durations) and strings
    over `max_len` are never cached, only their key's bytes are (a float's whole field but
    its eight value bytes); the cache empties itself when it holds `limit` values, so values
    seen once (request ids, body sizes) cost a dict entry for a while and no more."""

    __slots__ = ("_bool", "_float", "_int", "_keys", "_limit", "_max_len", "_n", "_skip", "_str")

    def __init__(self, limit: int = 4096, max_len: int = 256) -> None:
        self._str: dict[str, dict[str, bytes]] = {}
        self._int: dict[str, dict[int, bytes]] = {}
        self._bool: dict[str, dict[bool, bytes]] = {}
        self._keys: dict[str, bytes] = {}  # a key's KeyValue.key field
        self._float: dict[str, bytes] = {}  # a float attribute's field up to its value
        self._n = 0  # values held in the three tables
        self._skip: frozenset[str] = frozenset()  # the keys held as b"" (add's `skip`)
        self._limit = limit
        self._max_len = max_len

    def __len__(self) -> int:
        return self._n

    def values(self) -> list[tuple[str, AttrValue]]:
        """What is held, as (key, value) pairs (tests)."""
        return [(k, v) for t in (self._str, self._int, self._bool)
                for k, d in t.items() for v in d]

    def add(self, out: list[bytes], attrs: Mapping[str, AttrValue],
            skip: frozenset[str]) -> None:
        """Appends the encoded Span.attributes field of each of `attrs` (but those in `skip`)
        to `out`, the span's list of parts (a skipped one as b""): no list of its own per
        span."""
        if skip is not self._skip:  # what is held as b"" changes: nothing held is kept
            self._clear()
            self._keys.clear()
            self._float.clear()
            self._skip = skip
        for k, v in attrs.items():
            cls = type(v)
            if cls is str:
                sv = cast(str, v)
                d = self._str.get(k)
                m = d.get(sv) if d is not None else None
                if m is None:
                    m = self._miss(k, sv, self._str, len(sv) <= self._max_len)
            elif cls is float:
                # never the same twice (durations): the key's part of the field is kept, the
                # eight bytes of the value appended
                pre = self._float.get(k)
                if pre is None:
                    pre = self._float_prefix(k)
                m = pre + _F64.pack(cast(float, v)) if pre else b""  # b"": skipped
            elif cls is int:
                iv = cast(int, v)
                d2 = self._int.get(k)
                m = d2.get(iv) if d2 is not None else None
                if m is None:
                    m = self._miss(k, iv, self._int, True)
            elif cls is bool:
                bv = cast(bool, v)
                d3 = self._bool.get(k)
                m = d3.get(bv) if d3 is not None else None
                if m is None:
                    m = self._miss(k, bv, self._bool, True)
            else:  # a subclass of str, int or float: written each time
                m = self._miss(k, v, None, False)
            out.append(m)

    def _clear(self) -> None:
        self._str.clear()
        self._int.clear()
        self._bool.clear()
        self._n = 0

    def _float_prefix(self, k: str) -> bytes:
        """Everything of a float attribute's field but the value's eight bytes: the field's
        tag and length, the key, the AnyValue's tag and length and double_value's tag; b""
        for a skipped key."""
        key = _field(b"\x0a", _utf8(k)) if k else b""
        pre = b"\x4a" + _varint(len(key) + 11) + key + b"\x12\x09\x21" \
            if k not in self._skip else b""
        if len(self._float) >= self._limit:
            self._float.clear()
        if self._limit > 0:
            self._float[k] = pre
        return pre

    def _miss(self, k: str, v: AttrValue, table: Any, keep: bool) -> bytes:
        key = self._keys.get(k)
        if key is None:
            key = _field(b"\x0a", _utf8(k)) if k else b""
            if len(self._keys) >= self._limit:
                self._keys.clear()
            if self._limit > 0:
                self._keys[k] = key
        m = _field(b"\x4a", key + _field(b"\x12", _any_value(v))) if k not in self._skip \
            else b""
        if keep and table is not None and self._limit > 0:
            if self._n >= self._limit:
                self._clear()
            d = table.get(k)
            if d is None:
                d = table[k] = {}
            d[v] = m
            self._n += 1
        return m


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
_KINDS = {"INTERNAL": b"\x30\x01", "SERVER": b"\x30\x02", "CLIENT": b"\x30\x03",
          "PRODUCER": b"\x30\x04", "CONSUMER": b"\x30\x05"}
_ERROR = b"\x7a\x02\x18\x02"  # status {code: STATUS_CODE_ERROR}
_UNSET = b"\x7a\x00"  # status {} (set, empty)
_FLAGS = b"\x85\x01" + _I32.pack(_HAS_IS_REMOTE)  # field 16, fixed32
_FLAGS_REMOTE = b"\x85\x01" + _I32.pack(_HAS_IS_REMOTE | _IS_REMOTE)
_SCOPE = _field(b"\x0a", _field(b"\x0a", SCOPE_NAME.encode())
                + _field(b"\x12", SCOPE_VERSION.encode()))


_NAMES: dict[str, bytes] = {}  # a span name's field ("GET", "POST /v1/chat/completions")
_NAMES_MAX = 1024


def _name_field(name: str) -> bytes:
    """Span.name's field (b"" for no name), kept: span names are a method and a route, few."""
    f = _field(b"\x2a", _utf8(name)) if name else b""
    if len(_NAMES) >= _NAMES_MAX:
        _NAMES.clear()
    _NAMES[name] = f
    return f


def span_bytes(s: Span, kvs: KeyValueCache = _CACHE) -> bytes:
    """One Span message (its fields, without the enclosing tag and length)."""
    tid, sid, parent = _id(s.trace_id, 32), _id(s.span_id, 16), _id(s.parent_span_id, 16)
    parts = [b"\x0a\x10" + tid if tid else b"", b"\x12\x08" + sid if sid else b"",
             b"\x22\x08" + parent if parent else b"",
             _NAMES.get(s.name) or _name_field(s.name),
             _KINDS.get(s.kind, b"\x30\x01"),
             b"\x39" + _U64.pack(s.start_time_unix_nano) if s.start_time_unix_nano else b"",
             b"\x41" + _U64.pack(s.end_time_unix_nano) if s.end_time_unix_nano else b""]
    kvs.add(parts, s.attributes, _SKIP)
    parts.append(_ERROR if s.status_code == "ERROR" else _UNSET)
    parts.append(_FLAGS_REMOTE if parent else _FLAGS)
    return b"".join(parts)


def encode(batch: Iterable[Span], resource_of: ResourceOf,
           kvs: KeyValueCache = _CACHE) -> bytes:
    """One serialized ``ExportTraceServiceRequest`` for a batch, spans grouped by their
    resource's attributes: the bytes opentelemetry-proto's messages would serialize to,
    written without building a message per span (a third of the time: bench/span_cost.py)."""
    groups: dict[tuple[tuple[str, AttrValue], ...], list[bytes]] = {}
    attrs_of: dict[tuple[tuple[str, AttrValue], ...], Mapping[str, AttrValue]] = {}
    # a resource_of that returns one cached mapping per process (the exporter's does) is
    # sorted into its group once per batch, not once per span; each mapping seen is kept
    # alive to the end, so no other object can take its id meanwhile
    by_id: dict[int, list[bytes]] = {}
    seen: list[Mapping[str, AttrValue]] = []
    for s in batch:
        attrs = resource_of(s)
        group = by_id.get(id(attrs))
        if group is None:
            key = tuple(sorted(attrs.items()))
            group = groups.get(key)
            if group is None:
                group = groups[key] = []
                attrs_of[key] = attrs
            by_id[id(attrs)] = group
            seen.append(attrs)
        sb = span_bytes(s, kvs)
        n = len(sb)
        # ScopeSpans.spans: the tag and length, then the span's bytes as they are (joined
        # once, with the whole request, below: not copied into a field of their own first)
        group.append(b"\x12" + (_SMALL[n] if n < 128 else _varint(n)))
        group.append(sb)
    out: list[bytes] = []
    for key, spans in groups.items():
        resource = _field(b"\x0a", _resource_attributes(attrs_of[key]))
        ss_len = len(_SCOPE) + sum(map(len, spans))
        ss_head = b"\x12" + _varint(ss_len)
        out.append(b"\x0a" + _varint(len(resource) + len(ss_head) + ss_len))
        out.append(resource)
        out.append(ss_head)
        out.append(_SCOPE)
        out += spans
    return b"".join(out)


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

    def send(self, body: bytes) -> bool:
        """`body`: a serialized ExportTraceServiceRequest (encode)."""
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
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: PLC0415
            ExportTraceServiceResponse,
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
        # the stub's method with no request serializer: encode's bytes go as they are
        self._export = self._channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None,
            response_deserializer=ExportTraceServiceResponse.FromString)
        self._metadata: Sequence[tuple[str, str]] = tuple((k.lower(), v)
                                                          for k, v in t.headers.items())
        self._timeout = t.timeout_s

    def send(self, body: bytes) -> bool:
        try:
            self._export(body, metadata=self._metadata, timeout=self._timeout)
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
