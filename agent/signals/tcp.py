"""TCP signals from bpf/tcp.c: counters of a span's connection, node totals per second.

The kernel keeps the counters (per 4-tuple in `tcp_conns`, node totals in `tcp_totals`,
TIME_WAIT entries per port in `tcp_tw_ports`, lifetimes in `tcp_lifetime_us`); retransmits
and resets also arrive as EV_TCP_EVENT records, so a span can count those inside its window.

Span attributes (TcpSignals.annotate):
  sits.tcp.retransmits       retransmissions on the span's connection between the request's
                             first byte and the response's last byte, sent by either end when
                             both are on this host (a server's retransmits of its response's
                             tail come after its last write, so they are in the next counter)
  sits.tcp.conn.retransmits  sent by this side on the connection since it opened, up to the
                             moment the span is finished
  sits.tcp.resets            RSTs sent or received on the connection since it opened
  sits.tcp.srtt_us           the connection's smoothed RTT, when a segment arrived since it
                             was traced (tcp_probe copies it at most every 4 jiffies, 16 ms
                             at HZ=250, traced connections only), as read at most one
                             second before (the counters above are read again after every
                             retransmit or reset)
"""

from __future__ import annotations

import collections
import ctypes
import functools
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sits_trace.agent.capture.bpfmaps import MapAccess, u64
from sits_trace.agent.capture.events import DecodeError
from sits_trace.agent.capture.probes import Tracepoint
from sits_trace.agent.capture.wire import (
    Kind,
    TcpConnC,
    TcpEventC,
    TcpEventType,
    TcpKeyC,
    TcpPeerKeyC,
    TcpTotal,
    TwKeyC,
)
from sits_trace.agent.model import ConnInfo, Exchange, Role, Span

TCP_PROGRAM = "tcp.c"
TCP_TRACEPOINTS: tuple[Tracepoint, ...] = (
    Tracepoint("sock", "inet_sock_set_state", "tcp", False),
    Tracepoint("tcp", "tcp_retransmit_skb", "tcp", False),
    Tracepoint("tcp", "tcp_retransmit_synack", "tcp", False),
    Tracepoint("tcp", "tcp_send_reset", "tcp", False),
    Tracepoint("tcp", "tcp_receive_reset", "tcp", False),
    Tracepoint("tcp", "tcp_probe", "tcp", False),
)
TCP_TIMEWAIT_LEN_S = 60  # include/net/tcp.h: how long a TIME_WAIT socket lives
_WILDCARD = ("", "0.0.0.0", "::")


@functools.lru_cache(maxsize=4096)
def addr16(address: str) -> bytes:
    """The kernel's view of an address: IPv6, with IPv4 as v4-mapped (::ffff:a.b.c.d)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        return b"\x00" * 10 + b"\xff\xff" + ip.packed
    return ip.packed


@functools.lru_cache(maxsize=4096)
def format_addr16(raw: bytes) -> str:
    ip = ipaddress.IPv6Address(bytes(raw[:16]))
    return str(ip.ipv4_mapped or ip)


@dataclass(frozen=True, slots=True)
class TcpTuple:
    """A connection as this host sees it: local side first."""

    local_address: str
    local_port: int
    remote_address: str
    remote_port: int

    def key(self) -> bytes:
        return _tuple_key(self)

    def _key(self) -> bytes:
        k = TcpKeyC()
        k.laddr[:] = addr16(self.local_address)
        k.raddr[:] = addr16(self.remote_address)
        k.lport, k.rport = self.local_port, self.remote_port
        return bytes(k)

    def reversed(self) -> TcpTuple:
        return TcpTuple(self.remote_address, self.remote_port, self.local_address,
                        self.local_port)

    @classmethod
    def from_key(cls, raw: bytes) -> TcpTuple:
        k = TcpKeyC.from_buffer_copy(raw[: ctypes.sizeof(TcpKeyC)])
        return cls(format_addr16(bytes(k.laddr)), k.lport, format_addr16(bytes(k.raddr)), k.rport)


_RETRANS = (TcpEventType.RETRANS, TcpEventType.SYNACK_RETRANS)


@functools.lru_cache(maxsize=16384)
def _tuple_key(t: TcpTuple) -> bytes:
    """Map keys are built per span (twice: both directions): addresses parse once."""
    return t._key()


@functools.lru_cache(maxsize=16384)
def _both_keys(t: TcpTuple) -> tuple[bytes, bytes]:
    """The keys of a connection's two directions (per span: one cache lookup, no new tuple)."""
    return t.key(), t.reversed().key()


@dataclass(frozen=True, slots=True)
class TcpConnStats:
    opened_ns: int
    closed_ns: int
    retransmits: int
    srtt_us: int
    resets_in: int
    resets_out: int
    state: int
    active: bool
    time_wait: bool

    @classmethod
    def from_bytes(cls, raw: bytes) -> TcpConnStats:
        c = TcpConnC.from_buffer_copy(raw[: ctypes.sizeof(TcpConnC)])
        return cls(c.opened_ns, c.closed_ns, c.retransmits, c.srtt_us, c.resets_in,
                   c.resets_out, c.state, bool(c.active), bool(c.time_wait))


@dataclass(frozen=True, slots=True)
class TcpEvent:
    type: TcpEventType
    ts_ns: int
    conn: TcpTuple
    state: int
    reason: int


def decode_tcp_event(raw: bytes) -> TcpEvent:
    if len(raw) < ctypes.sizeof(TcpEventC):
        raise DecodeError(f"tcp event record of {len(raw)} bytes")
    e = TcpEventC.from_buffer_copy(raw[: ctypes.sizeof(TcpEventC)])
    if e.kind != Kind.TCP_EVENT:
        raise DecodeError(f"not a tcp event: kind {e.kind}")
    try:
        typ = TcpEventType(e.type)
    except ValueError as exc:
        raise DecodeError(f"tcp event type {e.type}") from exc
    return TcpEvent(typ, e.ts_ns, TcpTuple.from_key(bytes(e.key)), e.state, e.reason)


@dataclass(slots=True)
class TcpSample:
    """Node TCP numbers over one interval, for a feature frame."""

    interval_s: float
    rates: dict[str, float]  # per second, named after TcpTotal
    time_wait: dict[tuple[str, int], int]  # ("local"|"peer", port) -> sockets in TIME_WAIT now
    lifetime_us_log2: list[int]  # connections closed in the interval, by log2(lifetime in us)


@dataclass(slots=True)
class _TwHistory:
    samples: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)


class TcpSignals:
    """Reads bpf/tcp.c's maps and records; annotates spans; samples per-second numbers."""

    def __init__(self, maps: MapAccess, *, monotonic_ns: Callable[[], int] = time.monotonic_ns,
                 timewait_s: int = TCP_TIMEWAIT_LEN_S, max_conns: int = 4096,
                 events_per_conn: int = 64, stats_max_age_ns: int = 1_000_000_000) -> None:
        self.maps = maps
        self._now = monotonic_ns
        self._tw_ns = timewait_s * 1_000_000_000
        self._max_conns = max_conns
        self._per_conn = events_per_conn
        self._events: collections.OrderedDict[bytes, collections.deque[TcpEvent]] = \
            collections.OrderedDict()
        self._resolved: collections.OrderedDict[int, TcpTuple] = collections.OrderedDict()
        self._last_ns = self._now()
        self._last_totals = self._totals()
        self._last_life = self._lifetimes()
        self._tw: dict[tuple[str, int], _TwHistory] = {}
        # a connection's tcp_conns entry, read once and kept until a TCP event record
        # arrives (its retransmit and reset counters only move with one: tcp.c sends a
        # record each time) or for at most stats_max_age_ns (srtt). A lookup per span was a
        # bpf(2) call and a ctypes decode: a quarter of the agent's CPU when each batch of
        # records had one span per connection (1,000 connections: bench/flame.py --perf)
        self._conn_stats: dict[int | bytes, TcpConnStats | None] = {}
        self._stats_read_ns = self._now()
        self.stats_max_age_ns = stats_max_age_ns
        self.decode_errors = 0

    # ---- records ----

    def on_record(self, raw: bytes) -> None:
        """Tracer handler for EV_TCP_EVENT records."""
        try:
            ev = decode_tcp_event(raw)
        except DecodeError:
            self.decode_errors += 1
            return
        self._conn_stats.clear()  # a counter of tcp_conns moved: read the entries again
        key = ev.conn.key()
        q = self._events.get(key)
        if q is None:
            q = self._events[key] = collections.deque(maxlen=self._per_conn)
            if len(self._events) > self._max_conns:
                self._events.popitem(last=False)
        else:
            self._events.move_to_end(key)
        q.append(ev)

    def events_between(self, conn: TcpTuple, start_ns: int, end_ns: int) -> list[TcpEvent]:
        """Retransmits and resets of both directions of `conn` inside [start_ns, end_ns]."""
        events = self._events
        if not events:
            return []
        out: list[TcpEvent] = []
        for key in _both_keys(conn):
            q = events.get(key)
            if q:
                out.extend(e for e in q if start_ns <= e.ts_ns <= end_ns)
        if len(out) > 1:
            out.sort(key=lambda e: e.ts_ns)
        return out

    # ---- a span's connection ----

    def resolve(self, conn: ConnInfo) -> TcpTuple | None:
        """The 4-tuple of a traced connection, from what the agent knows and the kernel's
        indexes (server: peer address/port + local port; client: pid/fd at connect)."""
        if conn.conn_id and conn.conn_id in self._resolved:
            return self._resolved[conn.conn_id]
        t = self._resolve_server(conn) if conn.role is Role.SERVER else self._resolve_client(conn)
        if t is None and conn.local_port and conn.local_address not in _WILDCARD \
                and conn.peer_address:
            t = TcpTuple(conn.local_address, conn.local_port, conn.peer_address, conn.peer_port)
        if t is not None and conn.conn_id:
            self._resolved[conn.conn_id] = t
            if len(self._resolved) > self._max_conns:
                self._resolved.popitem(last=False)
        return t

    def _resolve_server(self, conn: ConnInfo) -> TcpTuple | None:
        if not (conn.local_port and conn.peer_address):
            return None
        pk = TcpPeerKeyC()
        pk.raddr[:] = addr16(conn.peer_address)
        pk.rport, pk.lport = conn.peer_port, conn.local_port
        raw = self.maps.lookup("tcp_peers", bytes(pk))
        if raw is None:
            return None
        return TcpTuple(format_addr16(raw), conn.local_port, conn.peer_address, conn.peer_port)

    def _resolve_client(self, conn: ConnInfo) -> TcpTuple | None:
        if conn.fd < 0:
            return None
        raw = self.maps.lookup("tcp_fd_conns", u64((conn.pid << 32) | conn.fd))
        if raw is None:
            return None
        t = TcpTuple.from_key(raw)
        if conn.peer_address and (addr16(conn.peer_address) != addr16(t.remote_address)
                                  or conn.peer_port != t.remote_port):
            return None  # the fd was reused for another connection
        return t

    def conn_stats(self, conn: TcpTuple) -> TcpConnStats | None:
        raw = self.maps.lookup("tcp_conns", conn.key())
        return TcpConnStats.from_bytes(raw) if raw is not None else None

    def new_batch(self) -> None:
        """Tracer batch observer: the next spans come from records read after this. The
        connections' entries are read again once they are stats_max_age_ns old (and after
        any TCP event record: on_record)."""
        now = self._now()
        if now - self._stats_read_ns >= self.stats_max_age_ns:
            self._conn_stats.clear()
            self._stats_read_ns = now

    def _stats_cached(self, conn: TcpTuple, conn_id: int = 0) -> TcpConnStats | None:
        """The connection's tcp_conns entry as last read (see new_batch; keyed by the
        tracer's connection id where there is one: no map key built per span)."""
        key: int | bytes = conn_id if conn_id else conn.key()
        try:
            return self._conn_stats[key]
        except KeyError:
            st = self._conn_stats[key] = self.conn_stats(conn)
            return st

    def annotate(self, ex: Exchange, span: Span) -> None:
        """Tracer annotator: the sits.tcp.* attributes (see the module docstring)."""
        conn = ex.conn
        cid = conn.conn_id
        t = self._resolved.get(cid) if cid else None
        if t is None:
            t = self.resolve(conn)
            if t is None:
                return
        retransmits = 0
        if self._events:  # retransmits and resets seen lately: any inside this span?
            end = ex.response.end_ns if ex.response is not None else ex.request.end_ns
            for e in self.events_between(t, ex.request.start_ns, end):
                if e.type in _RETRANS:
                    retransmits += 1
        attrs = span.attributes
        attrs["sits.tcp.retransmits"] = retransmits
        st = self._stats_cached(t, cid)
        if st is None:
            return
        attrs["sits.tcp.conn.retransmits"] = st.retransmits
        attrs["sits.tcp.resets"] = st.resets_in + st.resets_out
        if st.srtt_us:
            attrs["sits.tcp.srtt_us"] = st.srtt_us

    # ---- per-second numbers ----

    def _totals(self) -> list[int]:
        sums = self.maps.percpu_sums("tcp_totals")
        return [sums[i] if i < len(sums) else 0 for i in range(len(TcpTotal))]

    def totals(self) -> dict[str, int]:
        """Node counters since the programs loaded, named after TcpTotal (lower case)."""
        return {t.name.lower(): v for t, v in zip(TcpTotal, self._totals())}

    def _lifetimes(self) -> list[int]:
        out = [0] * 64
        for k, v in self.maps.items("tcp_lifetime_us"):
            slot = int.from_bytes(k[:4], "little")
            if 0 <= slot < 64:
                out[slot] = int.from_bytes(v[:8], "little")
        return out

    def time_wait_entries(self) -> dict[tuple[str, int], int]:
        """Cumulative TIME_WAIT entries by ("local"|"peer", port) since the programs loaded."""
        out: dict[tuple[str, int], int] = {}
        for k, v in self.maps.items("tcp_tw_ports"):
            tk = TwKeyC.from_buffer_copy(k[: ctypes.sizeof(TwKeyC)])
            out[("peer" if tk.side else "local", tk.port)] = int.from_bytes(v[:8], "little")
        return out

    def _time_wait_now(self, now: int) -> dict[tuple[str, int], int]:
        """Sockets in TIME_WAIT now, by port: entries within the last TIME_WAIT length (the
        kernel shows no TIME_WAIT ending, so this is exact to the sampling interval as long
        as none was recycled early)."""
        out: dict[tuple[str, int], int] = {}
        for port, total in self.time_wait_entries().items():
            h = self._tw.setdefault(port, _TwHistory())
            h.samples.append((now, total))
            while len(h.samples) > 1 and h.samples[1][0] <= now - self._tw_ns:
                h.samples.popleft()
            first_ns, first_total = h.samples[0]
            base = first_total if first_ns <= now - self._tw_ns else 0
            if total - base:
                out[port] = total - base
        return out

    def sample(self) -> TcpSample:
        now = self._now()
        dt = max((now - self._last_ns) / 1e9, 1e-9)
        totals = self._totals()
        rates = {t.name.lower(): (totals[t] - self._last_totals[t]) / dt for t in TcpTotal}
        life = self._lifetimes()
        hist = [max(0, a - b) for a, b in zip(life, self._last_life)]
        self._last_ns, self._last_totals, self._last_life = now, totals, life
        return TcpSample(dt, rates, self._time_wait_now(now), hist)
