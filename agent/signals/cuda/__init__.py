"""CUDA driver signals from bpf/cuda.c: launches, copies, sync waits of traced processes.

    records.py   the records and totals as plain values (layouts: agent/capture/wire.py)
    addrmap.py   allocations' address ranges: the direction of cuMemcpy/cuMemcpyAsync
    maps.py      reading the kernel's maps (BCC, or dicts in tests)
    windows.py   CudaSignals: per-process activity in a span's window
    probes.py    the libcuda uprobes, finding and attaching libcuda, doctor rows

The kernel keeps per-process totals (`cuda_procs`) and launches and sync waits per time slot
(`cuda_slots`, 2^SITS_CUDA_SLOT_SHIFT ns each); every copy arrives as an EV_CUDA_COPY record
and every allocation as EV_CUDA_MEM. CudaSignals reads all three and answers "what did process
P do on the GPU between t0 and t1" (`window`), which the span annotator in signals/gpu.py
turns into `sits.cuda.*` attributes.

Copies through cuMemcpy/cuMemcpyAsync name no direction: the agent resolves it from the
address ranges that allocations it saw returned (device, pinned host, registered host). A
pointer outside every known range counts as pageable host memory only when the process called
cuInit after the agent started (so every allocation was seen); otherwise the direction stays
'unknown'.
"""

from __future__ import annotations

from sits_trace.agent.capture.wire import CopyDir, CudaApi, MemKind, MemOp

from .addrmap import AddressMap
from .maps import BccCudaMaps, CudaMaps, DictCudaMaps, slot_key
from .probes import (
    CORE_SYMBOLS,
    CUDA_PROGRAM,
    CUDA_UPROBES,
    LIBCUDA,
    LIBCUDA_PATHS,
    CudaProbes,
    doctor_checks,
    find_libcuda,
    unique_files,
)
from .records import (
    CudaCopy,
    CudaMem,
    CudaTotals,
    decode_copy,
    decode_init,
    decode_mem,
    decode_totals,
)
from .windows import DEFAULT_SLOT_SHIFT, CudaSignals, CudaWindow

__all__ = [
    "CORE_SYMBOLS", "CUDA_PROGRAM", "CUDA_UPROBES", "DEFAULT_SLOT_SHIFT", "LIBCUDA",
    "LIBCUDA_PATHS", "AddressMap", "BccCudaMaps", "CopyDir", "CudaApi", "CudaCopy", "CudaMaps",
    "CudaMem", "CudaProbes", "CudaSignals", "CudaTotals", "CudaWindow", "DictCudaMaps",
    "MemKind", "MemOp", "decode_copy", "decode_init", "decode_mem", "decode_totals",
    "doctor_checks", "find_libcuda", "slot_key", "unique_files",
]
