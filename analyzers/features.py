"""A per-second feature frame of node signals, kept in a bounded ring (the last `keep_s`).

Each `tick()` adds one row: per GPU the NVML readings of that second (utilisation samples,
GPM metrics, clocks, power, memory, PCIe, XIDs), per CUDA process and for the node the
per-second deltas of the kernel's CUDA counters, and whatever extra providers return (TCP,
run-queue numbers). `frame()` gives it as a pandas DataFrame: a UTC DatetimeIndex and
(signal, entity) columns, entity "gpu<i>", "pid<n>", "local_port<n>"/"peer_port<n>" (TCP
TIME_WAIT by port) or "node". The RCA reads it; exporters/node_metrics.py names its newest
row for Prometheus.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sits_trace.agent.model import Provider, Row
from sits_trace.agent.signals.cuda import CudaSignals, CudaTotals

if TYPE_CHECKING:
    import pandas as pd
    from sits_trace.agent.signals.nvml import NvmlSampler

# CUDA per-second deltas: frame signal -> CudaTotals field (ns fields become seconds)
CUDA_RATES: dict[str, str] = {
    "cuda_kernel_launches_per_s": "launches",
    "cuda_graph_launches_per_s": "graph_launches",
    "cuda_h2d_bytes_per_s": "h2d_bytes",
    "cuda_h2d_copies_per_s": "h2d_copies",
    "cuda_d2h_bytes_per_s": "d2h_bytes",
    "cuda_d2h_copies_per_s": "d2h_copies",
    "cuda_d2d_bytes_per_s": "d2d_bytes",
    "cuda_unknown_copy_bytes_per_s": "other_bytes",
    "cuda_sync_wait_s_per_s": "sync_ns",
    "cuda_syncs_per_s": "syncs",
}
_GPU_STATE = ("sm_clock_mhz", "mem_clock_mhz", "clocks_event_reasons", "power_w",
              "temperature_c", "memory_used_bytes", "pcie_link_gen", "pcie_link_width",
              "pcie_replay_total")



class FeatureFrame:
    def __init__(self, *, sampler: NvmlSampler | None = None, cuda: CudaSignals | None = None,
                 providers: Mapping[str, Provider] | None = None, keep_s: int = 3600,
                 monotonic_ns: Callable[[], int] = time.monotonic_ns,
                 clock_offset_ns: int = 0) -> None:
        self.sampler = sampler
        self.cuda = cuda
        self.providers = dict(providers or {})
        self._now = monotonic_ns
        self._offset = clock_offset_ns
        self._rows: collections.deque[tuple[int, Row]] = collections.deque(maxlen=keep_s)
        self._last_ns: int | None = None
        self._last_totals: dict[int, CudaTotals] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- rows ----

    def tick(self) -> Row:
        """Add the row of the time since the last tick (about a second)."""
        now = self._now()
        start = self._last_ns if self._last_ns is not None else now - 1_000_000_000
        self._last_ns = now
        row: Row = {}
        if self.sampler is not None:
            row.update(self._gpu_row(self.sampler, start, now))
        if self.cuda is not None:
            row.update(self._cuda_row(self.cuda, max(1, now - start) / 1e9))
        for name, provider in self.providers.items():
            try:
                row.update(_provided(name, provider()))
            except Exception:  # noqa: BLE001 - one broken provider must not stop the frame
                row[(f"{name}_errors", "node")] = 1.0
        with self._lock:
            self._rows.append((now + self._offset, row))
        return row

    def _gpu_row(self, s: NvmlSampler, start: int, end: int) -> Row:
        row: Row = {}
        for d in s.devices:
            ent = f"gpu{d.info.index}"
            w = s.window(d.info.index, start, end)
            if w.util_pct is not None:
                row[("gpu_util_pct", ent)] = w.util_pct
            if w.mem_util_pct is not None:
                row[("mem_util_pct", ent)] = w.mem_util_pct
            for k, v in w.gpm.items():
                row[(k, ent)] = v
            for k in _GPU_STATE:
                if k in w.state:
                    row[(k, ent)] = w.state[k]
            if "memory_used_bytes" in w.state:
                row[("memory_free_bytes", ent)] = d.info.memory_total - w.state["memory_used_bytes"]
            xids = [x for x in s.xids_between(start, end) if x.device == d.info.index]
            row[("xid_events", ent)] = float(len(xids))
            if xids:
                row[("xid_last", ent)] = float(xids[-1].xid)
        return row

    def _cuda_row(self, c: CudaSignals, dt_s: float) -> Row:
        totals = c.totals()
        row: Row = {}
        node: dict[str, float] = dict.fromkeys(CUDA_RATES, 0.0)
        for pid, t in totals.items():
            prev = self._last_totals.get(pid, CudaTotals())
            for sig, fld in CUDA_RATES.items():
                d = max(0, getattr(t, fld) - getattr(prev, fld))
                v = (d / 1e9 if fld.endswith("_ns") else d) / dt_s
                row[(sig, f"pid{pid}")] = v
                node[sig] += v
        self._last_totals = totals
        row.update({(sig, "node"): v for sig, v in node.items()})
        return row

    @property
    def devices(self) -> Sequence[Any]:
        """The GPUs the rows describe (labels for metric_samples)."""
        return self.sampler.devices if self.sampler is not None else ()

    # ---- the frame ----

    def frame(self) -> pd.DataFrame:
        import pandas as pd  # noqa: PLC0415 - only the RCA stage needs pandas

        with self._lock:
            rows = list(self._rows)
        idx = pd.to_datetime([t for t, _ in rows], unit="ns", utc=True)
        df = pd.DataFrame([r for _, r in rows], index=idx)
        if len(df.columns):
            df.columns = pd.MultiIndex.from_tuples(list(df.columns), names=["signal", "entity"])
        df.index.name = "time"
        return df.sort_index(axis=1)

    def latest(self) -> Row:
        with self._lock:
            return dict(self._rows[-1][1]) if self._rows else {}

    def __len__(self) -> int:
        return len(self._rows)

    # ---- a thread that ticks every second ----

    def start(self, every_s: float = 1.0) -> None:
        def loop() -> None:
            while not self._stop.wait(every_s):
                self.tick()

        self._thread = threading.Thread(target=loop, name="sits-features", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


def _provided(name: str, values: Mapping[str | tuple[str, str], float]) -> Row:
    row: Row = {}
    for k, v in values.items():
        sig, ent = (k, "node") if isinstance(k, str) else k
        row[(f"{name}_{sig}", ent)] = float(v)
    return row
