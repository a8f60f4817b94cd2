"""The libcuda uprobes of cuda.c: which symbols, which libraries, attaching them, and doctor's
rows for them."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from sits_trace.agent.capture.probes import (
    ProbeStatus,
    Uprobe,
    elf_has_symbol,
    find_libraries,
    mapped_libraries,
)
from sits_trace.agent.model import Check

if TYPE_CHECKING:
    from sits_trace.agent.capture.loader import Kernel

CUDA_PROGRAM = "cuda.c"
LIBCUDA = "libcuda"
# where drivers put libcuda besides the paths the processes map (also found by find_libraries)
LIBCUDA_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
)


def _u(symbol: str, enter: str, exit_: str = "sits_cuda_call_exit") -> Uprobe:
    return Uprobe(symbol, enter, exit_, "cuda", LIBCUDA)


# entry-only probes have fn_exit "" (loader attaches no uretprobe)
CUDA_UPROBES: tuple[Uprobe, ...] = (
    _u("cuLaunchKernel", "sits_cuda_launch", ""),
    _u("cuLaunchKernel_ptsz", "sits_cuda_launch", ""),
    _u("cuLaunchKernelEx", "sits_cuda_launch", ""),
    _u("cuLaunchKernelEx_ptsz", "sits_cuda_launch", ""),
    _u("cuGraphLaunch", "sits_cuda_graph_launch", ""),
    _u("cuGraphLaunch_ptsz", "sits_cuda_graph_launch", ""),
    _u("cuMemcpyHtoD_v2", "sits_cuda_memcpy_htod"),
    _u("cuMemcpyHtoD_v2_ptds", "sits_cuda_memcpy_htod"),
    _u("cuMemcpyDtoH_v2", "sits_cuda_memcpy_dtoh"),
    _u("cuMemcpyDtoH_v2_ptds", "sits_cuda_memcpy_dtoh"),
    _u("cuMemcpyDtoD_v2", "sits_cuda_memcpy_dtod"),
    _u("cuMemcpyDtoD_v2_ptds", "sits_cuda_memcpy_dtod"),
    _u("cuMemcpy", "sits_cuda_memcpy"),
    _u("cuMemcpy_ptds", "sits_cuda_memcpy"),
    _u("cuMemcpyHtoDAsync_v2", "sits_cuda_memcpy_htod_async"),
    _u("cuMemcpyHtoDAsync_v2_ptsz", "sits_cuda_memcpy_htod_async"),
    _u("cuMemcpyDtoHAsync_v2", "sits_cuda_memcpy_dtoh_async"),
    _u("cuMemcpyDtoHAsync_v2_ptsz", "sits_cuda_memcpy_dtoh_async"),
    _u("cuMemcpyDtoDAsync_v2", "sits_cuda_memcpy_dtod_async"),
    _u("cuMemcpyDtoDAsync_v2_ptsz", "sits_cuda_memcpy_dtod_async"),
    _u("cuMemcpyAsync", "sits_cuda_memcpy_async"),
    _u("cuMemcpyAsync_ptsz", "sits_cuda_memcpy_async"),
    _u("cuStreamSynchronize", "sits_cuda_stream_sync"),
    _u("cuStreamSynchronize_ptsz", "sits_cuda_stream_sync"),
    _u("cuCtxSynchronize", "sits_cuda_ctx_sync"),
    _u("cuEventSynchronize", "sits_cuda_event_sync"),
    _u("cuMemAlloc_v2", "sits_cuda_mem_alloc"),
    _u("cuMemAllocAsync", "sits_cuda_mem_alloc_async"),
    _u("cuMemAllocAsync_ptsz", "sits_cuda_mem_alloc_async"),
    _u("cuMemAllocManaged", "sits_cuda_mem_alloc_managed"),
    _u("cuMemHostAlloc", "sits_cuda_mem_host_alloc"),
    _u("cuMemAllocHost_v2", "sits_cuda_mem_alloc_host"),
    _u("cuMemHostRegister_v2", "sits_cuda_mem_host_register"),
    _u("cuMemMap", "sits_cuda_mem_map"),
    _u("cuMemFree_v2", "sits_cuda_mem_free"),
    _u("cuMemFreeAsync", "sits_cuda_mem_free_async"),
    _u("cuMemFreeAsync_ptsz", "sits_cuda_mem_free_async"),
    _u("cuMemFreeHost", "sits_cuda_mem_free_host"),
    _u("cuMemHostUnregister", "sits_cuda_mem_host_unregister"),
    _u("cuMemUnmap", "sits_cuda_mem_unmap"),
    _u("cuInit", "sits_cuda_init", ""),
)
# the symbols without which the CUDA signals say little (doctor reports the rest as optional)
CORE_SYMBOLS = ("cuLaunchKernel", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
                "cuStreamSynchronize")


def find_libcuda(proc_root: str = "/proc", extra: Sequence[str] = ()) -> list[str]:
    """libcuda files on the system and mapped by processes, one path per file (inode): a file
    reached through two paths (a container's root) would count every call twice."""
    return unique_files(find_libraries(LIBCUDA, proc_root, extra=[*LIBCUDA_PATHS, *extra]))


def unique_files(paths: Iterable[str], seen: set[tuple[int, int]] | None = None) -> list[str]:
    """The paths naming distinct files (device, inode); `seen` carries inodes across calls."""
    done = seen if seen is not None else set()
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key not in done:
            done.add(key)
            out.append(p)
    return out


class CudaProbes:
    """Attaches CUDA_UPROBES to each libcuda once; rescans new processes (after exec)."""

    def __init__(self, kernel: Kernel, proc_root: str = "/proc",
                 extra: Sequence[str] = ()) -> None:
        self.kernel = kernel
        self.proc_root = proc_root
        self.extra = list(extra)
        self._inodes: set[tuple[int, int]] = set()
        self.libraries: list[str] = []

    def attach_all(self) -> list[ProbeStatus]:
        found = find_libraries(LIBCUDA, self.proc_root, extra=[*LIBCUDA_PATHS, *self.extra])
        return self._attach(found)

    def check_process(self, pid: int) -> list[ProbeStatus]:
        """A process that exec'd (or loaded libcuda late): probe its libcuda if new."""
        return self._attach(mapped_libraries(pid, LIBCUDA, self.proc_root))

    def _attach(self, paths: Iterable[str]) -> list[ProbeStatus]:
        out: list[ProbeStatus] = []
        for lib in unique_files(paths, self._inodes):
            self.libraries.append(lib)
            out += self.kernel.attach_uprobes(lib, CUDA_UPROBES)
        return out


def doctor_checks(proc_root: str = "/proc") -> list[Check]:
    """One row per libcuda found: which probed symbols it exports. Never a core check."""

    libs = find_libcuda(proc_root)
    if not libs:
        return [Check("libcuda", False, "no libcuda.so found on the system or in processes",
                      "optional: CUDA signals need the NVIDIA driver's libcuda.so.1")]
    out = []
    symbols = sorted({u.symbol for u in CUDA_UPROBES})
    for lib in libs:
        missing = [s for s in symbols if not elf_has_symbol(lib, s)]
        core_missing = [s for s in CORE_SYMBOLS if s in missing]
        detail = f"{len(symbols) - len(missing)}/{len(symbols)} probed symbols"
        if missing:
            detail += "; missing " + ", ".join(missing)
        out.append(Check(f"libcuda {lib}", not core_missing, detail,
                         "" if not core_missing else
                         "a stripped or unusual libcuda: launches/copies are not traced here"))
    return out
