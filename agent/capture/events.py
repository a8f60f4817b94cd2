"""The decoder of raw ring-buffer records (bpf/events.h's EV_CONN_*, EV_DATA, EV_PROC_*).

The record layouts are mirrored once, in wire.py (checked against what BCC derives from
the C by tests/integration/test_layout.py); here they become plain events, so recorded
fixtures decode without a kernel. Records of the signal programs (tcp.c, cuda.c) are
decoded by their own modules under agent/signals/.
"""

from __future__ import annotations

import ctypes
import ipaddress
import struct
from dataclasses import dataclass

from sits_trace.agent.model import Direction, Role

from .wire import (
    AF_INET,
    AF_INET6,
    DATA_GAP,
    DATA_HDR_SIZE,
    DATA_LOST,
    DATA_SAMPLE_SHIFT,
    DATA_TAIL,
    STREAM_HEAD,
    STREAM_TAIL,
    TASK_COMM_LEN,
    ConnEventC,
    DataEventHdrC,
    Kind,
    ProcEventC,
    Source,
    StreamEnd,
    StreamEventC,
)

__all__ = [  # the wire names decoders and tests reach through this module
    "AF_INET",
    "AF_INET6",
    "DATA_GAP",
    "DATA_HDR_SIZE",
    "DATA_LOST",
    "DATA_SAMPLE_SHIFT",
    "DATA_TAIL",
    "DIRECTIONS",
    "ROLES",
    "STREAM_HEAD",
    "STREAM_TAIL",
    "TASK_COMM_LEN",
    "ConnEvent",
    "ConnEventC",
    "DataEvent",
    "DataEventHdrC",
    "DataHeader",
    "DecodeError",
    "Event",
    "Kind",
    "ProcEvent",
    "ProcEventC",
    "Source",
    "StreamEnd",
    "StreamEvent",
    "StreamEventC",
    "data_header",
    "decode",
    "format_address",
]

_DATA_KIND = int(Kind.DATA).to_bytes(4, "little")


@dataclass(slots=True)
class ConnEvent:
    kind: Kind
    pid: int
    tid: int
    conn_id: int
    ts_ns: int
    fd: int
    listen_fd: int
    role: Role
    peer_address: str
    peer_port: int
    comm: str
    tls: bool
    bytes_in: int
    bytes_out: int
    local_port: int = 0


@dataclass(slots=True)
class DataEvent:
    pid: int
    tid: int
    conn_id: int
    fd: int
    ssl: int
    ts_enter_ns: int
    ts_exit_ns: int
    length: int
    direction: Direction
    source: Source
    role: Role
    payload: bytes
    runq_us: int = 0  # the thread's run-queue wait so far, mod 2**32 microseconds (sched.c)
    sample_shift: int = 0  # the exchange was captured as one in 2**sample_shift (load shedding)
    gap: bool = False  # whole exchanges were skipped on this connection just before
    lost: bool = False  # records of this connection were lost before it (ring full): resync
    tail: bool = False  # payload is the last bytes of `length` (a long request body's rest)

    # written out: compiled with the class (agent/native.py; model.Chunk says why)
    def __init__(self, pid: int, tid: int, conn_id: int, fd: int, ssl: int, ts_enter_ns: int,
                 ts_exit_ns: int, length: int, direction: Direction, source: Source, role: Role,
                 payload: bytes, runq_us: int = 0, sample_shift: int = 0, gap: bool = False,
                 lost: bool = False, tail: bool = False) -> None:
        self.pid = pid
        self.tid = tid
        self.conn_id = conn_id
        self.fd = fd
        self.ssl = ssl
        self.ts_enter_ns = ts_enter_ns
        self.ts_exit_ns = ts_exit_ns
        self.length = length
        self.direction = direction
        self.source = source
        self.role = role
        self.payload = payload
        self.runq_us = runq_us
        self.sample_shift = sample_shift
        self.gap = gap
        self.lost = lost
        self.tail = tail


@dataclass(slots=True)
class StreamEvent:
    """The body writes of one streamed response after its head, folded in the kernel."""

    pid: int
    tid: int
    conn_id: int
    fd: int
    ssl: int
    role: Role
    source: Source
    end: StreamEnd
    writes: int  # writes that carried body bytes
    events: int  # of them, writes whose chunk data began with `data:` (SSE)
    inexact: int  # 0: the kernel folds whole chunks only (bpf/stream.h); kept in the layout
    first_enter_ns: int
    first_exit_ns: int
    last_enter_ns: int
    last_exit_ns: int
    end_ns: int  # exit of the write that ended the chunked body; 0 when not seen
    max_gap_ns: int
    sum_gap_ns: int
    wire_bytes: int
    body_bytes: int
    tails: tuple[bytes, bytes]  # first bytes of the last two body writes, oldest first, as written
    runq_us: int = 0
    second_enter_ns: int = 0  # the second folded write (0: one write, or an older record)
    head: bytes = b""  # first bytes of the first folded write


@dataclass(slots=True)
class ProcEvent:
    kind: Kind
    pid: int
    ts_ns: int
    comm: str


Event = ConnEvent | DataEvent | ProcEvent | StreamEvent


class DecodeError(ValueError):
    """A record that does not match any known layout (counted, never fatal)."""


def format_address(family: int, raw: bytes) -> str:
    """Printable peer address; IPv4-mapped IPv6 is shown as IPv4."""
    if family == AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    if family == AF_INET6:
        addr = ipaddress.IPv6Address(raw[:16])
        return str(addr.ipv4_mapped or addr)
    return ""


def _decode_conn(raw: bytes) -> ConnEvent:
    c = ConnEventC.from_buffer_copy(raw[: ctypes.sizeof(ConnEventC)])
    return ConnEvent(
        kind=Kind(c.kind), pid=c.tgid, tid=c.tid, conn_id=c.conn_id, ts_ns=c.ts_ns, fd=c.fd,
        listen_fd=c.listen_fd, role=Role(c.role),
        peer_address=format_address(c.family, bytes(c.peer_addr)), peer_port=c.peer_port,
        comm=c.comm.decode("utf-8", "replace"), tls=bool(c.tls),
        bytes_in=c.bytes_in, bytes_out=c.bytes_out, local_port=c.local_port,
    )


_DATA_HDR = struct.Struct("<IIQQQQIiIIBBBBI")  # = DataEventHdrC, checked by a test
DIRECTIONS = tuple(Direction)  # members by their wire value (the tracer reads them too)
_SOURCES = tuple(Source)
ROLES = tuple(Role)


# a data record's header fields, in DataEventHdrC's order: kind, tgid, conn_id, enter and
# exit times, ssl, tid, fd, length, captured, direction, source, role, flags, runq_us
DataHeader = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int, int]


def data_header(raw: bytes) -> DataHeader:
    """A data record's header, checked against the record (DecodeError when its sizes or
    enum fields cannot be): the tracer reads the hot path's records from this, with no
    DataEvent in between (agent/tracing/pipeline.py); the payload is
    raw[DATA_HDR_SIZE:DATA_HDR_SIZE + captured]."""
    h: DataHeader = _DATA_HDR.unpack_from(raw)
    captured, length = h[9], h[8]
    if DATA_HDR_SIZE + captured > len(raw) or captured > length or h[10] > 1 or h[11] > 2 \
            or h[12] > 2:
        raise DecodeError(f"data record: captured={captured} len={length} size={len(raw)} "
                          f"direction={h[10]} source={h[11]} role={h[12]}")
    return h


def _decode_data(raw: bytes) -> DataEvent:
    (_, tgid, conn_id, t_enter, t_exit, ssl, tid, fd, length, captured, direction, source,
     role, flags, runq_us) = data_header(raw)
    # positional, in DataEvent's field order (keywords cost 0.7 µs more a record, two a span;
    # tests/unit/test_events.py checks every field of a decoded record)
    return DataEvent(
        tgid, tid, conn_id, fd, ssl, t_enter, t_exit, length, DIRECTIONS[direction],
        _SOURCES[source], ROLES[role], raw[DATA_HDR_SIZE:DATA_HDR_SIZE + captured], runq_us,
        flags & DATA_SAMPLE_SHIFT, bool(flags & DATA_GAP), bool(flags & DATA_LOST),
        bool(flags & DATA_TAIL),
    )


_STREAM_HDR = struct.Struct("<II11QIiIIIIHHBBBB")  # StreamEventC up to tail0, checked by a test
_STREAM_EXT = struct.Struct("<QH6x")  # StreamEventC after tail1, up to head
STREAM_SIZE = ctypes.sizeof(StreamEventC)
_STREAM_ENDS = {int(e): e for e in StreamEnd}


def _decode_stream(raw: bytes) -> StreamEvent:
    (_, tgid, conn_id, ssl, f_enter, f_exit, l_enter, l_exit, end_ns, max_gap, sum_gap, wire,
     body, tid, fd, writes, events, inexact, runq_us, len0, len1, last, end, role, source
     ) = _STREAM_HDR.unpack_from(raw)
    if end not in _STREAM_ENDS or role > 2 or source > 2 or last > 1 or max(len0, len1) > STREAM_TAIL:
        raise DecodeError(f"stream record: end={end} role={role} source={source} tails={len0},{len1}")
    base = _STREAM_HDR.size
    t0 = raw[base:base + len0]
    t1 = raw[base + STREAM_TAIL:base + STREAM_TAIL + len1]
    ext = base + 2 * STREAM_TAIL
    second, head = 0, b""
    if len(raw) >= ext + _STREAM_EXT.size:  # records before these fields end at tail1
        second, head_len = _STREAM_EXT.unpack_from(raw, ext)
        if head_len > STREAM_HEAD:
            raise DecodeError(f"stream record: head={head_len}")
        head = raw[ext + _STREAM_EXT.size:ext + _STREAM_EXT.size + head_len]
    return StreamEvent(
        pid=tgid, tid=tid, conn_id=conn_id, fd=fd, ssl=ssl, role=ROLES[role],
        source=_SOURCES[source], end=_STREAM_ENDS[end], writes=writes, events=events,
        inexact=inexact, first_enter_ns=f_enter, first_exit_ns=f_exit, last_enter_ns=l_enter,
        last_exit_ns=l_exit, end_ns=end_ns, max_gap_ns=max_gap, sum_gap_ns=sum_gap,
        wire_bytes=wire, body_bytes=body, tails=(t0, t1) if last == 1 else (t1, t0),
        runq_us=runq_us, second_enter_ns=second, head=head,
    )


def _decode_proc(raw: bytes) -> ProcEvent:
    p = ProcEventC.from_buffer_copy(raw[: ctypes.sizeof(ProcEventC)])
    return ProcEvent(kind=Kind(p.kind), pid=p.tgid, ts_ns=p.ts_ns,
                     comm=p.comm.decode("utf-8", "replace"))


_MIN_SIZE = {
    Kind.CONN_OPEN: ctypes.sizeof(ConnEventC),
    Kind.CONN_CLOSE: ctypes.sizeof(ConnEventC),
    Kind.DATA: DATA_HDR_SIZE,
    Kind.PROC_EXEC: ctypes.sizeof(ProcEventC),
    Kind.PROC_EXIT: ctypes.sizeof(ProcEventC),
    Kind.STREAM: STREAM_SIZE,
}


def decode(raw: bytes) -> Event:
    """One ring-buffer record to an event; DecodeError for anything malformed."""
    if raw[:4] == _DATA_KIND and len(raw) >= DATA_HDR_SIZE:
        return _decode_data(raw)
    if len(raw) < 4:
        raise DecodeError(f"record of {len(raw)} bytes")
    try:
        kind = Kind(int.from_bytes(raw[:4], "little"))
    except ValueError as exc:
        raise DecodeError(f"unknown record kind {raw[:4].hex()}") from exc
    if kind not in _MIN_SIZE:
        raise DecodeError(f"{kind.name} records are decoded by their own module")
    if len(raw) < _MIN_SIZE[kind]:
        raise DecodeError(f"{kind.name} record of {len(raw)} bytes")
    try:
        if kind is Kind.DATA:
            return _decode_data(raw)
        if kind in (Kind.CONN_OPEN, Kind.CONN_CLOSE):
            return _decode_conn(raw)
        if kind is Kind.STREAM:
            return _decode_stream(raw)
        return _decode_proc(raw)
    except ValueError as exc:  # an enum field out of range
        raise DecodeError(str(exc)) from exc
