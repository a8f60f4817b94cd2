"""The tracing pipeline: records -> events -> connections -> HTTP exchanges -> spans.

Everything it touches from outside is passed in: the event source (kernel ring
or a recording), the span sink, the /proc reader, the clock. It never raises
into its caller for bad input: a malformed record or byte stream is counted.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sits_trace.agent.capture.events import (
    DATA_GAP,
    DATA_HDR_SIZE,
    DATA_LOST,
    DATA_SAMPLE_SHIFT,
    DATA_TAIL,
    DIRECTIONS,
    ROLES,
    ConnEvent,
    DataEvent,
    DataHeader,
    DecodeError,
    Kind,
    ProcEvent,
    Source,
    StreamEnd,
    StreamEvent,
    data_header,
    decode,
)
from sits_trace.agent.capture.loader import EventSource
from sits_trace.agent.model import Chunk, ConnInfo, Direction, Exchange, Role, Span, StreamChunk
from sits_trace.agent.sinks import SpansSink

from .http1 import HttpConnParser, ParserStats
from .procfs import ProcFS
from .spans import SpanBuilder

_DATA_KIND = int(Kind.DATA).to_bytes(4, "little")
_SRC_TLS = int(Source.TLS)

SpanSink = Callable[[Span], None]  # one that also has `many` takes a batch (agent/sinks.py)
# adds attributes to a span from other signals (TCP, CPU, GPU) before it leaves the tracer
Annotator = Callable[[Exchange, Span], None]
# takes raw records of a kind this module does not decode (tcp.c, sched.c, cuda.c records)
RecordHandler = Callable[[bytes], None]

# userspace-assigned ids (connections found in /proc at start) live above the kernel's counter
PREFILL_ID_BASE = 1 << 62


@dataclass(slots=True)
class TracerStats:
    records: int = 0
    decode_errors: int = 0
    spans: int = 0
    spans_filtered: int = 0
    conns_opened: int = 0
    conns_closed: int = 0
    conns_active: int = 0
    orphan_data: int = 0  # data for a connection never seen opening (kept, conn made up)
    conns_replaced: int = 0  # a new connection on the fd of one whose close was lost
    conns_expired: int = 0  # idle connections whose fd is gone (their close was lost)
    capture_shift: int = 0  # load shedding: the kernel captures one exchange in 2**shift
    exchanges_shed: int = 0  # exchanges the kernel skipped (counted, not traced)
    conns_muted: int = 0  # connections with no HTTP whose bytes the kernel stopped sending
    parser: ParserStats = field(default_factory=ParserStats)


@dataclass(slots=True)
class _Conn:
    info: ConnInfo
    parser: HttpConnParser
    checked_ns: int = 0  # when /proc last showed its fd open (idle expiry)
    muted: bool = False  # its parser found no HTTP: the kernel was asked to stop sending it


class Tracer:
    def __init__(
        self,
        source: EventSource,
        sink: SpanSink,
        builder: SpanBuilder,
        *,
        procfs: ProcFS | None = None,
        port: int | None = None,
        on_process_exec: Callable[[int], None] | None = None,
        on_process_exit: Callable[[int, list[int]], None] | None = None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        idle_ns: int = 30_000_000_000,
        expire_ns: int = 30_000_000_000,
        annotators: Iterable[Annotator] = (),
        handlers: dict[int, RecordHandler] | None = None,
        shedding: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self.source = source
        self._shedding = shedding  # (capture shift, exchanges shed): from the loop's shedder
        self.sink = sink
        self.builder = builder
        self.procfs = procfs or ProcFS()
        self.port = port
        self.stats = TracerStats()
        self._conns: dict[int, _Conn] = {}
        self._tls_streams: dict[tuple[int, int], _Conn] = {}
        self._by_pid: dict[int, set[int]] = {}
        self._listeners: dict[tuple[int, int], tuple[str, int]] = {}
        self._exe: dict[int, str] = {}
        self._on_exec = on_process_exec
        self._on_exit = on_process_exit
        self._now = monotonic_ns
        self._idle_ns = idle_ns
        self._expire_ns = expire_ns  # a connection idle this long is checked in /proc
        self._by_fd: dict[tuple[int, int], int] = {}  # (pid, fd) -> conn_id
        self._next_sweep = 0
        self._prefill_id = PREFILL_ID_BASE
        self.annotators: list[Annotator] = list(annotators)
        self.handlers: dict[int, RecordHandler] = dict(handlers or {})  # by kind; never DATA
        # called before each batch of records (e.g. to drop what an annotator read from
        # the kernel for the previous batch's spans)
        self.batch_observers: list[Callable[[], None]] = []
        # called after each poll and after close_all, once the spans they made were given
        # to the sink (e.g. a printer writing out the lines it held: one write per batch)
        self.poll_observers: list[Callable[[], None]] = []
        self._batch: list[Span] | None = None  # spans of the batch process() is parsing
        # (pid, fd, conn_id) -> whether the kernel will send no more of the connection's
        # reads and writes (Kernel.mute_conn); None: every byte keeps coming
        self.mute: Callable[[int, int, int], bool] | None = None

    # ---- driving ----

    def poll(self, timeout_ms: int = 50) -> int:
        recs = self.source.read(timeout_ms)
        self.process(recs)
        now = self._now()
        if now >= self._next_sweep:
            self.sweep(now)
            self._next_sweep = now + 1_000_000_000
            self._read_shedding()
        for done in self.poll_observers:
            done()
        return len(recs)

    def _read_shedding(self) -> None:
        """The kernel's load-shedding state into the stats (when the loop sheds load)."""
        if self._shedding is not None:
            self.stats.capture_shift, self.stats.exchanges_shed = self._shedding()

    def process(self, records: Iterable[bytes]) -> None:
        """Records in; the spans they complete go to the sink together, once the batch is
        parsed (its `many` if it has one: one call per batch, not per span)."""
        batch: list[Span] = []
        self._batch = batch
        try:
            self._process(records)
        finally:
            self._batch = None
            if batch:
                self._deliver(batch)

    def _deliver(self, spans: list[Span]) -> None:
        """Never raises: a sink that does is counted (parser.internal_errors), as the parser
        counts an emit callback that raised, and the spans after it still go out."""
        sink = self.sink
        many: SpansSink | None = getattr(sink, "many", None)
        if many is not None:
            try:
                many(spans)
            except Exception:  # noqa: BLE001 - a sink's bug must not stop the pipeline
                self.stats.parser.internal_errors += 1
            return
        for span in spans:
            try:
                sink(span)
            except Exception:  # noqa: BLE001
                self.stats.parser.internal_errors += 1

    def _process(self, records: Iterable[bytes]) -> None:
        for begin in self.batch_observers:
            begin()
        handlers = self.handlers
        for raw in records:
            self.stats.records += 1
            head = raw[:4]
            if head == _DATA_KIND and len(raw) >= DATA_HDR_SIZE:
                # the hot path, two records a request: read straight from the header, no
                # DataEvent made (decode() makes one for everything else that reads them)
                try:
                    fields = data_header(raw)
                except DecodeError:
                    self.stats.decode_errors += 1
                    continue
                self._on_data(raw, fields)
                continue
            if handlers and len(raw) >= 4:  # the records of tcp.c, sched.c, cuda.c
                h = handlers.get(int.from_bytes(head, "little"))
                if h is not None:
                    h(raw)
                    continue
            try:
                ev = decode(raw)
            except DecodeError:
                self.stats.decode_errors += 1
                continue
            if isinstance(ev, DataEvent):  # not reached: the path above takes them all
                self._on_data(raw, data_header(raw))
            elif isinstance(ev, ConnEvent):
                self._on_conn(ev)
            elif isinstance(ev, StreamEvent):
                self._on_stream(ev)
            else:
                self._on_proc(ev)

    def sweep(self, now_ns: int) -> None:
        """Let parsers give up on exchanges stuck longer than idle_ns; forget connections
        idle longer than expire_ns whose fd no longer holds a socket (a lost close)."""
        for c in list(self._conns.values()) + list(self._tls_streams.values()):
            c.parser.flush_idle(now_ns, self._idle_ns)
        self._expire(now_ns)

    def _expire(self, now_ns: int, budget: int = 2000) -> None:
        """At most `budget` /proc checks a sweep, so a huge table costs a bounded slice."""
        for cid, c in list(self._conns.items()):
            if budget <= 0:
                return
            if now_ns - max(c.parser.last_ns, c.checked_ns) < self._expire_ns or c.info.fd < 0:
                continue
            budget -= 1
            if self.procfs.socket_inode(c.info.pid, c.info.fd) is not None:
                c.checked_ns = now_ns  # an idle keep-alive connection: looked at again later
                continue
            self.stats.conns_expired += 1
            self._forget(cid, c)
            c.parser.close(now_ns)
        self.stats.conns_active = len(self._conns)

    def _forget(self, cid: int, c: _Conn) -> None:
        self._conns.pop(cid, None)
        self._by_pid.get(c.info.pid, set()).discard(cid)
        if self._by_fd.get((c.info.pid, c.info.fd)) == cid:
            del self._by_fd[(c.info.pid, c.info.fd)]

    def traced_pids(self) -> list[int]:
        """Processes that made or took a traced connection and have not exited."""
        return list(self._by_pid)

    def close_all(self) -> None:
        """Graceful stop: every pending exchange is emitted."""
        self._read_shedding()
        now = self._now()
        for c in list(self._conns.values()) + list(self._tls_streams.values()):
            c.parser.close(now)
        self._conns.clear()
        self._tls_streams.clear()
        self._by_pid.clear()
        self._by_fd.clear()
        self.stats.conns_active = 0
        for done in self.poll_observers:
            done()

    # ---- connections ----

    def _new_conn(self, info: ConnInfo) -> _Conn:
        return _Conn(info, HttpConnParser(info, self._emit, stats=self.stats.parser))

    def _exe_name(self, pid: int, comm: str) -> str:
        name = self._exe.get(pid)
        if name is None:
            name = self.procfs.exe_name(pid) or comm
            self._exe[pid] = name
        return name

    def _listener(self, pid: int, lfd: int) -> tuple[str, int]:
        key = (pid, lfd)
        hit = self._listeners.get(key)
        if hit is None:
            hit = ("", 0)
            ino = self.procfs.socket_inode(pid, lfd) if lfd >= 0 else None
            if ino is not None:
                sock = self.procfs.tcp_socket(pid, ino)
                if sock is not None:
                    hit = (sock.local_address, sock.local_port)
            self._listeners[key] = hit
        return hit

    def _on_conn(self, ev: ConnEvent) -> None:
        if ev.kind is Kind.CONN_OPEN:
            info = ConnInfo(conn_id=ev.conn_id, pid=ev.pid, fd=ev.fd, role=ev.role,
                            opened_ns=ev.ts_ns, peer_address=ev.peer_address,
                            peer_port=ev.peer_port, comm=self._exe_name(ev.pid, ev.comm))
            if ev.role is Role.SERVER:
                info.local_address, info.local_port = self._listener(ev.pid, ev.listen_fd)
            if ev.local_port:  # the kernel read it off the socket (bpf/http.c socket walk)
                info.local_port = ev.local_port
            # a client's own port is not needed (server.* is its peer): /proc only for what a
            # span shows and the probes could not see
            if not info.peer_address or (ev.role is Role.SERVER and not info.local_port):
                self._from_proc(info)
            self._add(info)
            return
        c = self._conns.get(ev.conn_id)
        if c is None:
            return
        self._forget(ev.conn_id, c)
        self.stats.conns_closed += 1
        self.stats.conns_active = len(self._conns)
        if ev.tls or c.info.tls:
            c.info.tls = True
            self._drop_tls_streams(ev.pid, c.info)
        c.parser.close(ev.ts_ns)

    def _from_proc(self, info: ConnInfo) -> None:
        """Addresses the probes could not see (accept() entered before the agent started)."""
        ino = self.procfs.socket_inode(info.pid, info.fd)
        sock = self.procfs.tcp_socket(info.pid, ino) if ino is not None else None
        if sock is None:
            return
        if info.role is Role.SERVER and not info.local_port:
            info.local_address, info.local_port = sock.local_address, sock.local_port
        if not info.peer_address:
            info.peer_address, info.peer_port = sock.remote_address, sock.remote_port

    def _add(self, info: ConnInfo) -> _Conn:
        c = self._new_conn(info)
        old = self._conns.pop(info.conn_id, None)
        if old is not None:
            old.parser.close(info.opened_ns)
        key = (info.pid, info.fd)
        prev = self._by_fd.get(key)
        if prev is not None and prev != info.conn_id and info.fd >= 0:
            stale = self._conns.get(prev)  # the fd was closed and reused: that close was lost
            if stale is not None:
                self.stats.conns_replaced += 1
                self._forget(prev, stale)
                stale.parser.close(info.opened_ns)
        self._conns[info.conn_id] = c
        self._by_pid.setdefault(info.pid, set()).add(info.conn_id)
        if info.fd >= 0:
            self._by_fd[key] = info.conn_id
        self.stats.conns_opened += 1
        self.stats.conns_active = len(self._conns)
        return c

    def _drop_tls_streams(self, pid: int, info: ConnInfo) -> None:
        for key in [k for k, s in self._tls_streams.items() if s.info is info]:
            del self._tls_streams[key]

    def _on_proc(self, ev: ProcEvent) -> None:
        if ev.kind is Kind.PROC_EXEC:
            self._exe.pop(ev.pid, None)
            if self._on_exec is not None:
                self._on_exec(ev.pid)
            return
        ids = self._by_pid.pop(ev.pid, set())
        fds = []
        for cid in ids:
            c = self._conns.pop(cid, None)
            if c is not None:
                self._by_fd.pop((c.info.pid, c.info.fd), None)
                fds.append(c.info.fd)
                c.parser.close(ev.ts_ns)
        for key in [k for k in self._tls_streams if k[0] == ev.pid]:
            self._tls_streams.pop(key).parser.close(ev.ts_ns)
        self._exe.pop(ev.pid, None)
        self._listeners = {k: v for k, v in self._listeners.items() if k[0] != ev.pid}
        self.stats.conns_active = len(self._conns)
        if self._on_exit is not None:
            self._on_exit(ev.pid, fds)  # fds may be empty: a process with per-pid state only

    # ---- data ----

    def _conn_for(self, conn_id: int, pid: int, fd: int, role: int, ssl: int) -> _Conn:
        if conn_id:
            c = self._conns.get(conn_id)
            if c is not None:
                return c
            self.stats.orphan_data += 1
            info = ConnInfo(conn_id=conn_id, pid=pid, fd=fd, role=ROLES[role],
                            comm=self._exe_name(pid, ""))
            return self._add(info)
        # TLS plaintext whose socket is unknown: one stream per SSL*
        key = (pid, ssl)
        c = self._tls_streams.get(key)
        if c is None:
            info = ConnInfo(conn_id=0, pid=pid, fd=-1, role=ROLES[role], tls=True,
                            comm=self._exe_name(pid, ""))
            c = self._new_conn(info)
            self._tls_streams[key] = c
        return c

    def _on_data(self, raw: bytes, h: DataHeader) -> None:
        """A read or write (a data record and its checked header: events.data_header)."""
        (_, pid, conn_id, t_enter, t_exit, ssl, tid, fd, length, captured, direction, source,
         role, flags, runq_us) = h
        c = self._conn_for(conn_id, pid, fd, role, ssl)
        if source == _SRC_TLS:
            if not c.info.tls:
                # the handshake's ciphertext came first: start over on the plaintext
                c.info.tls = True
                c.parser = HttpConnParser(c.info, self._emit, stats=self.stats.parser)
        elif c.info.tls:
            return  # ciphertext of a TLS connection: its plaintext comes from the uprobes
        if flags & DATA_LOST:
            c.parser.lost()  # records lost in the ring: resync, the pending exchange is a gap
        elif flags & DATA_GAP:
            c.parser.gap()
        c.info.sample_shift = flags & DATA_SAMPLE_SHIFT
        parser = c.parser
        parser.feed(Chunk(DIRECTIONS[direction], t_enter, t_exit,
                          raw[DATA_HDR_SIZE:DATA_HDR_SIZE + captured], length,
                          bool(flags & DATA_TAIL), tid, runq_us))
        if parser.opaque and not c.muted:
            self._mute(c)

    def _mute(self, c: _Conn) -> None:
        """No HTTP on this connection (another protocol, a tunnel, TLS nobody probes): ask
        the kernel to stop sending its bytes, once. Not for TLS plaintext (uprobes: the mute
        is on the socket path only) nor a connection the kernel does not know by fd."""
        c.muted = True
        info = c.info
        if self.mute is None or info.tls or not info.conn_id or info.fd < 0:
            return
        try:
            if self.mute(info.pid, info.fd, info.conn_id):
                self.stats.conns_muted += 1
        except Exception:  # noqa: BLE001 - a map the kernel refused: the bytes keep coming
            pass

    def _on_stream(self, ev: StreamEvent) -> None:
        """A streamed response's body writes, folded in the kernel (bpf/stream.h)."""
        c = self._conns.get(ev.conn_id) if ev.conn_id else self._tls_streams.get((ev.pid, ev.ssl))
        if c is None:
            self.stats.parser.stream_orphans += 1
            return
        complete = ev.end in (StreamEnd.TERMINATOR, StreamEnd.NEXT)
        c.parser.feed_stream(StreamChunk(
            Direction.EGRESS, ev.writes, ev.events, ev.first_enter_ns, ev.last_exit_ns,
            ev.max_gap_ns, ev.body_bytes, ev.wire_bytes, ev.end_ns, complete, ev.tails,
            ev.head, ev.second_enter_ns))

    # ---- spans ----

    def _emit(self, ex: Exchange) -> None:
        if self.port is not None:
            port = ex.conn.local_port if ex.conn.role is Role.SERVER else ex.conn.peer_port
            if port != self.port:
                self.stats.spans_filtered += 1
                return
        span = self.builder.build(ex)
        for annotate in self.annotators:
            annotate(ex, span)
        self.stats.spans += 1
        batch = self._batch
        if batch is not None:
            batch.append(span)  # delivered at the end of process()
        else:
            self.sink(span)  # sweep() and close_all(): outside a batch

    # ---- connections open before the agent ----

    def prefill(self, pids: Iterable[int], register: Callable[[int, int, int, int], None]) -> int:
        """Register established TCP connections of `pids` found in /proc; returns how many."""
        n = 0
        for pid in pids:
            fds = self.procfs.socket_fds(pid)
            if not fds:
                continue
            socks = self.procfs.tcp_sockets(pid)
            listening = {s.local_port for s in socks.values() if s.state == 0x0A}
            for fd, ino in fds.items():
                s = socks.get(ino)
                if s is None or s.state != 0x01:
                    continue
                role = Role.SERVER if s.local_port in listening else Role.CLIENT
                self._prefill_id += 1
                info = ConnInfo(conn_id=self._prefill_id, pid=pid, fd=fd, role=role,
                                peer_address=s.remote_address, peer_port=s.remote_port,
                                local_address=s.local_address, local_port=s.local_port,
                                comm=self._exe_name(pid, ""))
                register(pid, fd, info.conn_id, int(role))
                self._add(info)
                n += 1
        return n


_SWEEP_S = 10.0  # a module constant: mypyc rejects a default naming a class attribute


class Rescans:
    """Processes to look at again for new libraries, at growing delays after exec
    (interpreters load libssl late, when the program first imports ssl), and every
    `sweep_s` each process with traced connections (a private libssl dlopen()ed any time
    later, by a process the agent found already running)."""

    DELAYS_S = (0.0, 0.2, 1.0, 5.0, 20.0)  # 0: a program with OpenSSL inside (node) at once
    SWEEP_S = _SWEEP_S

    def __init__(self, check: Callable[[int], None],
                 monotonic: Callable[[], float] = time.monotonic,
                 traced: Callable[[], Iterable[int]] = tuple, sweep_s: float = _SWEEP_S) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._check = check
        self._now = monotonic
        self._traced = traced
        self._sweep_s = sweep_s
        self._next_sweep = monotonic() + sweep_s

    def schedule(self, pid: int) -> None:
        t = self._now()
        for i, d in enumerate(self.DELAYS_S):
            heapq.heappush(self._heap, (t + d, pid, i))

    def run_due(self) -> None:
        now = self._now()
        while self._heap and self._heap[0][0] <= now:
            _, pid, _ = heapq.heappop(self._heap)
            self._check(pid)
        if now >= self._next_sweep:
            self._next_sweep = now + self._sweep_s
            for pid in self._traced():
                self._check(pid)
