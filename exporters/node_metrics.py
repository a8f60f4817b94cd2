"""Metric names for node signals: DCGM's names and units where DCGM has the signal,
`sits_<signal>` for the rest, and the kernel's cumulative counters (CUDA, TCP, run queue)
for a scrape-time collector. The agent produces rows and totals; naming them is export's job.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sits_trace.agent.model import MetricSample, Row
from sits_trace.agent.signals.cuda import CudaTotals

if TYPE_CHECKING:
    from sits_trace.agent.signals.node import NodeSignals

# frame signal -> (DCGM field name, factor from the frame's unit to DCGM's)
DCGM_NAMES: dict[str, tuple[str, float]] = {
    "gpu_util_pct": ("DCGM_FI_DEV_GPU_UTIL", 1.0),
    "mem_util_pct": ("DCGM_FI_DEV_MEM_COPY_UTIL", 1.0),
    "graphics_active_pct": ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.01),  # DCGM: a ratio 0..1
    "sm_active_pct": ("DCGM_FI_PROF_SM_ACTIVE", 0.01),
    "sm_occupancy_pct": ("DCGM_FI_PROF_SM_OCCUPANCY", 0.01),
    "tensor_active_pct": ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.01),
    "dram_active_pct": ("DCGM_FI_PROF_DRAM_ACTIVE", 0.01),
    "pcie_tx_bytes_per_s": ("DCGM_FI_PROF_PCIE_TX_BYTES", 1.0),
    "pcie_rx_bytes_per_s": ("DCGM_FI_PROF_PCIE_RX_BYTES", 1.0),
    "sm_clock_mhz": ("DCGM_FI_DEV_SM_CLOCK", 1.0),
    "mem_clock_mhz": ("DCGM_FI_DEV_MEM_CLOCK", 1.0),
    "power_w": ("DCGM_FI_DEV_POWER_USAGE", 1.0),
    "temperature_c": ("DCGM_FI_DEV_GPU_TEMP", 1.0),
    "memory_used_bytes": ("DCGM_FI_DEV_FB_USED", 1.0 / 2**20),  # DCGM: MiB
    "memory_free_bytes": ("DCGM_FI_DEV_FB_FREE", 1.0 / 2**20),
    "clocks_event_reasons": ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 1.0),
    "pcie_replay_total": ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 1.0),
    "pcie_link_gen": ("DCGM_FI_DEV_PCIE_LINK_GEN", 1.0),
    "pcie_link_width": ("DCGM_FI_DEV_PCIE_LINK_WIDTH", 1.0),
    "xid_last": ("DCGM_FI_DEV_XID_ERRORS", 1.0),
}

_PORT_ENTITIES = (("local_port", "local"), ("peer_port", "peer"))


def _gpu_labels(ent: str, devices: Sequence[Any]) -> dict[str, str]:
    i = int(ent[3:])
    labels = {"gpu": str(i)}
    for d in devices:
        if d.info.index == i:
            labels.update(UUID=d.info.uuid, modelName=d.info.name, pci_bus_id=d.info.pci_bus_id)
    return labels


def metric_samples(row: Row, devices: Sequence[Any] = ()) -> Iterator[MetricSample]:
    """(name, labels, value) for one frame row: DCGM names and units for GPU signals,
    sits_<signal> for the rest (labels gpu / pid / port and side)."""
    for (sig, ent), v in sorted(row.items()):
        if ent.startswith("gpu"):
            name, factor = DCGM_NAMES.get(sig, (f"sits_gpu_{sig}", 1.0))
            yield MetricSample(name, _gpu_labels(ent, devices), v * factor)
        else:
            yield MetricSample(f"sits_{sig}", entity_labels(ent), v)


def entity_labels(ent: str) -> dict[str, str]:
    """Prometheus labels of a non-GPU entity: pid<n>, local_port<n>/peer_port<n>, node."""
    if ent.startswith("pid"):
        return {"pid": ent[3:]}
    for prefix, side in _PORT_ENTITIES:
        if ent.startswith(prefix):
            return {"port": ent[len(prefix):], "side": side}
    return {}


def cuda_counter_samples(totals: Mapping[int, CudaTotals]) -> Iterator[MetricSample]:
    """Cumulative CUDA counters per process, for a scrape-time collector (`_total`)."""
    for pid, t in sorted(totals.items()):
        p = str(pid)
        yield MetricSample("sits_cuda_kernel_launches_total", {"pid": p}, float(t.launches))
        yield MetricSample("sits_cuda_graph_launches_total", {"pid": p}, float(t.graph_launches))
        for d, b, n in (("h2d", t.h2d_bytes, t.h2d_copies), ("d2h", t.d2h_bytes, t.d2h_copies),
                        ("d2d", t.d2d_bytes, t.d2d_copies),
                        ("unknown", t.other_bytes, t.other_copies)):
            yield MetricSample("sits_cuda_copy_bytes_total", {"pid": p, "direction": d}, float(b))
            yield MetricSample("sits_cuda_copies_total", {"pid": p, "direction": d}, float(n))
        yield MetricSample("sits_cuda_sync_wait_seconds_total", {"pid": p}, t.sync_ns / 1e9)
        yield MetricSample("sits_cuda_syncs_total", {"pid": p}, float(t.syncs))
        yield MetricSample("sits_cuda_failed_calls_total", {"pid": p}, float(t.failed))


def counter_samples(node: NodeSignals) -> Iterator[MetricSample]:
    """The kernel's cumulative counters, read now (for a scrape-time collector)."""
    if node.tcp is not None:
        for name, v in node.tcp.totals().items():
            yield MetricSample(f"sits_tcp_{name}_total", {}, float(v))
    if node.sched is not None:
        for pid, (delay_ns, waits) in sorted(node.sched.proc_totals().items()):
            labels = {"pid": str(pid)}
            yield MetricSample("sits_cpu_runq_delay_seconds_total", labels, delay_ns / 1e9)
            yield MetricSample("sits_cpu_runq_waits_total", labels, float(waits))
