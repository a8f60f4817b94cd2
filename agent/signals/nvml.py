"""GPU signals from NVML (nvidia-ml-py's `pynvml`), sampled on their own threads.

Every pass (`interval_s`, 0.1 s by default) reads, per GPU:
  - the driver's buffered utilisation samples since the last one seen (nvmlDeviceGetSamples
    with lastSeenTimeStamp: GPU and memory utilisation at the driver's own sampling rate);
  - GPM metrics between this pass and the last (SM activity and occupancy, DRAM bandwidth,
    tensor activity, PCIe TX/RX bytes) where nvmlGpmQueryDeviceSupport says so (Hopper+);
  - per-process SM/memory utilisation samples (nvmlDeviceGetProcessUtilization).
Every `state_every_s` (1 s) it reads clocks and nvmlDeviceGetCurrentClocksEventReasons,
memory, power, temperature, PCIe link generation/width and replay counter, and which
processes run on which GPU. A second thread waits for XID events (nvmlEventSetWait, short
timeout). nvmlDeviceGetPcieThroughput is not used: it blocks ~20 ms per call (GPM's PCIe
metrics replace it).

NVML stamps its samples in microseconds of Unix time; they are stored as CLOCK_MONOTONIC
nanoseconds (what bpf_ktime_get_ns and the spans use) with the offset passed in. A call that
a GPU does not support is logged once and not made again; no NVML at all is one log line.

The module is injected: pass `pynvml` itself, or a stand-in with its interface (the tests'
recorder and replayer, tests/support/nvml_replay.py, over tests/fixtures/nvml/*.json.gz).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sits_trace.agent.clock import realtime_offset_ns

log = logging.getLogger("sits_trace.nvml")

# GPM metric ids (nvml.h nvmlGpmMetricId_t) and how they are stored
GPM_METRICS: dict[str, int] = {
    "graphics_active_pct": 1,  # NVML_GPM_METRIC_GRAPHICS_UTIL
    "sm_active_pct": 2,  # NVML_GPM_METRIC_SM_UTIL
    "sm_occupancy_pct": 3,  # NVML_GPM_METRIC_SM_OCCUPANCY
    "tensor_active_pct": 5,  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    "dram_active_pct": 10,  # NVML_GPM_METRIC_DRAM_BW_UTIL
    "pcie_tx_bytes_per_s": 20,  # NVML_GPM_METRIC_PCIE_TX_PER_SEC (MiB/s from NVML)
    "pcie_rx_bytes_per_s": 21,  # NVML_GPM_METRIC_PCIE_RX_PER_SEC
}
_MIB_PER_S = ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s")
_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
# nvml.h nvmlReturn_t codes that mean "nothing new" or "not here", not failures
_NOT_SUPPORTED, _NOT_FOUND, _TIMEOUT, _NO_DATA, _NO_PERMISSION = 3, 6, 10, 25, 4


def load_nvml() -> Any | None:
    """pynvml, initialised; None (logged once) when there is no NVML or no GPU."""
    try:
        import pynvml  # noqa: PLC0415 - optional: no NVML on most nodes
    except ImportError:
        log.warning("GPU signals off: nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError, or the library failing to load
        log.warning("GPU signals off: NVML unavailable (%s)", exc)
        return None
    return pynvml


def error_code(exc: BaseException) -> int | None:
    v = getattr(exc, "value", None)
    return v if isinstance(v, int) else None


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total: int
    gpm: bool


@dataclass(frozen=True, slots=True)
class DeviceState:
    ts_ns: int
    values: dict[str, float]  # sm_clock_mhz, mem_clock_mhz, clocks_event_reasons, ...


@dataclass(frozen=True, slots=True)
class GpmInterval:
    start_ns: int
    end_ns: int
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class ProcUtil:
    ts_ns: int
    pid: int
    sm_pct: float
    mem_pct: float


@dataclass(frozen=True, slots=True)
class Xid:
    ts_ns: int
    device: int
    xid: int


@dataclass(slots=True)
class GpuWindow:
    """One GPU over a window: means of what NVML reported for it (None: no reading)."""

    device: int
    util_pct: float | None = None
    mem_util_pct: float | None = None
    util_samples: int = 0
    gpm: dict[str, float] = field(default_factory=dict)
    proc_sm_pct: float | None = None
    proc_mem_pct: float | None = None
    state: dict[str, float] = field(default_factory=dict)
    age_ms: float = 0.0  # >0: the newest reading used ended this long before the window


class _Series:
    """Time-ordered (ts, value) pairs, bounded by count."""

    def __init__(self, maxlen: int) -> None:
        self.ts: collections.deque[int] = collections.deque(maxlen=maxlen)
        self.v: collections.deque[float] = collections.deque(maxlen=maxlen)

    def add(self, ts: int, v: float) -> None:
        if self.ts and ts <= self.ts[-1]:
            return  # NVML repeats the sample at lastSeenTimeStamp
        self.ts.append(ts)
        self.v.append(v)

    def covering(self, start: int, end: int) -> tuple[list[float], int]:
        i, j, age = covering(list(self.ts), start, end)
        return list(self.v)[i:j], age


def covering(ts: Sequence[int], start: int, end: int) -> tuple[int, int, int]:
    """[i, j) of the time-ordered samples that cover [start, end] (a sample covers the time
    since the one before it: those inside, and the first after `end`), and 0; or, when none
    is that recent, the newest one and how long before `start` it was taken."""
    i = bisect.bisect_left(ts, start)
    j = bisect.bisect_right(ts, end)
    if i < len(ts):
        return i, min(j + 1, len(ts)), 0
    if ts:
        return len(ts) - 1, len(ts), start - ts[-1]
    return 0, 0, 0


@dataclass(slots=True)
class _Device:
    info: DeviceInfo
    handle: Any
    util: _Series
    mem_util: _Series
    gpm: collections.deque[GpmInterval]
    procs: collections.deque[ProcUtil]
    state: collections.deque[DeviceState]
    last_util_us: int = 0
    last_mem_us: int = 0
    last_proc_us: int = 0
    gpm_prev: Any = None
    gpm_prev_ns: int = 0
    unsupported: set[str] = field(default_factory=set)


class NvmlSampler:
    """Samples every GPU NVML sees; thread-safe queries for the annotator and the features."""

    def __init__(self, nvml: Any, *, interval_s: float = 0.1, state_every_s: float = 1.0,
                 keep_s: float = 600.0, clock_offset_ns: int | None = None,
                 monotonic_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.nvml = nvml
        self.interval_s = interval_s
        self.state_every_s = state_every_s
        self._now = monotonic_ns
        self.offset_ns = realtime_offset_ns() if clock_offset_ns is None else clock_offset_ns
        self._keep_n = max(16, int(keep_s / interval_s))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next_state_ns = 0
        self.devices: list[_Device] = [self._open(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.pid_device: dict[int, int] = {}  # pid -> GPU index (compute processes)
        self.pid_memory: dict[int, int] = {}
        self.xids: collections.deque[Xid] = collections.deque(maxlen=1024)
        self.errors = 0
        self.passes = 0

    # ---- set-up ----

    def _open(self, i: int) -> _Device:
        n = self.nvml
        h = n.nvmlDeviceGetHandleByIndex(i)
        info = DeviceInfo(i, _text(n.nvmlDeviceGetName(h)), _text(n.nvmlDeviceGetUUID(h)),
                          _text(n.nvmlDeviceGetPciInfo(h).busId),
                          int(n.nvmlDeviceGetMemoryInfo(h).total), self._gpm_supported(h))
        k = self._keep_n
        return _Device(info, h, _Series(k * 4), _Series(k * 4), collections.deque(maxlen=k),
                       collections.deque(maxlen=k * 4), collections.deque(maxlen=k))

    def _gpm_supported(self, h: Any) -> bool:
        try:
            return bool(self.nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
        except Exception:  # noqa: BLE001 - older driver or bindings: no GPM
            return False

    # ---- threads ----

    def start(self) -> None:
        for target, name in ((self._run, "sits-nvml"), (self._run_xid, "sits-nvml-xid")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def _run_xid(self, timeout_ms: int = 500) -> None:
        es = self._xid_set()
        if es is None:
            return
        while not self._stop.is_set():
            self.wait_xid(es, timeout_ms)

    # ---- one pass ----

    def sample_once(self) -> None:
        now = self._now()
        state_due = now >= self._next_state_ns
        for d in self.devices:
            self._samples(d)
            self._proc_util(d)
            if d.info.gpm:
                self._gpm(d, now)
            if state_due:
                self._state(d, now)
        if state_due:
            self._running_processes()
            self._next_state_ns = now + int(self.state_every_s * 1e9)
        self.passes += 1

    def _call(self, d: _Device | None, what: str, fn: Callable[[], Any]) -> Any:
        """fn(), or None when it failed; a call a GPU lacks is logged once and skipped."""
        if d is not None and what in d.unsupported:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - pynvml.NVMLError and ctypes errors
            code = error_code(exc)
            if code in (_NOT_FOUND, _NO_DATA, _TIMEOUT):
                return None  # nothing new since the last pass
            if d is not None and code in (_NOT_SUPPORTED, _NO_PERMISSION):
                d.unsupported.add(what)
                log.info("GPU %d: %s not available (%s)", d.info.index, what, exc)
                return None
            self.errors += 1
            if self.errors <= 5:
                log.warning("NVML %s failed: %s", what, exc)
            return None

    def _mono(self, ts_us: int) -> int:
        return int(ts_us) * 1000 - self.offset_ns

    def _samples(self, d: _Device) -> None:
        n = self.nvml
        for what, stype, series, attr in (
            ("gpu_samples", n.NVML_GPU_UTILIZATION_SAMPLES, d.util, "last_util_us"),
            ("mem_samples", n.NVML_MEMORY_UTILIZATION_SAMPLES, d.mem_util, "last_mem_us"),
        ):
            last = getattr(d, attr)
            got = self._call(d, what, partial(n.nvmlDeviceGetSamples, d.handle, stype, last))
            if not got:
                continue
            vtype, samples = got
            with self._lock:
                for s in samples:
                    ts = int(s.timeStamp)
                    if ts > last:
                        series.add(self._mono(ts), sample_value(vtype, s.sampleValue))
                        last = ts
            setattr(d, attr, last)

    def _proc_util(self, d: _Device) -> None:
        got = self._call(d, "process_utilization",
                         lambda: self.nvml.nvmlDeviceGetProcessUtilization(d.handle, d.last_proc_us))
        if not got:
            return
        with self._lock:
            for s in got:
                ts = int(s.timeStamp)
                if ts > d.last_proc_us:
                    d.procs.append(ProcUtil(self._mono(ts), int(s.pid), float(s.smUtil),
                                            float(s.memUtil)))
            d.last_proc_us = max([d.last_proc_us, *(int(s.timeStamp) for s in got)])

    def _gpm(self, d: _Device, now: int) -> None:
        n = self.nvml
        cur = self._call(d, "gpm", lambda: n.nvmlGpmSampleGet(d.handle, n.nvmlGpmSampleAlloc()))
        if cur is None:
            return
        prev, prev_ns = d.gpm_prev, d.gpm_prev_ns
        d.gpm_prev, d.gpm_prev_ns = cur, now
        if prev is None:
            return
        got = self._call(d, "gpm", lambda: n.nvmlGpmMetricsGet(self._gpm_request(prev, cur)))
        self._free(prev)
        if got is None:
            return
        metrics = gpm_values(got, len(GPM_METRICS))
        with self._lock:
            d.gpm.append(GpmInterval(prev_ns, now, metrics))

    def _gpm_request(self, s1: Any, s2: Any) -> Any:
        n = self.nvml
        mg = n.c_nvmlGpmMetricsGet_t()
        mg.version = n.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(GPM_METRICS)
        mg.sample1, mg.sample2 = s1, s2
        for i, mid in enumerate(GPM_METRICS.values()):
            mg.metrics[i].metricId = mid
        return mg

    def _free(self, sample: Any) -> None:
        try:
            self.nvml.nvmlGpmSampleFree(sample)
        except Exception:  # noqa: BLE001 - freeing is best effort
            self.errors += 1

    def _state(self, d: _Device, now: int) -> None:
        n, h = self.nvml, d.handle
        reads: Sequence[tuple[str, Callable[[], Any]]] = (
            ("sm_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            ("mem_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
            ("clocks_event_reasons", lambda: n.nvmlDeviceGetCurrentClocksEventReasons(h)),
            ("power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("temperature_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
            ("pcie_link_gen", lambda: n.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            ("pcie_link_width", lambda: n.nvmlDeviceGetCurrPcieLinkWidth(h)),
            ("pcie_replay_total", lambda: n.nvmlDeviceGetPcieReplayCounter(h)),
        )
        values: dict[str, float] = {}
        for name, fn in reads:
            v = self._call(d, name, fn)
            if v is not None:
                values[name] = float(v)
        mem = self._call(d, "memory", lambda: n.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            values["memory_used_bytes"] = float(mem.used)
            values["memory_total_bytes"] = float(mem.total)
        with self._lock:
            d.state.append(DeviceState(now, values))

    def _running_processes(self) -> None:
        owner: dict[int, int] = {}
        used: dict[int, int] = {}
        for d in self.devices:
            got = self._call(d, "compute_processes",
                             partial(self.nvml.nvmlDeviceGetComputeRunningProcesses, d.handle))
            for p in got or ():
                owner.setdefault(int(p.pid), d.info.index)
                used[int(p.pid)] = used.get(int(p.pid), 0) + int(p.usedGpuMemory or 0)
        with self._lock:
            self.pid_device, self.pid_memory = owner, used

    # ---- XID ----

    def _xid_set(self) -> Any | None:
        n = self.nvml
        es = self._call(None, "event_set", n.nvmlEventSetCreate)
        if es is None:
            return None
        registered = 0
        for d in self.devices:
            if self._call(d, "xid_events", partial(_registered, n, d.handle, es)):
                registered += 1
        if not registered:
            log.info("XID events not available on any GPU")
            return None
        return es

    def wait_xid(self, es: Any, timeout_ms: int) -> Xid | None:
        data = self._call(None, "xid_wait", lambda: self.nvml.nvmlEventSetWait_v2(es, timeout_ms))
        if data is None:
            return None
        dev = self._call(None, "xid_index", lambda: self.nvml.nvmlDeviceGetIndex(data.device))
        x = Xid(self._now(), int(dev) if dev is not None else -1, int(data.eventData))
        with self._lock:
            self.xids.append(x)
        log.warning("GPU %d: XID %d", x.device, x.xid)
        return x

    # ---- queries ----

    def device_of(self, pid: int) -> int | None:
        """The GPU a process computes on (the first one NVML lists it under)."""
        with self._lock:
            got = self.pid_device.get(pid)
        if got is None and len(self.devices) == 1:
            return 0
        return got

    def window(self, device: int, start_ns: int, end_ns: int, pid: int | None = None) -> GpuWindow:
        w = GpuWindow(device)
        if not 0 <= device < len(self.devices):
            return w
        d = self.devices[device]
        with self._lock:
            util, age_u = d.util.covering(start_ns, end_ns)
            mem, _ = d.mem_util.covering(start_ns, end_ns)
            gpm, age_g = _gpm_window(d.gpm, start_ns, end_ns)
            procs = [p for p in d.procs if p.pid == pid] if pid is not None else []
            state = _state_at(d.state, end_ns)
        if util:
            w.util_pct, w.util_samples = sum(util) / len(util), len(util)
        if mem:
            w.mem_util_pct = sum(mem) / len(mem)
        w.gpm = gpm
        i, j, _ = covering([q.ts_ns for q in procs], start_ns, end_ns)
        if j > i:
            p = procs[i:j]
            w.proc_sm_pct = sum(q.sm_pct for q in p) / len(p)
            w.proc_mem_pct = sum(q.mem_pct for q in p) / len(p)
        w.state = state
        w.age_ms = max(age_u, age_g) / 1e6
        return w

    def xids_between(self, start_ns: int, end_ns: int) -> list[Xid]:
        with self._lock:
            return [x for x in self.xids if start_ns <= x.ts_ns < end_ns]


def _registered(n: Any, handle: Any, es: Any) -> bool:
    n.nvmlDeviceRegisterEvents(handle, _XID_CRITICAL, es)
    return True


def _gpm_window(ivs: Iterable[GpmInterval], start: int, end: int) -> tuple[dict[str, float], int]:
    """GPM metrics over [start, end]: intervals weighted by overlap; else the newest before."""
    acc: dict[str, float] = {}
    weight = 0.0
    newest: GpmInterval | None = None
    for iv in ivs:
        if iv.end_ns <= start:
            newest = iv
            continue
        if iv.start_ns > end:
            break
        ov = max(1, min(iv.end_ns, end) - max(iv.start_ns, start))
        weight += ov
        for k, v in iv.metrics.items():
            acc[k] = acc.get(k, 0.0) + v * ov
    if weight:
        return {k: v / weight for k, v in acc.items()}, 0
    if newest is not None:
        return dict(newest.metrics), start - newest.end_ns
    return {}, 0


def _state_at(states: Iterable[DeviceState], ts: int) -> dict[str, float]:
    best: DeviceState | None = None
    for s in states:
        if s.ts_ns <= ts or best is None:
            best = s
        else:
            break
    return dict(best.values) if best is not None else {}


def sample_value(vtype: int, v: Any) -> float:
    """nvmlValue_t by nvmlValueType_t."""
    name = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
            6: "usVal"}.get(int(vtype), "uiVal")
    return float(getattr(v, name))


def gpm_values(mg: Any, count: int) -> dict[str, float]:
    """The metrics of an nvmlGpmMetricsGet answer that NVML filled (nvmlReturn 0)."""
    out: dict[str, float] = {}
    by_id = {mid: name for name, mid in GPM_METRICS.items()}
    for i in range(count):
        m = mg.metrics[i]
        name = by_id.get(int(m.metricId))
        if name is None or int(m.nvmlReturn) != 0:
            continue
        v = float(m.value)
        out[name] = v * 1024 * 1024 if name in _MIB_PER_S else v
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
