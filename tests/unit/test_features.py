"""The per-second feature frame, its DCGM names, and the GPU span annotator, on NVML answers
recorded on an H200 (tests/fixtures/nvml) and CUDA counters shaped like cuda.c's map."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("pandas")
pynvml = pytest.importorskip("pynvml")

from sits_trace.agent.capture.wire import CudaProcC
from sits_trace.agent.model import (
    ConnInfo,
    Exchange,
    RequestHead,
    ResponseHead,
    Role,
    Span,
)
from sits_trace.agent.signals.cuda import CudaSignals, DictCudaMaps
from sits_trace.agent.signals.gpu import GpuSignals
from sits_trace.agent.signals.nvml import NvmlSampler
from sits_trace.analyzers.features import FeatureFrame
from sits_trace.exporters.node_metrics import DCGM_NAMES, cuda_counter_samples, metric_samples

from .test_nvml_replay import META, ReplayClock, _mono, _phase


@pytest.fixture(scope="module")
def replayed() -> tuple[NvmlSampler, FeatureFrame]:
    """The recorded run replayed pass by pass, one frame row per ten passes (a second)."""
    nv = ReplayClock()
    s = NvmlSampler(nv, clock_offset_ns=nv.clock_offset_ns, monotonic_ns=nv.now_ns)
    f = FeatureFrame(sampler=s, monotonic_ns=nv.now_ns, clock_offset_ns=nv.clock_offset_ns,
                     keep_s=30)
    for i in range(META["passes"]):
        s.sample_once()
        if i % 10 == 9:
            f.tick()
    return s, f


def test_frame_shape_and_bound(replayed: tuple[NvmlSampler, FeatureFrame]) -> None:
    _, f = replayed
    df = f.frame()
    assert len(df) == 30  # keep_s rows, the oldest dropped
    assert df.index.is_monotonic_increasing and str(df.index.tz) == "UTC"
    assert {"gpu_util_pct", "pcie_rx_bytes_per_s", "sm_active_pct", "power_w",
            "clocks_event_reasons", "pcie_replay_total"} <= set(df.columns.get_level_values(0))
    assert set(df.columns.get_level_values(1)) == {"gpu0"}


def test_contention_visible_per_second(replayed: tuple[NvmlSampler, FeatureFrame]) -> None:
    _, f = replayed
    df = f.frame()
    rx = df[("pcie_rx_bytes_per_s", "gpu0")]
    lo, hi = (META["phases"]["contention"][0] + 1_000_000_000,
              META["phases"]["contention"][1] - 1_000_000_000)
    during = rx[(rx.index.asi8 >= lo) & (rx.index.asi8 <= hi)]
    lo_a, hi_a = META["phases"]["after"]
    after = rx[(rx.index.asi8 >= lo_a + 1_000_000_000) & (rx.index.asi8 <= hi_a)]
    assert len(during) >= 8 and len(after) >= 2
    assert during.median() > 40e9
    assert after.median() < 10e9


def test_metric_samples_use_dcgm_names_and_units(
        replayed: tuple[NvmlSampler, FeatureFrame]) -> None:
    s, f = replayed
    row = f.latest()
    got = {m.name: m for m in metric_samples(row, s.devices)}
    sm = got["DCGM_FI_PROF_SM_ACTIVE"]
    assert sm.labels["gpu"] == "0" and sm.labels["modelName"] == "NVIDIA H200"
    assert sm.value == pytest.approx(row[("sm_active_pct", "gpu0")] / 100)  # DCGM: a ratio
    assert got["DCGM_FI_DEV_FB_USED"].value == pytest.approx(
        row[("memory_used_bytes", "gpu0")] / 2**20)  # DCGM: MiB
    assert got["DCGM_FI_DEV_PCIE_LINK_GEN"].value == 5
    assert all(name.startswith(("DCGM_FI_", "sits_")) for name in got)
    assert {n for n, _ in DCGM_NAMES.values()} >= {"DCGM_FI_DEV_GPU_UTIL",
                                                  "DCGM_FI_PROF_PCIE_TX_BYTES"}


def test_cuda_rates_per_process_and_node() -> None:
    maps = DictCudaMaps()
    now = [0]
    f = FeatureFrame(cuda=CudaSignals(maps), monotonic_ns=lambda: now[0])
    key = (508).to_bytes(4, "little")
    maps.proc_map[key] = bytes(CudaProcC(launches=100, h2d_bytes=16 << 20, sync_ns=10**8))
    now[0] = 1_000_000_000
    f.tick()
    maps.proc_map[key] = bytes(CudaProcC(launches=180, h2d_bytes=48 << 20, sync_ns=3 * 10**8))
    now[0] = 3_000_000_000
    row = f.tick()
    assert row[("cuda_kernel_launches_per_s", "pid508")] == 40.0
    assert row[("cuda_h2d_bytes_per_s", "node")] == 16 << 20
    assert row[("cuda_sync_wait_s_per_s", "pid508")] == pytest.approx(0.1)
    names = {(m.name, m.labels.get("direction")) for m in
             cuda_counter_samples(CudaSignals(maps).totals())}
    assert ("sits_cuda_copy_bytes_total", "h2d") in names
    assert ("sits_cuda_sync_wait_seconds_total", None) in names


def test_provider_errors_do_not_stop_the_frame() -> None:
    def broken() -> dict[str, float]:
        raise RuntimeError("boom")

    f = FeatureFrame(providers={"tcp": lambda: {"retransmits": 3.0}, "bad": broken})
    row = f.tick()
    assert row[("tcp_retransmits", "node")] == 3.0 and row[("bad_errors", "node")] == 1.0


def _span_in(sampler: NvmlSampler, phase: str, at_s: float, dur_ms: float) -> Span:
    lo, _ = _phase(phase, 0.0)
    start = lo + int(at_s * 1e9)
    end = start + int(dur_ms * 1e6)
    req = RequestHead("GET", "/infer", "1.1", [], start, start + 1000)
    ex = Exchange(ConnInfo(1, META["server_pid"], 5, Role.SERVER), req,
                  ResponseHead(200, "1.1", [], end - 1000, end))
    span = Span("0" * 32, "0" * 16, None, "GET", "SERVER", 0, 1)
    GpuSignals(None, None, sampler).annotate(ex, span)
    return span


def test_span_gets_its_gpu_window(replayed: tuple[NvmlSampler, FeatureFrame]) -> None:
    s, _ = replayed
    base = [_span_in(s, "baseline", t, 4.0).attributes for t in (2, 4, 6, 8)]
    cont = [_span_in(s, "contention", t, 10.0).attributes for t in (2, 4, 6, 8)]
    rx_b = statistics.median(float(a["sits.gpu.pcie_rx_bytes_per_s"]) for a in base)
    rx_c = statistics.median(float(a["sits.gpu.pcie_rx_bytes_per_s"]) for a in cont)
    assert rx_c > 5 * rx_b
    assert all(a["sits.gpu.index"] == 0 and str(a["sits.gpu.uuid"]).startswith("GPU-")
               for a in base + cont)
    assert statistics.median(float(a["sits.gpu.utilization_pct"]) for a in cont) >= 90
    assert all("sits.gpu.sm_active_pct" in a and "sits.gpu.sm_clock_mhz" in a for a in base)
    assert _mono(META["phases"]["baseline"][0]) > 0
