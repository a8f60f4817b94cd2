"""bpf/cuda.c against a stand-in libcuda: real uprobes, exact counts.

The test builds a shared library that exports the driver API's names with cuda.h's
signatures (plain C functions; the sync calls sleep a known time) and a program that calls
them a known number of times with known byte counts. It attaches the real uprobes by path
and symbol, runs the program, and compares what the kernel counted and sent.
"""

from __future__ import annotations

import ctypes
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sits_trace.agent.capture import bpfsrc
from sits_trace.agent.capture.events import Kind
from sits_trace.agent.capture.wire import (
    CopyDir,
    CudaApi,
    CudaCopyEventC,
    CudaInitEventC,
    CudaMemEventC,
    CudaSlotC,
    CudaSlotKeyC,
)
from sits_trace.agent.signals.cuda import (
    CUDA_PROGRAM,
    BccCudaMaps,
    CudaProbes,
    CudaSignals,
    decode_copy,
)

pytestmark = pytest.mark.bpf

FAKE_LIBCUDA = r"""
#include <stddef.h>
#include <stdint.h>
#include <time.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraphExec_st *CUgraphExec;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
#define API __attribute__((visibility("default"), noinline))
static volatile int sink;
static unsigned long long next_dev = 0x7f0000000000ULL;
static void nap_ms(long ms) { struct timespec t = {0, ms * 1000000L}; nanosleep(&t, 0); }
static CUresult copy_rc(size_t n) { sink += (int)n; return n == 13 ? 1 : 0; }

API CUresult cuInit(unsigned int flags) { sink += flags; return 0; }
API CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
    unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem, CUstream s,
    void **params, void **extra) { sink += gx; return 0; }
API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
    unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
    CUstream s, void **params, void **extra) { sink += gx; return 0; }
API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e)
    { sink += c->gridDimX; return 0; }
API CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { sink++; return 0; }
API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { return copy_rc(n); }
API CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { return copy_rc(n); }
API CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy_rc(n); }
API CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy_rc(n); }
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, CUstream s)
    { return copy_rc(n); }
API CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, CUstream s)
    { return copy_rc(n); }
API CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
    { return copy_rc(n); }
API CUresult cuStreamSynchronize(CUstream s) { nap_ms(20); return 0; }
API CUresult cuCtxSynchronize(void) { nap_ms(30); return 0; }
API CUresult cuEventSynchronize(CUevent e) { nap_ms(10); return 0; }
API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
    { *p = next_dev; next_dev += (n + 0xfffff) & ~0xfffffULL; return 0; }
API CUresult cuMemFree_v2(CUdeviceptr p) { sink += (int)p; return 0; }
API CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags)
    { static char pinned[1 << 16]; *p = pinned; return 0; }
"""

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void *hStream; void *attrs; unsigned int numAttrs;
} CUlaunchConfig;
CUresult cuInit(unsigned int);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
CUresult cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, void *, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, void *, void **, void **);
CUresult cuGraphLaunch(void *, void *);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpy(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, void *);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, void *);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, void *);
CUresult cuStreamSynchronize(void *);
CUresult cuCtxSynchronize(void);
CUresult cuEventSynchronize(void *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemHostAlloc(void **, size_t, unsigned);

static unsigned long long mono(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000ULL + t.tv_nsec;
}
static void nap_ms(long ms) { struct timespec t = {0, ms * 1000000L}; nanosleep(&t, 0); }

int main(void)
{
    char line[16];
    void *stream = (void *)0x1234;
    CUlaunchConfig cfg = {.gridDimX = 1};
    char *host = malloc(1 << 16);
    if (!fgets(line, sizeof line, stdin)) /* the test attaches, then says go */
        return 1;
    cuInit(0);
    CUdeviceptr dev = 0, dev2 = 0;
    cuMemAlloc_v2(&dev, 1 << 20);
    cuMemAlloc_v2(&dev2, 1 << 20);
    void *pinned = 0;
    cuMemHostAlloc(&pinned, 4096, 0);
    unsigned long long a0 = mono();                          /* phase A: 5 launches */
    for (int i = 0; i < 5; i++)
        cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0);
    unsigned long long a1 = mono();
    nap_ms(50);
    unsigned long long b0 = mono();                          /* phase B: the rest */
    for (int i = 0; i < 2; i++)
        cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0);
    for (int i = 0; i < 2; i++)
        cuLaunchKernel_ptsz(0, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0);
    for (int i = 0; i < 3; i++)
        cuLaunchKernelEx(&cfg, 0, 0, 0);
    cuGraphLaunch(0, stream);
    cuGraphLaunch(0, stream);
    cuMemcpyHtoDAsync_v2(dev, host, 1000, stream);
    cuMemcpyHtoDAsync_v2(dev, host, 2000, stream);
    cuMemcpyHtoDAsync_v2(dev, pinned, 3000, 0);
    cuMemcpyHtoD_v2(dev, host, 4096);
    cuMemcpyDtoHAsync_v2(host, dev, 512, stream);
    cuMemcpyDtoHAsync_v2(host, dev, 512, stream);
    cuMemcpyDtoH_v2(host, dev, 100);
    cuMemcpyDtoD_v2(dev2, dev, 64);
    cuMemcpyAsync(dev, (CUdeviceptr)host, 777, stream);      /* H2D, by address */
    cuMemcpyAsync((CUdeviceptr)host, dev, 333, stream);      /* D2H, by address */
    cuMemcpy(dev2 + 16, dev + 8, 55);                       /* D2D, by address */
    cuMemcpyHtoDAsync_v2(dev, host, 13, stream);            /* fails: not counted */
    cuStreamSynchronize(stream);
    cuStreamSynchronize(stream);
    cuCtxSynchronize();
    cuEventSynchronize(0);
    unsigned long long b1 = mono();
    cuMemFree_v2(dev2);
    printf("%llu %llu %llu %llu\n", a0, a1, b0, b1);
    return 0;
}
"""

SYNC_SLEEP_MS = 20 + 20 + 30 + 10


@dataclass
class Built:
    lib: Path
    exe: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.c").write_text(FAKE_LIBCUDA)
    (d / "prog.c").write_text(PROGRAM)
    lib = d / "libcuda.so.1"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(d / "fake.c")], check=True)
    exe = d / "prog"
    # DT_RPATH, not DT_RUNPATH: it wins over LD_LIBRARY_PATH, which on a GPU machine names the
    # real driver's folder (the program then loaded the real libcuda and crashed on its fake
    # handles: seen on the H200, where the linker writes RUNPATH by default)
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(d / "prog.c"), str(lib),
                    f"-Wl,-rpath,{d}", "-Wl,--disable-new-dtags"], check=True)
    return Built(lib, exe)


class _Kernel:
    """A bcc.BPF with cuda.c alone, shaped like loader.Kernel for CudaProbes."""

    def __init__(self, pid_filter: int) -> None:
        from bcc import BPF
        from sits_trace.agent.capture.probes import ProbeReport

        text = bpfsrc.program_text([CUDA_PROGRAM])
        self.bpf = BPF(text=text, cflags=bpfsrc.cflags(
            {"SITS_FILTER_PIDS": 1, "SITS_LAYOUT_CHECK": 1}))
        self.bpf["target_pids"][ctypes.c_uint32(pid_filter)] = ctypes.c_uint8(1)
        self.report = ProbeReport()

    def attach_uprobes(self, library: str, probes: object) -> list[object]:
        from sits_trace.agent.capture.loader import Kernel, LoadOptions

        k = Kernel(self.bpf, self.report, LoadOptions())
        return list(k.attach_uprobes(library, probes))


@dataclass
class Run:
    pid: int
    phases: list[int]
    records: list[bytes]
    kernel: _Kernel
    signals: CudaSignals


@pytest.fixture(scope="module")
def run(built: Built) -> Iterator[Run]:
    proc = subprocess.Popen([str(built.exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    k = _Kernel(proc.pid)
    records: list[bytes] = []

    def cb(_ctx: object, data: int, size: int) -> int:
        records.append(ctypes.string_at(data, size))
        return 0

    k.bpf["events"].open_ring_buffer(cb)
    probes = CudaProbes(k, extra=[str(built.lib)])
    statuses = probes._attach([str(built.lib)])
    attached = {s.name.rsplit(":", 1)[-1] for s in statuses if s.ok}
    want = {"cuLaunchKernel", "cuMemcpyAsync", "cuStreamSynchronize", "cuInit"}
    assert want <= attached, [(s.name, s.detail) for s in statuses
                              if not s.ok][:8]
    out, _ = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0, proc.returncode
    k.bpf.ring_buffer_consume()  # wakeups are batched: read what is there
    sig = CudaSignals(BccCudaMaps(k.bpf))
    for r in records:
        h = sig.handlers().get(int.from_bytes(r[:4], "little"))
        if h is not None:
            h(r)
    sig.poll()
    try:
        yield Run(proc.pid, [int(x) for x in out.split()], records, k, sig)
    finally:
        k.bpf.cleanup()


def test_totals_are_exact(run: Run) -> None:
    t = run.signals.totals()[run.pid]
    assert (t.launches, t.graph_launches) == (12, 2)
    assert (t.h2d_bytes, t.h2d_copies) == (1000 + 2000 + 3000 + 4096, 4)
    assert (t.d2h_bytes, t.d2h_copies) == (512 + 512 + 100, 3)
    assert (t.d2d_bytes, t.d2d_copies) == (64, 1)
    assert (t.other_bytes, t.other_copies) == (777 + 333 + 55, 3)  # direction not in the args
    assert t.failed == 1
    assert t.syncs == 4
    assert SYNC_SLEEP_MS * 1e6 <= t.sync_ns < (SYNC_SLEEP_MS + 40) * 1e6


def test_copy_records(run: Run) -> None:
    copies = [decode_copy(r) for r in run.records if r[:4] == bytes([Kind.CUDA_COPY, 0, 0, 0])]
    assert len(copies) == 4 + 3 + 1 + 3
    assert all(c.pid == run.pid for c in copies)
    first = copies[0]
    assert (first.api, first.bytes, first.direction, first.is_async, first.stream) == \
        (CudaApi.MEMCPY_HTOD_ASYNC, 1000, CopyDir.H2D, True, 0x1234)
    sync = next(c for c in copies if c.api is CudaApi.MEMCPY_HTOD)
    assert (sync.bytes, sync.is_async, sync.stream) == (4096, False, 0)
    assert all(c.ts_exit_ns >= c.ts_enter_ns > 0 for c in copies)


def test_direction_resolved_from_allocations(run: Run) -> None:
    """cuMemcpy/cuMemcpyAsync: cuInit, then cuMemAlloc_v2 ranges say which side is device."""
    _, _, b0, b1 = run.phases
    w = run.signals.window(run.pid, b0, b1)
    assert w.copy_bytes == {CopyDir.H2D: 1000 + 2000 + 3000 + 4096 + 777,
                            CopyDir.D2H: 512 + 512 + 100 + 333, CopyDir.D2D: 64 + 55}
    assert w.copies == {CopyDir.H2D: 5, CopyDir.D2H: 4, CopyDir.D2D: 2}
    assert run.signals.resolved_directions == 3


def test_windows_split_launches_and_syncs(run: Run) -> None:
    a0, a1, b0, b1 = run.phases
    wa = run.signals.window(run.pid, a0, a1)
    assert (wa.launches, wa.graph_launches, wa.syncs, wa.sync_wait_ns) == (5, 0, 0, 0)
    assert not wa.copies
    wb = run.signals.window(run.pid, b0, b1)
    assert (wb.launches, wb.graph_launches, wb.syncs) == (7, 2, 4)
    assert SYNC_SLEEP_MS * 1e6 <= wb.sync_wait_ns < (SYNC_SLEEP_MS + 40) * 1e6
    gap = run.signals.window(run.pid, a1 + 1, b0 - 1)
    assert (gap.launches, gap.syncs) == (0, 0)


def test_old_slots_are_drained(run: Run) -> None:
    time.sleep(0.01)  # > two slots
    run.signals.poll()
    left = [bytes(k) for k, _ in run.kernel.bpf["cuda_slots"].items()]
    assert left == []
    a0, _, _, b1 = run.phases
    assert run.signals.window(run.pid, a0, b1).launches == 12  # kept in the agent


def test_mirrors_match_bcc(run: Run) -> None:
    pairs = [("layout_cuda_copy", CudaCopyEventC), ("layout_cuda_mem", CudaMemEventC),
             ("layout_cuda_init", CudaInitEventC), ("cuda_slots", CudaSlotC)]
    for name, mirror in pairs:
        leaf = run.kernel.bpf[name].Leaf
        assert ctypes.sizeof(leaf) == ctypes.sizeof(mirror), name
        for fname, *_ in mirror._fields_:
            if fname != "_pad":
                assert getattr(leaf, fname).offset == getattr(mirror, fname).offset, (name, fname)
    key = run.kernel.bpf["cuda_slots"].Key
    assert ctypes.sizeof(key) == ctypes.sizeof(CudaSlotKeyC)
    from sits_trace.agent.capture.wire import CudaProcC

    assert ctypes.sizeof(run.kernel.bpf["cuda_procs"].Leaf) == ctypes.sizeof(CudaProcC)


def test_nothing_lost(run: Run) -> None:
    lost = run.kernel.bpf["lost"]
    for kind in (Kind.CUDA_COPY, Kind.CUDA_MEM, Kind.CUDA_INIT):
        assert sum(lost[ctypes.c_int(int(kind))]) == 0
    seen = run.kernel.bpf["seen"]
    assert sum(seen[ctypes.c_int(int(Kind.CUDA_MEM))]) == 4  # 2 device, 1 pinned, 1 free
    assert sum(seen[ctypes.c_int(int(Kind.CUDA_INIT))]) == 1
