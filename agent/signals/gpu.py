"""GPU signals wired into the loader and the tracer, and the span annotator that correlates
them: each span gets its own window's CUDA activity (its process) and GPU state (its device).

    kernel = load(cuda_options(opts, GpuSignalConfig()))
    gpu = GpuSignals.from_kernel(kernel, GpuSignalConfig())   # attaches libcuda probes
    gpu.install(tracer)        # record handlers + annotator
    gpu.check_process(pid)     # after exec (Rescans): probe a libcuda the process maps
    gpu.poll()                 # each loop: drain the kernel's launch/sync slots
    gpu.stop()

Span attributes (present when the process did CUDA work, or NVML knows its GPU):
  sits.cuda.kernel_launches      cuLaunchKernel* calls of the span's process in its window
  sits.cuda.graph_launches       cuGraphLaunch calls
  sits.cuda.h2d_bytes / _copies  host->device copies that started in the window
  sits.cuda.d2h_bytes / _copies  device->host copies
  sits.cuda.d2d_bytes            device->device copies (when any)
  sits.cuda.unknown_copy_bytes   cuMemcpy/cuMemcpyAsync whose direction could not be resolved
  sits.cuda.copy_call_ms         time inside copy calls (sync copies: the copy)
  sits.cuda.sync_wait_ms         time inside cuStreamSynchronize/cuCtxSynchronize/
                                 cuEventSynchronize that ended in the window
  sits.cuda.syncs                those calls
  sits.gpu.index / .uuid         the GPU the process computes on (NVML's process list)
  sits.gpu.utilization_pct       NVML GPU utilisation samples covering the window
  sits.gpu.memory_utilization_pct
  sits.gpu.sm_active_pct, .sm_occupancy_pct, .tensor_active_pct, .dram_active_pct,
  sits.gpu.pcie_tx_bytes_per_s, .pcie_rx_bytes_per_s   GPM metrics over the window (node-wide:
                                 other processes' copies show here as PCIe contention)
  sits.gpu.process_sm_pct        the process's own SM share (nvmlDeviceGetProcessUtilization)
  sits.gpu.clocks_event_reasons  bitmask at the window's end (power/thermal/... throttling)
  sits.gpu.sm_clock_mhz
  sits.gpu.signal_age_ms         >0 when the newest NVML reading ended before the window

Launches and syncs are counted per process in slots of 2^slot_shift ns (1 ms by default): a
slot that straddles an edge of the window is shared by the part of its activity inside.
A process serving several requests at once has all of them in each span's window.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sits_trace.agent.capture.wire import CopyDir
from sits_trace.agent.model import Exchange, Provider, Span

from .cuda import (
    CUDA_PROGRAM,
    DEFAULT_SLOT_SHIFT,
    BccCudaMaps,
    CudaProbes,
    CudaSignals,
    CudaWindow,
)
from .nvml import GpuWindow, NvmlSampler, load_nvml

if TYPE_CHECKING:
    from sits_trace.agent.capture.loader import Kernel, LoadOptions
    from sits_trace.agent.tracing.pipeline import Tracer

log = logging.getLogger("sits_trace.gpu")


@dataclass(slots=True)
class GpuSignalConfig:
    cuda: bool = True
    nvml: bool = True
    slot_shift: int = DEFAULT_SLOT_SHIFT
    libcuda_paths: list[str] = field(default_factory=list)
    nvml_interval_s: float = 0.1
    nvml_module: Any = None  # a pynvml-like module (tests: a recorder or replayer); None: pynvml


def cuda_options(opts: LoadOptions, cfg: GpuSignalConfig) -> LoadOptions:
    """LoadOptions with cuda.c compiled in (its probes attach after loading)."""
    if not cfg.cuda:
        return opts
    return dataclasses.replace(
        opts, extra_programs=[*opts.extra_programs, CUDA_PROGRAM],
        extra_defines={**opts.extra_defines, "SITS_CUDA_SLOT_SHIFT": cfg.slot_shift})


class GpuSignals:
    def __init__(self, cuda: CudaSignals | None, probes: CudaProbes | None,
                 sampler: NvmlSampler | None) -> None:
        self.cuda = cuda
        self.probes = probes
        self.sampler = sampler
        self._tracer: Tracer | None = None
        self._armed = False

    @classmethod
    def from_kernel(cls, kernel: Kernel | None, cfg: GpuSignalConfig, *, nvml: Any = None,
                    proc_root: str = "/proc", clock_offset_ns: int | None = None,
                    start: bool = True) -> GpuSignals:
        cuda = probes = None
        if kernel is not None and cfg.cuda and CUDA_PROGRAM in kernel.opts.extra_programs:
            cuda = CudaSignals(BccCudaMaps(kernel.bpf), slot_shift=cfg.slot_shift)
            probes = CudaProbes(kernel, proc_root, cfg.libcuda_paths)
            if not any(s.ok for s in probes.attach_all()):
                log.info("no libcuda probed yet (none found, or no symbol attached); "
                         "new processes are checked after exec")
        sampler = None
        if cfg.nvml:
            mod = nvml if nvml is not None else cfg.nvml_module or load_nvml()
            if mod is not None:
                sampler = NvmlSampler(mod, interval_s=cfg.nvml_interval_s,
                                      clock_offset_ns=clock_offset_ns)
                if start:
                    sampler.start()
        return cls(cuda, probes, sampler)

    def install(self, tracer: Tracer) -> None:
        if self.cuda is not None:
            tracer.handlers.update(self.cuda.handlers())
        self._tracer = tracer
        self._arm()

    def _arm(self) -> None:
        """The annotator joins the tracer once it has something to read (a GPU sampled, or
        some libcuda probed): a node without GPUs pays nothing per span."""
        if self._armed or self._tracer is None:
            return
        if self.sampler is None and self._live_cuda() is None:
            return
        self._tracer.annotators.append(self.annotate)
        self._armed = True

    def providers(self) -> dict[str, Provider]:
        """None: the feature frame reads the NVML sampler and CUDA totals directly (per GPU)."""
        return {}

    def check_process(self, pid: int) -> None:
        if self.probes is not None:
            self.probes.check_process(pid)
            self._arm()  # a libcuda found after exec: the CUDA attributes start now

    def forget(self, pid: int) -> None:
        if self.cuda is not None:
            self.cuda.forget(pid)

    def _live_cuda(self) -> CudaSignals | None:
        """The CUDA reader once some libcuda is probed: until then cuda.c's maps stay empty,
        and reading them each loop (a batch lookup BCC sizes to the whole map) is waste."""
        if self.probes is not None and not self.probes.libraries:
            return None
        return self.cuda

    def poll(self) -> None:
        cuda = self._live_cuda()
        if cuda is not None:
            cuda.poll()

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    # ---- the annotator ----

    def annotate(self, ex: Exchange, span: Span) -> None:
        start = ex.request.start_ns
        end = ex.response.end_ns if ex.response is not None else ex.request.end_ns
        pid = ex.conn.pid
        cuda = self._live_cuda()
        if cuda is not None:
            w = cuda.window(pid, start, end)
            if w.seen:
                span.attributes.update(cuda_attributes(w))
        if self.sampler is not None:
            dev = self.sampler.device_of(pid)
            if dev is not None:
                g = self.sampler.window(dev, start, end, pid)
                span.attributes.update(gpu_attributes(g, self.sampler.devices[dev].info.uuid))


def cuda_attributes(w: CudaWindow) -> dict[str, str | bool | int | float]:
    a: dict[str, str | bool | int | float] = {
        "sits.cuda.kernel_launches": w.launches,
        "sits.cuda.graph_launches": w.graph_launches,
        "sits.cuda.h2d_bytes": w.copy_bytes.get(CopyDir.H2D, 0),
        "sits.cuda.h2d_copies": w.copies.get(CopyDir.H2D, 0),
        "sits.cuda.d2h_bytes": w.copy_bytes.get(CopyDir.D2H, 0),
        "sits.cuda.d2h_copies": w.copies.get(CopyDir.D2H, 0),
        "sits.cuda.copy_call_ms": round(w.copy_call_ns / 1e6, 3),
        "sits.cuda.sync_wait_ms": round(w.sync_wait_ns / 1e6, 3),
        "sits.cuda.syncs": w.syncs,
    }
    if w.copy_bytes.get(CopyDir.D2D):
        a["sits.cuda.d2d_bytes"] = w.copy_bytes[CopyDir.D2D]
    if w.copy_bytes.get(CopyDir.UNKNOWN):
        a["sits.cuda.unknown_copy_bytes"] = w.copy_bytes[CopyDir.UNKNOWN]
    return a


_GPM_ATTRS = ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_active_pct",
              "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s")


def gpu_attributes(g: GpuWindow, uuid: str = "") -> dict[str, str | bool | int | float]:
    a: dict[str, str | bool | int | float] = {"sits.gpu.index": g.device}
    if uuid:
        a["sits.gpu.uuid"] = uuid
    if g.util_pct is not None:
        a["sits.gpu.utilization_pct"] = round(g.util_pct, 1)
    if g.mem_util_pct is not None:
        a["sits.gpu.memory_utilization_pct"] = round(g.mem_util_pct, 1)
    for k in _GPM_ATTRS:
        if k in g.gpm:
            a[f"sits.gpu.{k}"] = round(g.gpm[k], 2 if k.endswith("pct") else 0)
    if g.proc_sm_pct is not None:
        a["sits.gpu.process_sm_pct"] = round(g.proc_sm_pct, 1)
    if "clocks_event_reasons" in g.state:
        a["sits.gpu.clocks_event_reasons"] = int(g.state["clocks_event_reasons"])
    if "sm_clock_mhz" in g.state:
        a["sits.gpu.sm_clock_mhz"] = int(g.state["sm_clock_mhz"])
    if g.age_ms > 0:
        a["sits.gpu.signal_age_ms"] = round(g.age_ms, 1)
    return a
