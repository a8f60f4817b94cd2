"""The wire contract: one Python mirror of every record, map key/value and enum of bpf/.

Records (ring buffer), map keys and values the agent reads or writes are ctypes structures
here and nowhere else; the C enums and flag constants are IntEnums and integers here and
nowhere else. The modules that decode them (capture/events.py, signals/tcp.py,
signals/sched.py, signals/cuda) import from this one.

`STRUCTS`, `ENUMS` and `CONSTANTS` name the C side of each mirror, so that
tests/integration/test_layout.py can compile every bpf/*.c with BCC and compare sizes, field
offsets and enum values with what the compiler derives, and tests/unit/test_wire.py can check
without root that every struct and enum constant of bpf/ is mirrored or declared kernel-only.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from sits_trace.agent.model import Role

TASK_COMM_LEN = 16
AF_INET = 2
AF_INET6 = 10
DATA_SAMPLE_SHIFT = 0x1F  # struct data_event flags: this exchange stands for 2^shift
DATA_GAP = 0x80  # struct data_event flags: whole exchanges were skipped before it
DATA_LOST = 0x40  # struct data_event flags: records of the connection were lost before it
DATA_TAIL = 0x20  # struct data_event flags: the payload is the last bytes of what moved
RUNQ_SLOTS = 32  # sched.c: log2 buckets of runq_hist


# ---- events.h ----

class Kind(enum.IntEnum):
    CONN_OPEN = 1
    CONN_CLOSE = 2
    DATA = 3
    PROC_EXEC = 4
    PROC_EXIT = 5
    TCP_EVENT = 6  # decoded by signals/tcp.py
    CUDA_COPY = 9  # decoded by signals/cuda
    CUDA_MEM = 10  # decoded by signals/cuda
    CUDA_INIT = 11  # decoded by signals/cuda
    STREAM = 12  # the folded body writes of a streamed response (bpf/stream.h)


class StreamEnd(enum.IntEnum):
    """Why the kernel sent a stream summary (bpf/stream.h enum stream_end)."""

    TERMINATOR = 1  # a write ended with the chunked terminator: the response is complete
    NEXT = 2  # the next request was read (or the next response began): the response had ended
    CLOSE = 3  # the connection closed
    FLUSH = 4  # time, or a write it could not fold: more of the response follows


class Source(enum.IntEnum):
    SYSCALL = 0
    TLS = 1
    SENDFILE = 2


class ConnEventC(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("conn_id", ctypes.c_uint64),
        ("ts_ns", ctypes.c_uint64),
        ("bytes_in", ctypes.c_uint64),
        ("bytes_out", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("fd", ctypes.c_int32),
        ("listen_fd", ctypes.c_int32),
        ("family", ctypes.c_uint16),
        ("peer_port", ctypes.c_uint16),
        ("peer_addr", ctypes.c_uint8 * 16),
        ("comm", ctypes.c_char * TASK_COMM_LEN),
        ("role", ctypes.c_uint8),
        ("tls", ctypes.c_uint8),
        ("local_port", ctypes.c_uint16),
        ("_pad", ctypes.c_uint8 * 4),
    ]


class DataEventHdrC(ctypes.Structure):
    """struct data_event without its payload array."""

    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("conn_id", ctypes.c_uint64),
        ("ts_enter_ns", ctypes.c_uint64),
        ("ts_exit_ns", ctypes.c_uint64),
        ("ssl", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("fd", ctypes.c_int32),
        ("len", ctypes.c_uint32),
        ("captured", ctypes.c_uint32),
        ("direction", ctypes.c_uint8),
        ("source", ctypes.c_uint8),
        ("role", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("runq_us", ctypes.c_uint32),
    ]


class ProcEventC(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("ts_ns", ctypes.c_uint64),
        ("comm", ctypes.c_char * TASK_COMM_LEN),
    ]



DATA_HDR_SIZE = ctypes.sizeof(DataEventHdrC)
STREAM_TAIL = 1024  # SITS_STREAM_TAIL: bytes kept of each of a stream's last two writes
STREAM_HEAD = 384  # SITS_STREAM_HEAD: bytes kept of a stream's first folded write


class StreamEventC(ctypes.Structure):
    """struct stream_event (EV_STREAM): a streamed response's body writes, folded."""

    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("conn_id", ctypes.c_uint64),
        ("ssl", ctypes.c_uint64),
        ("first_enter_ns", ctypes.c_uint64),
        ("first_exit_ns", ctypes.c_uint64),
        ("last_enter_ns", ctypes.c_uint64),
        ("last_exit_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        ("max_gap_ns", ctypes.c_uint64),
        ("sum_gap_ns", ctypes.c_uint64),
        ("wire_bytes", ctypes.c_uint64),
        ("body_bytes", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("fd", ctypes.c_int32),
        ("writes", ctypes.c_uint32),
        ("events", ctypes.c_uint32),
        ("inexact", ctypes.c_uint32),
        ("runq_us", ctypes.c_uint32),
        ("tail0_len", ctypes.c_uint16),
        ("tail1_len", ctypes.c_uint16),
        ("tail_last", ctypes.c_uint8),
        ("end", ctypes.c_uint8),
        ("role", ctypes.c_uint8),
        ("source", ctypes.c_uint8),
        ("tail0", ctypes.c_char * STREAM_TAIL),
        ("tail1", ctypes.c_char * STREAM_TAIL),
        ("second_enter_ns", ctypes.c_uint64),
        ("head_len", ctypes.c_uint16),
        ("_pad2", ctypes.c_uint8 * 6),
        ("head", ctypes.c_char * STREAM_HEAD),
    ]


class ConnStateC(ctypes.Structure):
    """struct conn_state: a traced connection (map `conns`, key tgid << 32 | fd)."""

    _fields_ = [
        ("conn_id", ctypes.c_uint64),
        ("bytes_in", ctypes.c_uint64),
        ("bytes_out", ctypes.c_uint64),
        ("ssl", ctypes.c_uint64),
        ("role", ctypes.c_uint8),
        ("tls", ctypes.c_uint8),
        ("last_dir", ctypes.c_uint8),
        ("skip", ctypes.c_uint8),
        ("gap", ctypes.c_uint8),
        ("shift", ctypes.c_uint8),
        ("lost", ctypes.c_uint8),
        ("dribble", ctypes.c_uint8),
        ("agg", ctypes.c_uint8),
        ("tail", ctypes.c_uint8),
        ("fold", ctypes.c_uint8),
        ("mute", ctypes.c_uint8),
        ("sk_known", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 3),
        ("run", ctypes.c_uint64),
    ]


class RunqThreadC(ctypes.Structure):
    _fields_ = [
        ("delay_ns", ctypes.c_uint64),
        ("count", ctypes.c_uint64),
        ("tgid", ctypes.c_uint32),
        ("untimed", ctypes.c_uint32),
    ]



# ---- sched.c ----

class RunqProcC(ctypes.Structure):
    _fields_ = [("delay_ns", ctypes.c_uint64), ("count", ctypes.c_uint64)]


class RunqHistKeyC(ctypes.Structure):
    _fields_ = [("tgid", ctypes.c_uint32), ("slot", ctypes.c_uint32)]



# ---- tcp.c ----

class TcpKeyC(ctypes.Structure):
    _fields_ = [
        ("laddr", ctypes.c_uint8 * 16),
        ("raddr", ctypes.c_uint8 * 16),
        ("lport", ctypes.c_uint16),
        ("rport", ctypes.c_uint16),
    ]


class TcpConnC(ctypes.Structure):
    _fields_ = [
        ("opened_ns", ctypes.c_uint64),
        ("closed_ns", ctypes.c_uint64),
        ("retransmits", ctypes.c_uint64),
        ("srtt_us", ctypes.c_uint32),
        ("resets_in", ctypes.c_uint32),
        ("resets_out", ctypes.c_uint32),
        ("state", ctypes.c_uint8),
        ("active", ctypes.c_uint8),
        ("time_wait", ctypes.c_uint8),
        ("rst_pending", ctypes.c_uint8),
    ]


class TcpEventC(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("state", ctypes.c_uint32),
        ("ts_ns", ctypes.c_uint64),
        ("key", TcpKeyC),
        ("type", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8),
        ("reason", ctypes.c_uint16),
    ]


class TcpPeerKeyC(ctypes.Structure):
    _fields_ = [
        ("raddr", ctypes.c_uint8 * 16),
        ("rport", ctypes.c_uint16),
        ("lport", ctypes.c_uint16),
    ]



class TcpAddrC(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint8 * 16)]


class TwKeyC(ctypes.Structure):
    _fields_ = [("port", ctypes.c_uint16), ("side", ctypes.c_uint8), ("_pad", ctypes.c_uint8)]


class TcpEventType(enum.IntEnum):
    RETRANS = 1
    SYNACK_RETRANS = 2
    RST_OUT = 3
    RST_IN = 4


class TcpTotal(enum.IntEnum):
    """Index of `tcp_totals`; the names become the per-second rates' names."""

    RETRANSMITS = 0
    RETRANSMIT_FAILURES = 1
    SYNACK_RETRANSMITS = 2
    RESETS_OUT = 3
    RESETS_IN = 4
    OPENS_ACTIVE = 5
    OPENS_PASSIVE = 6
    CLOSES = 7
    TIME_WAIT_ENTRIES = 8
    RTT_SAMPLES = 9
    EVENTS_UNSENT = 10  # retransmit/reset records over tcp.c's SITS_TCP_EVENTS_PER_S, counted only


class TcpState(enum.IntEnum):
    ESTABLISHED = 1
    SYN_SENT = 2
    SYN_RECV = 3
    FIN_WAIT1 = 4
    FIN_WAIT2 = 5
    TIME_WAIT = 6
    CLOSE = 7
    CLOSE_WAIT = 8
    LAST_ACK = 9
    LISTEN = 10
    CLOSING = 11
    NEW_SYN_RECV = 12



# ---- cuda.c ----

class CopyDir(enum.IntEnum):
    UNKNOWN = 0
    H2D = 1
    D2H = 2
    D2D = 3


class CudaApi(enum.IntEnum):
    """bpf/cuda.c enum cuda_api: the entry point a call came through."""

    MEMCPY_HTOD = 1
    MEMCPY_DTOH = 2
    MEMCPY_DTOD = 3
    MEMCPY = 4
    MEMCPY_HTOD_ASYNC = 5
    MEMCPY_DTOH_ASYNC = 6
    MEMCPY_DTOD_ASYNC = 7
    MEMCPY_ASYNC = 8
    STREAM_SYNC = 16
    CTX_SYNC = 17
    EVENT_SYNC = 18
    MEM_ALLOC = 32
    MEM_ALLOC_ASYNC = 33
    MEM_ALLOC_MANAGED = 34
    MEM_HOST_ALLOC = 35
    MEM_ALLOC_HOST = 36
    MEM_HOST_REGISTER = 37
    MEM_MAP = 38
    MEM_FREE = 48
    MEM_FREE_ASYNC = 49
    MEM_FREE_HOST = 50
    MEM_HOST_UNREGISTER = 51
    MEM_UNMAP = 52


class MemKind(enum.IntEnum):
    DEVICE = 1
    HOST = 2  # pinned host memory allocated by the driver
    MANAGED = 3
    REGISTERED = 4  # pinned host memory registered with cuMemHostRegister
    MAPPED = 5  # device memory mapped with cuMemMap (virtual memory management)


class MemOp(enum.IntEnum):
    ALLOC = 1
    FREE = 2


class CudaCopyEventC(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("ts_enter_ns", ctypes.c_uint64),
        ("ts_exit_ns", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("dst", ctypes.c_uint64),
        ("src", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("result", ctypes.c_int32),
        ("direction", ctypes.c_uint8),
        ("api", ctypes.c_uint8),
        ("is_async", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 5),
    ]


class CudaMemEventC(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("ts_ns", ctypes.c_uint64),
        ("ptr", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("result", ctypes.c_int32),
        ("op", ctypes.c_uint8),
        ("mem", ctypes.c_uint8),
        ("api", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 5),
    ]


class CudaInitEventC(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("tgid", ctypes.c_uint32),
        ("ts_ns", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
    ]


class CudaProcC(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "launches", "graph_launches", "h2d_bytes", "h2d_copies", "d2h_bytes", "d2h_copies",
        "d2d_bytes", "d2d_copies", "other_bytes", "other_copies", "copy_call_ns", "sync_ns",
        "syncs", "failed")]


class CudaSlotKeyC(ctypes.Structure):
    _fields_ = [("slot", ctypes.c_uint64), ("tgid", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


class CudaSlotC(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("launches", "graph_launches", "syncs", "sync_ns",
                                               "first_ns", "last_ns")]



# ---- what the layout tests compare ----

Structure = type[ctypes.Structure]

# C struct -> (the bpf/ file that defines it, its mirror). struct data_event's mirror leaves out
# its payload array: sizeof(struct data_event) == DATA_HDR_SIZE + SITS_MAX_PAYLOAD.
STRUCTS: Mapping[str, tuple[str, Structure]] = {
    "conn_event": ("events.h", ConnEventC),
    "data_event": ("events.h", DataEventHdrC),
    "proc_event": ("events.h", ProcEventC),
    "stream_event": ("events.h", StreamEventC),
    "conn_state": ("events.h", ConnStateC),
    "runq_thread": ("events.h", RunqThreadC),
    "runq_proc": ("sched.c", RunqProcC),
    "runq_hist_key": ("sched.c", RunqHistKeyC),
    "tcp_key": ("tcp.c", TcpKeyC),
    "tcp_conn": ("tcp.c", TcpConnC),
    "tcp_event": ("tcp.c", TcpEventC),
    "tcp_peer_key": ("tcp.c", TcpPeerKeyC),
    "tcp_addr": ("tcp.c", TcpAddrC),
    "tw_key": ("tcp.c", TwKeyC),
    "cuda_copy_event": ("cuda.c", CudaCopyEventC),
    "cuda_mem_event": ("cuda.c", CudaMemEventC),
    "cuda_init_event": ("cuda.c", CudaInitEventC),
    "cuda_proc": ("cuda.c", CudaProcC),
    "cuda_slot_key": ("cuda.c", CudaSlotKeyC),
    "cuda_slot": ("cuda.c", CudaSlotC),
}
# structs that never leave the kernel: per-call and per-thread scratch state
KERNEL_ONLY = frozenset({"accept_args", "connect_args", "io_args", "ssl_active", "thread_io",
                         "read_prefix", "ssl_key", "data_scratch_t", "cuda_call", "body_fold",
                         "tcp_ev_rate_t"})


@dataclass(frozen=True, slots=True)
class CEnum:
    """A C enum and its mirror: C constant -> member (`sentinels`: C-only bounds)."""

    file: str
    py: type[enum.IntEnum]
    members: Mapping[str, enum.IntEnum]
    sentinels: tuple[str, ...] = ()


def _prefixed(file: str, prefix: str, py: type[enum.IntEnum], *sentinels: str) -> CEnum:
    return CEnum(file, py, {f"{prefix}{m.name}": m for m in py}, sentinels)


ENUMS: Mapping[str, CEnum] = {
    "sits_kind": _prefixed("events.h", "EV_", Kind, "EV_KIND_MAX"),
    "sits_source": _prefixed("events.h", "SRC_", Source),
    "sits_role": _prefixed("events.h", "ROLE_", Role),
    "stream_end": _prefixed("stream.h", "STREAM_END_", StreamEnd),
    "sits_tcp_state": _prefixed("tcp.c", "ST_", TcpState),
    "sits_tcp_ev": _prefixed("tcp.c", "TCP_EV_", TcpEventType),
    "sits_tcp_total": CEnum("tcp.c", TcpTotal, {
        "TT_RETRANS": TcpTotal.RETRANSMITS, "TT_RETRANS_FAIL": TcpTotal.RETRANSMIT_FAILURES,
        "TT_SYNACK_RETRANS": TcpTotal.SYNACK_RETRANSMITS, "TT_RST_OUT": TcpTotal.RESETS_OUT,
        "TT_RST_IN": TcpTotal.RESETS_IN, "TT_OPEN_ACTIVE": TcpTotal.OPENS_ACTIVE,
        "TT_OPEN_PASSIVE": TcpTotal.OPENS_PASSIVE, "TT_CLOSE": TcpTotal.CLOSES,
        "TT_TIME_WAIT": TcpTotal.TIME_WAIT_ENTRIES, "TT_RTT_SAMPLES": TcpTotal.RTT_SAMPLES,
        "TT_EVENTS_UNSENT": TcpTotal.EVENTS_UNSENT,
    }, ("TT_MAX",)),
    "cuda_dir": _prefixed("cuda.c", "CD_", CopyDir),
    "cuda_api": _prefixed("cuda.c", "CA_", CudaApi),
    "cuda_mem_kind": _prefixed("cuda.c", "CM_", MemKind),
    "cuda_mem_op": _prefixed("cuda.c", "CMO_", MemOp),
}
# enums of bpf/ that stay in the kernel (tracepoint argument types)
KERNEL_ONLY_ENUMS = frozenset({"sk_rst_reason"})
# #define'd constants the agent relies on: C macro -> value
CONSTANTS: Mapping[str, int] = {
    "DATA_SAMPLE_SHIFT": DATA_SAMPLE_SHIFT,
    "DATA_GAP": DATA_GAP,
    "DATA_LOST": DATA_LOST,
    "DATA_TAIL": DATA_TAIL,
    "TASK_COMM_LEN": TASK_COMM_LEN,
    "AF_INET": AF_INET,
    "AF_INET6": AF_INET6,
    "RUNQ_SLOTS": RUNQ_SLOTS,
    "SITS_STREAM_TAIL": STREAM_TAIL,
    "SITS_STREAM_HEAD": STREAM_HEAD,
}
