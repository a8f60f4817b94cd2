"""cuda.c's records and totals as plain values: EV_CUDA_COPY, EV_CUDA_MEM, EV_CUDA_INIT and
struct cuda_proc (layouts in agent/capture/wire.py)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from sits_trace.agent.capture.events import DecodeError
from sits_trace.agent.capture.wire import (
    CopyDir,
    CudaApi,
    CudaCopyEventC,
    CudaInitEventC,
    CudaMemEventC,
    CudaProcC,
    Kind,
    MemKind,
    MemOp,
)


@dataclass(frozen=True, slots=True)
class CudaCopy:
    pid: int
    tid: int
    ts_enter_ns: int
    ts_exit_ns: int
    bytes: int
    dst: int
    src: int
    stream: int
    api: CudaApi
    is_async: bool
    direction: CopyDir  # as the kernel saw it (UNKNOWN for cuMemcpy/cuMemcpyAsync)


@dataclass(frozen=True, slots=True)
class CudaMem:
    pid: int
    tid: int
    ts_ns: int
    ptr: int
    bytes: int
    op: MemOp
    mem: MemKind
    api: CudaApi


@dataclass(slots=True)
class CudaTotals:
    """One process's totals since the agent started (bpf/cuda.c struct cuda_proc)."""

    launches: int = 0
    graph_launches: int = 0
    h2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    d2h_copies: int = 0
    d2d_bytes: int = 0
    d2d_copies: int = 0
    other_bytes: int = 0
    other_copies: int = 0
    copy_call_ns: int = 0
    sync_ns: int = 0
    syncs: int = 0
    failed: int = 0


def _check(raw: bytes, kind: Kind, cls: type[ctypes.Structure]) -> None:
    if len(raw) < ctypes.sizeof(cls) or int.from_bytes(raw[:4], "little") != kind:
        raise DecodeError(f"{kind.name} record of {len(raw)} bytes")


def decode_copy(raw: bytes) -> CudaCopy:
    _check(raw, Kind.CUDA_COPY, CudaCopyEventC)
    c = CudaCopyEventC.from_buffer_copy(raw[: ctypes.sizeof(CudaCopyEventC)])
    try:
        return CudaCopy(c.tgid, c.tid, c.ts_enter_ns, c.ts_exit_ns, c.bytes, c.dst, c.src,
                        c.stream, CudaApi(c.api), bool(c.is_async), CopyDir(c.direction))
    except ValueError as exc:
        raise DecodeError(str(exc)) from exc


def decode_mem(raw: bytes) -> CudaMem:
    _check(raw, Kind.CUDA_MEM, CudaMemEventC)
    m = CudaMemEventC.from_buffer_copy(raw[: ctypes.sizeof(CudaMemEventC)])
    try:
        return CudaMem(m.tgid, m.tid, m.ts_ns, m.ptr, m.bytes, MemOp(m.op), MemKind(m.mem),
                       CudaApi(m.api))
    except ValueError as exc:
        raise DecodeError(str(exc)) from exc


def decode_init(raw: bytes) -> tuple[int, int]:
    """(pid, ts_ns) of an EV_CUDA_INIT record."""
    _check(raw, Kind.CUDA_INIT, CudaInitEventC)
    i = CudaInitEventC.from_buffer_copy(raw[: ctypes.sizeof(CudaInitEventC)])
    return i.tgid, i.ts_ns


def decode_totals(raw: bytes) -> CudaTotals:
    p = CudaProcC.from_buffer_copy(raw[: ctypes.sizeof(CudaProcC)])
    return CudaTotals(*(getattr(p, f[0]) for f in CudaProcC._fields_))
