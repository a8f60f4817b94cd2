"""Span assembly: one `Exchange` becomes one `Span`.

Names and attributes follow the OTel stable HTTP semantic conventions
(`http.request.method`, `url.path`, `http.route`, `http.response.status_code`, ...);
agent-specific timings live under `sits.*`. Trace identity comes from the request:
a valid W3C `traceparent`, else a hash of `x-request-id` (so one request id seen by
several agents lands in one trace), else fresh random ids. Times become Unix
nanoseconds here, once, with the clock offset given to the builder.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from sits_trace.agent.model import (
    AttrValue,
    ConnInfo,
    Exchange,
    RequestHead,
    ResponseHead,
    Role,
    Span,
)
from sits_trace.agent.tracing.genai import genai_attributes
from sits_trace.agent.tracing.http1 import is_model_route

from .redact import QueryRedactor, strip_userinfo

# methods OTel knows (RFC 9110 + PATCH); others become "_OTHER"
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)
REQUEST_ID_SALT = b"sits-trace/x-request-id/"
_HEX = frozenset("0123456789abcdef")
_CLIENT = Role.CLIENT
_NS_PER_MS = 1_000_000.0


class RouteTable:
    """User-configured route templates such as "/v1/models/{id}", matched by segment.

    A "{name}" segment matches any one non-empty segment; other segments match
    literally. When several templates match, the one with the most literal segments
    wins, then the one listed first. A trailing slash is ignored.
    """

    def __init__(self, patterns: Iterable[str]) -> None:
        self._by_len: dict[int, list[tuple[tuple[str | None, ...], str]]] = {}
        for pattern in patterns:
            segs = _segments(pattern)
            if segs is None:
                raise ValueError(f"route {pattern!r} must start with '/'")
            literals = tuple(None if _is_param(s) else s for s in segs)
            self._by_len.setdefault(len(segs), []).append((literals, pattern))
        for entries in self._by_len.values():  # most literal segments first, stable
            entries.sort(key=lambda e: -sum(s is not None for s in e[0]))

    def match(self, path: str) -> str | None:
        """The template `path` falls under, or None."""
        segs = _segments(path)
        if segs is None:
            return None
        for literals, pattern in self._by_len.get(len(segs), ()):
            if all(_segment_matches(lit, seg) for lit, seg in zip(literals, segs, strict=True)):
                return pattern
        return None


class RandomPool:
    """os.urandom read 4 KiB at a time and handed out in slices: one system call per ~340
    spans instead of two per span (ids are random either way). `hex` hands out the same
    bytes as text, from the block written out as hex once per read: a span's ids are then a
    slice each, not a slice, a scan and a conversion (4-5% of the agent's samples)."""

    __slots__ = ("_buf", "_hex", "_pos", "_read", "_size")

    def __init__(self, size: int = 4096, read: Callable[[int], bytes] = os.urandom) -> None:
        self._size = size
        self._read = read
        self._buf = b""
        self._hex = ""
        self._pos = 0

    def _refill(self, n: int) -> None:
        self._buf = self._read(max(self._size, n))
        self._hex = ""  # written out on the first hex() of this block
        self._pos = 0

    def __call__(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            self._refill(n)
        pos = self._pos
        self._pos = pos + n
        return self._buf[pos:pos + n]

    def hex(self, n: int) -> str:
        """n bytes of the pool as 2n lower-case hex digits."""
        if self._pos + n > len(self._buf):
            self._refill(n)
        if not self._hex:
            self._hex = self._buf.hex()
        pos = self._pos
        self._pos = pos + n
        return self._hex[2 * pos:2 * (pos + n)]


class SpanBuilder:
    """Builds spans from exchanges; `clock_offset_ns` turns monotonic ns into Unix ns."""

    def __init__(
        self,
        *,
        clock_offset_ns: int,
        id_source: Callable[[int], bytes] | None = None,
        routes: RouteTable | None = None,
        redactor: QueryRedactor | None = None,
    ) -> None:
        self.clock_offset_ns = clock_offset_ns
        self._pool = RandomPool() if id_source is None else None  # ids as hex: _random_hex
        self._id_source: Callable[[int], bytes] = (
            id_source if id_source is not None else os.urandom)
        self._routes = routes
        self._redactor = redactor if redactor is not None else QueryRedactor()

    def build(self, ex: Exchange) -> Span:
        req, resp, conn = ex.request, ex.response, ex.conn
        client = conn.role == _CLIENT  # a module constant: no lookup on the enum class
        trace_id, parent = self._identity(req)
        method = req.method if req.method in KNOWN_METHODS else "_OTHER"
        path, query = _split_target(req.target)
        if query:
            query = self._redactor.query(query)
        route = self._routes.match(path) if self._routes is not None and path else None
        attrs = _request_attributes(req, method, path, query, route)
        _add_connection_attributes(attrs, conn, req, client)  # into the one dict: no merges
        if resp is not None:
            _add_response_attributes(attrs, req, resp)
        if path and is_model_route(path):
            attrs.update(genai_attributes(path, req, resp))
        error = _error_type(ex, client)
        if error is not None:
            attrs["error.type"] = error
        if conn.sample_shift:
            # captured as one exchange in 2**n while the agent shed load: what the
            # probability sampler of the OTel SDK writes, so backends can re-weight
            attrs["sampling.probability"] = 1.0 / (1 << conn.sample_shift)
        off = self.clock_offset_ns
        start = req.start_ns + off
        end = (resp.end_ns if resp is not None else req.end_ns) + off
        return Span(
            trace_id=trace_id,
            span_id=self._random_hex(8),
            parent_span_id=parent,
            name=_span_name(method, route),
            kind="CLIENT" if client else "SERVER",
            start_time_unix_nano=start,
            end_time_unix_nano=max(end, start),
            attributes=attrs,
            status_code="ERROR" if error is not None else "UNSET",
        )

    def _identity(self, req: RequestHead) -> tuple[str, str | None]:
        """(trace id, parent span id) for the request."""
        tp = req.header("traceparent")
        if tp is not None:
            parsed = parse_traceparent(tp)
            if parsed is not None:
                return parsed
        rid = req.header("x-request-id")
        if rid:
            return request_id_trace_id(rid), None
        return self._random_hex(16), None

    def _random_hex(self, n: int) -> str:
        """n random bytes as hex, never all zero (an invalid id in W3C and OTLP)."""
        pool = self._pool
        if pool is not None:
            h = pool.hex(n)
            if h.count("0") != len(h):
                return h
        for _ in range(8):
            raw = self._id_source(n)
            if len(raw) == n and any(raw):
                return raw.hex()
        return os.urandom(n).hex()  # id_source keeps failing: do not emit an invalid id


# ---- identity ----


def parse_traceparent(value: str) -> tuple[str, str] | None:
    """(trace id, parent id) of a valid version-00 W3C traceparent, else None."""
    parts = value.strip().split("-")
    if len(parts) != 4:
        return None
    version, trace_id, parent_id, flags = parts
    if version != "00" or len(trace_id) != 32 or len(parent_id) != 16 or len(flags) != 2:
        return None
    if not (_is_hex(trace_id) and _is_hex(parent_id) and _is_hex(flags)):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return trace_id, parent_id


def request_id_trace_id(request_id: str) -> str:
    """The trace id every sits-trace agent derives from one x-request-id value."""
    try:
        raw = request_id.encode("latin-1")  # the bytes on the wire (the parser decodes latin-1)
    except UnicodeEncodeError:
        raw = request_id.encode("utf-8")
    return hashlib.sha256(REQUEST_ID_SALT + raw).digest()[:16].hex()


def _is_hex(s: str) -> bool:
    return all(c in _HEX for c in s)


# ---- attributes ----


def _request_attributes(
    req: RequestHead, method: str, path: str | None, query: str | None, route: str | None
) -> dict[str, AttrValue]:
    attrs: dict[str, AttrValue] = {"http.request.method": method}
    if method != req.method:
        attrs["http.request.method_original"] = req.method
    if path is not None:
        attrs["url.path"] = path
    if query:
        attrs["url.query"] = query
    if route is not None:
        attrs["http.route"] = route
    attrs["network.protocol.version"] = req.version
    ua = req.header("user-agent")
    if ua is not None:
        attrs["user_agent.original"] = ua
    rid = req.header("x-request-id")
    if rid is not None:
        attrs["http.request.header.x-request-id"] = rid
    if req.body_bytes:
        attrs["http.request.body.size"] = req.body_bytes
    return attrs


def _add_connection_attributes(attrs: dict[str, AttrValue], conn: ConnInfo, req: RequestHead,
                               client: bool) -> None:
    attrs["url.scheme"] = "https" if conn.tls else "http"
    if client:
        fallback = (conn.peer_address, conn.peer_port)
    else:
        fallback = (conn.local_address, conn.local_port)
    host, port = _server_endpoint(req, fallback)
    if host:
        attrs["server.address"] = host
    if port:
        attrs["server.port"] = port
    if not client:
        if conn.peer_address:
            attrs["client.address"] = conn.peer_address
        if conn.peer_port:
            attrs["client.port"] = conn.peer_port
    if conn.peer_address:
        attrs["network.peer.address"] = conn.peer_address
    if conn.peer_port:
        attrs["network.peer.port"] = conn.peer_port
    attrs["process.pid"] = conn.pid
    if conn.comm:
        attrs["process.executable.name"] = conn.comm
    attrs["tls"] = conn.tls


def _add_response_attributes(attrs: dict[str, AttrValue], req: RequestHead,
                             resp: ResponseHead) -> None:
    attrs["http.response.status_code"] = resp.status
    attrs["sits.ttfb_ms"] = _ms(resp.first_byte_ns - req.start_ns)
    if resp.body_bytes:
        attrs["http.response.body.size"] = resp.body_bytes
    if resp.streamed:
        if resp.first_body_ns is not None:
            attrs["sits.time_to_first_chunk_ms"] = _ms(resp.first_body_ns - req.start_ns)
        if resp.last_body_ns is not None:
            attrs["sits.time_to_last_chunk_ms"] = _ms(resp.last_body_ns - req.start_ns)
        attrs["sits.stream.chunks"] = resp.body_chunks


def _error_type(ex: Exchange, client: bool) -> str | None:
    """error.type: the exchange's error, else the status code of a failed response."""
    if ex.error:
        return ex.error
    resp = ex.response
    if resp is None:
        return "_OTHER"  # no response and no reason given
    if resp.status >= (400 if client else 500):
        return str(resp.status)
    return None


def _span_name(method: str, route: str | None) -> str:
    if method == "_OTHER":
        return "HTTP"  # semconv: unknown methods do not name spans
    return f"{method} {route}" if route is not None else method


def _ms(ns: int) -> float:
    return ns / _NS_PER_MS


# ---- targets and hosts ----


def _split_target(target: str) -> tuple[str | None, str | None]:
    """(path, query) of a request-target; (None, None) for "*" and authority-form."""
    if target.startswith("/"):
        path, sep, query = target.partition("?")
        return path.partition("#")[0], query.partition("#")[0] if sep else None
    if "://" in target:  # absolute-form, sent to proxies
        try:
            parts = urlsplit(target)
        except ValueError:
            return None, None
        return parts.path or "/", parts.query or None
    return None, None


# Host header values seen -> (host, port): a server sees few, and every span parses one
_HOSTS: dict[str, tuple[str, int | None]] = {}
_HOSTS_MAX = 1024


def _server_endpoint(req: RequestHead, fallback: tuple[str, int]) -> tuple[str, int]:
    """server.address/port from the Host header, else from the connection."""
    host_header = req.header("host")
    if host_header:
        hp = _HOSTS.get(host_header)
        if hp is None:
            hp = split_host_port(strip_userinfo(host_header))
            if "@" not in host_header:  # a value with userinfo is not kept, even in memory
                if len(_HOSTS) >= _HOSTS_MAX:
                    _HOSTS.clear()
                _HOSTS[host_header] = hp
        host, port = hp
        if host:
            return host, port if port is not None else fallback[1]
    return fallback


def split_host_port(value: str) -> tuple[str, int | None]:
    """("example.com", 8080) from "example.com:8080"; IPv6 literals in brackets."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return "", None
        host, rest = value[1:end], value[end + 1 :]
        return host, _port(rest[1:]) if rest.startswith(":") else None
    host, sep, port = value.rpartition(":")
    if not sep:
        return value, None
    if ":" in host:  # an IPv6 literal without brackets: no port
        return value, None
    return host, _port(port)


def _port(s: str) -> int | None:
    if s.isdecimal() and s.isascii() and 0 < int(s) < 65536:
        return int(s)
    return None


def _segments(path: str) -> list[str] | None:
    if not path.startswith("/"):
        return None
    segs = path.split("/")[1:]
    if segs and segs[-1] == "":
        segs.pop()  # "/a/b/" is "/a/b"; "/" has no segments
    return segs


def _segment_matches(literal: str | None, seg: str) -> bool:
    return seg != "" if literal is None else seg == literal


def _is_param(seg: str) -> bool:
    return len(seg) > 2 and seg.startswith("{") and seg.endswith("}")
