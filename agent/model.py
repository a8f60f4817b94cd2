"""Plain data passed between the stages of the pipeline.

decode (capture/events.py) -> connection table (tracing/pipeline.py) -> HTTP parser
(tracing/http1.py) -> span assembly (tracing/spans.py) -> exporters; the agent's counters
(AgentStats) and node-signal rows beside them. Nothing here does I/O.

Times inside the agent are CLOCK_MONOTONIC nanoseconds (what bpf_ktime_get_ns
returns); spans convert to Unix nanoseconds once, in span assembly, with a
clock offset passed in.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

try:
    import orjson
except ImportError:  # a machine with only the standard library (the GPU test image): its json
    orjson = None  # type: ignore[assignment]

AttrValue = str | bool | int | float


class Direction(enum.IntEnum):
    """Which way bytes moved, seen from the traced process."""

    INGRESS = 0  # the process read them (read/recv/SSL_read)
    EGRESS = 1  # the process wrote them (write/send/SSL_write/sendfile)


class Role(enum.IntEnum):
    """The traced process's side of a connection."""

    UNKNOWN = 0
    SERVER = 1  # the connection came from accept(): requests are INGRESS
    CLIENT = 2  # the connection came from connect(): requests are EGRESS


@dataclass(slots=True)
class ConnInfo:
    """What the agent knows about one connection of one process."""

    conn_id: int
    pid: int
    fd: int
    role: Role
    opened_ns: int = 0
    peer_address: str = ""
    peer_port: int = 0
    local_address: str = ""
    local_port: int = 0
    comm: str = ""
    tls: bool = False
    # the exchange in progress stands for 2**sample_shift (the kernel sheds load by
    # capturing one exchange in 2**n when the agent cannot keep up); 0: not sampled
    sample_shift: int = 0


@dataclass(slots=True)
class Chunk:
    """One read or write on a connection, as the probes saw it.

    ``data`` holds the captured prefix of what moved (its suffix when ``tail``); ``length``
    is how many bytes really moved (``length >= len(data)``; the rest was not captured, e.g.
    a body sent with sendfile, a payload past the capture limit, or a long request body's
    reads past its first bpf/events.h SITS_BODY_HEAD bytes).
    """

    direction: Direction
    ts_enter_ns: int
    ts_exit_ns: int
    data: bytes
    length: int
    tail: bool = False  # ``data`` is the last bytes of what moved (the rest came before it)
    tid: int = 0  # the thread that read or wrote it (0: not a read or write seen, e.g. a
    #               summary's end)
    runq_us: int = 0  # that thread's run-queue wait so far then (bpf/sched.c; EV_DATA.runq_us)

    # an __init__ written out is compiled with the class (agent/native.py); the one the
    # dataclass decorator would write runs interpreted. tests/unit/test_native.py checks
    # that each such __init__ takes the fields, in order, with their defaults.
    def __init__(self, direction: Direction, ts_enter_ns: int, ts_exit_ns: int, data: bytes,
                 length: int, tail: bool = False, tid: int = 0, runq_us: int = 0) -> None:
        self.direction = direction
        self.ts_enter_ns = ts_enter_ns
        self.ts_exit_ns = ts_exit_ns
        self.data = data
        self.length = length
        self.tail = tail
        self.tid = tid
        self.runq_us = runq_us


@dataclass(slots=True)
class StreamChunk:
    """Body writes of one response folded in the kernel (bpf/stream.h): what the parser
    would have counted from each of them, and the first bytes of the last two."""

    direction: Direction
    writes: int  # writes that carried body bytes
    events: int  # of them, writes whose chunk data began with `data:` (SSE events)
    first_enter_ns: int
    last_exit_ns: int
    max_gap_ns: int  # largest pause between two of the folded writes
    body_bytes: int
    wire_bytes: int
    end_ns: int  # exit of the write that ended the response; 0 when it has not ended
    complete: bool  # the response ended within or right after these writes
    tails: tuple[bytes, bytes]  # oldest first, chunk framing kept
    head: bytes = b""  # first bytes of the first of them, chunk framing kept
    second_enter_ns: int = 0  # the second of them began (0: one write)


@dataclass(slots=True)
class RequestHead:
    method: str
    target: str  # request-target as sent, e.g. "/v1/completions?x=1"
    version: str  # "1.0" or "1.1"
    headers: list[tuple[str, str]]  # names lower-cased, order kept, bounded count
    start_ns: int  # first byte of the request (ts_exit of the chunk that carried it)
    end_ns: int  # last byte of the request, body included
    body_bytes: int = 0
    # bounded prefix and tail of the captured body, kept only for model-serving routes (GenAI
    # attributes read a few fields from them; span assembly never exports the bytes)
    body_head: bytes = b""
    body_tail: bytes = b""

    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]],
                 start_ns: int, end_ns: int, body_bytes: int = 0, body_head: bytes = b"",
                 body_tail: bytes = b"") -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.body_bytes = body_bytes
        self.body_head = body_head
        self.body_tail = body_tail

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class ResponseHead:
    status: int
    version: str
    headers: list[tuple[str, str]]
    first_byte_ns: int  # ts_enter of the write that carried the status line (its ts_exit where
    #                     reads and writes are traced at their exit alone: bpf/http.c)
    end_ns: int  # ts_exit of the write that carried the last byte
    first_body_ns: int | None = None  # first body chunk (streamed responses: first event)
    # first body chunk that carries output: an SSE preamble (OpenAI chat's role-only chunk,
    # sent before any token) skipped; None when not SSE or not seen yet
    first_token_ns: int | None = None
    last_body_ns: int | None = None  # last body chunk
    body_bytes: int = 0
    body_chunks: int = 0  # writes (or chunked-encoding chunks) that carried body bytes
    streamed: bool = False  # chunked or text/event-stream or close-delimited
    max_gap_ns: int = 0  # longest pause between two body writes (time between tokens)
    sse: bool = False  # text/event-stream: events counted, the terminal event noticed
    sse_events: int = 0  # `data:` lines seen in captured body bytes
    sse_done: bool = False  # an OpenAI-style `data: [DONE]` terminal event was seen
    body_tail: bytes = b""  # last captured body bytes of model-serving routes (the `usage`)

    def __init__(self, status: int, version: str, headers: list[tuple[str, str]],
                 first_byte_ns: int, end_ns: int, first_body_ns: int | None = None,
                 first_token_ns: int | None = None, last_body_ns: int | None = None,
                 body_bytes: int = 0, body_chunks: int = 0, streamed: bool = False,
                 max_gap_ns: int = 0, sse: bool = False, sse_events: int = 0,
                 sse_done: bool = False, body_tail: bytes = b"") -> None:
        self.status = status
        self.version = version
        self.headers = headers
        self.first_byte_ns = first_byte_ns
        self.end_ns = end_ns
        self.first_body_ns = first_body_ns
        self.first_token_ns = first_token_ns
        self.last_body_ns = last_body_ns
        self.body_bytes = body_bytes
        self.body_chunks = body_chunks
        self.streamed = streamed
        self.max_gap_ns = max_gap_ns
        self.sse = sse
        self.sse_events = sse_events
        self.sse_done = sse_done
        self.body_tail = body_tail

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class Exchange:
    """One request and, unless the connection ended first, its response."""

    conn: ConnInfo
    request: RequestHead
    response: ResponseHead | None
    error: str | None = None  # e.g. "connection_closed" when no response came
    # The serving thread's run-queue counter (Chunk.runq_us) at the read or write that
    # carried the request's first byte (tid0, runq0) and at the last one of the response seen
    # (tid1, runq1), as the parser saw them (signals/sched.py turns them into the span's
    # run-queue delay). tid0 0: not seen. runq_ends: both are the span's own first and last
    # byte. runq_switches: None when one thread did every read and write of the connection
    # in between; else each change of thread in between, oldest first, as (thread before,
    # its counter at its last read or write, thread after, its counter at its first one).
    runq_tid0: int = 0
    runq0: int = 0
    runq_tid1: int = 0
    runq1: int = 0
    runq_ends: bool = False
    runq_switches: list[tuple[int, int, int, int]] | None = None

    def __init__(self, conn: ConnInfo, request: RequestHead, response: ResponseHead | None,
                 error: str | None = None, runq_tid0: int = 0, runq0: int = 0,
                 runq_tid1: int = 0, runq1: int = 0, runq_ends: bool = False,
                 runq_switches: list[tuple[int, int, int, int]] | None = None) -> None:
        self.conn = conn
        self.request = request
        self.response = response
        self.error = error
        self.runq_tid0 = runq_tid0
        self.runq0 = runq0
        self.runq_tid1 = runq_tid1
        self.runq1 = runq1
        self.runq_ends = runq_ends
        self.runq_switches = runq_switches


@dataclass(slots=True)
class Span:
    """A finished span, in the shape `sits-trace trace --json` prints."""

    trace_id: str  # 32 lower-case hex digits
    span_id: str  # 16 lower-case hex digits
    parent_span_id: str | None
    name: str
    kind: str  # "SERVER" or "CLIENT"
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    status_code: str = "UNSET"  # "UNSET" | "ERROR" (OTel span status)

    def __init__(self, trace_id: str, span_id: str, parent_span_id: str | None, name: str,
                 kind: str, start_time_unix_nano: int, end_time_unix_nano: int,
                 attributes: dict[str, AttrValue] | None = None,
                 status_code: str = "UNSET") -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.name = name
        self.kind = kind
        self.start_time_unix_nano = start_time_unix_nano
        self.end_time_unix_nano = end_time_unix_nano
        self.attributes = {} if attributes is None else attributes
        self.status_code = status_code

    def to_json(self) -> dict[str, object]:
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "kind": self.kind,
            "start_time_unix_nano": self.start_time_unix_nano,
            "end_time_unix_nano": self.end_time_unix_nano,
            "attributes": dict(self.attributes),
            "status": {"code": self.status_code},
        }

    def json_bytes(self) -> bytes:
        """to_json() as one compact JSON line, UTF-8 (`trace --json`, the JSONL exporter).
        orjson writes it in a seventh of the standard library's time (bench/span_cost.py's
        `json`); a value orjson refuses (an int past 64 bits) goes through the standard
        library's encoder instead, so a span is never lost to its encoding."""
        d = {  # to_json() without its copy of the attributes: they are only read here
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "kind": self.kind,
            "start_time_unix_nano": self.start_time_unix_nano,
            "end_time_unix_nano": self.end_time_unix_nano,
            "attributes": self.attributes,
            "status": {"code": self.status_code},
        }
        if orjson is not None:
            try:
                return orjson.dumps(d, option=orjson.OPT_APPEND_NEWLINE)
            except (orjson.JSONEncodeError, TypeError):
                pass
        return (_COMPACT_JSON.encode(d) + "\n").encode()

    def json_line(self) -> str:
        return self.json_bytes().decode()


# the fallback's one encoder: json.dumps with separators builds a new one per call
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


# ---- node signals and health rows ----

# a feature-frame row: (signal, entity) -> value; entity "gpu<i>", "pid<n>", "node", ...
Row = dict[tuple[str, str], float]
# a provider's values: "signal" (the node's) or ("signal", entity); its name prefixes the signal
Provider = Callable[[], Mapping[str | tuple[str, str], float]]


class MetricSample(NamedTuple):
    """One metric value as an exporter shows it: a name, labels and a value."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass(slots=True)
class Check:
    """One row of `sits-trace doctor`: what was checked, whether it works, and the fix."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    core: bool = False

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# ---- the agent's own counters ----


@dataclass(slots=True)
class AgentStats:
    """The agent's counters: the stats file `sits-trace stats` prints, the health metrics the
    exporters read, doctor's "agent stats" row. A part the agent does not have is None (and
    absent from the JSON). `to_json()` / `from_json()` are the file's format."""

    tracer: dict[str, Any] | None = None  # the tracer's counters, "parser" nested
    kernel_seen: dict[str, int] | None = None  # records sent, by event kind
    kernel_lost: dict[str, int] | None = None  # records the ring had no room for, by kind
    probes: list[dict[str, Any]] | None = None  # probes that failed to attach
    uprobe_libraries: list[str] | None = None
    node_signals: dict[str, Any] | None = None
    features: dict[str, int] | None = None
    drain_abandoned_bytes: int | None = None  # ring bytes left unread at stop (when any)
    time_unix: float = 0.0

    def count(self, key: str) -> int:
        """A tracer counter (records, spans, conns_active, capture_shift, ...); 0 if absent."""
        return int((self.tracer or {}).get(key, 0))

    def parser_count(self, key: str) -> int:
        """An HTTP parser counter (resyncs, malformed, ...); 0 if absent."""
        return int((self.tracer or {}).get("parser", {}).get(key, 0))

    @property
    def lost_total(self) -> int:
        return sum((self.kernel_lost or {}).values())

    def to_json(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in _STATS_FIELDS}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AgentStats:
        return cls(**{f: data[f] for f in _STATS_FIELDS if f in data})


_STATS_FIELDS = ("tracer", "kernel_seen", "kernel_lost", "probes", "uprobe_libraries",
                 "node_signals", "features", "drain_abandoned_bytes", "time_unix")
