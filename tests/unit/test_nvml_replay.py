"""NvmlSampler on NVML answers recorded on an H200 (tests/gpu/scenario.py): a PyTorch server
under load, then the same load while another process copies pinned memory to the GPU.

The fixture holds every nvml* call the agent's sampler made and its answer; ReplayNvml gives
them back in order, so the sampler's code runs exactly as on the GPU machine.
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

pynvml = pytest.importorskip("pynvml")

from sits_trace.agent.signals.nvml import NvmlSampler, covering, gpm_values, sample_value

from tests.support.nvml_replay import RecordingNvml, ReplayNvml

FIXTURE = Path(__file__).parents[1] / "fixtures/nvml/h200_torch_pcie_contention.json.gz"
META = json.loads(gzip.decompress(FIXTURE.read_bytes()))["meta"]


class ReplayClock(ReplayNvml):  # type: ignore[misc]
    """The replay, plus a clock that follows the newest utilisation sample answered (the
    sampler's own clock was not recorded; samples come every ~0.2 s)."""

    def __init__(self) -> None:
        super().__init__(FIXTURE, pynvml)
        self.newest_us = 0

    def nvmlDeviceGetSamples(self, *args: Any) -> Any:
        got = ReplayNvml.__getattr__(self, "nvmlDeviceGetSamples")(*args)
        if got[1]:
            self.newest_us = max(self.newest_us, max(s.timeStamp for s in got[1]))
        return got

    def now_ns(self) -> int:
        start_us = META["phases"]["untraced"][0] // 1000
        return int(max(self.newest_us, start_us) * 1000 - self.clock_offset_ns + 100_000_000)


@pytest.fixture(scope="module")
def sampler() -> NvmlSampler:
    nv = ReplayClock()
    s = NvmlSampler(nv, interval_s=0.1, clock_offset_ns=nv.clock_offset_ns,
                    monotonic_ns=nv.now_ns)
    for _ in range(META["passes"]):
        s.sample_once()
    assert nv.exhausted("nvmlGpmMetricsGet")
    return s


def _mono(unix_ns: int) -> int:
    return unix_ns - int(META["clock_offset_ns"])


def _phase(name: str, trim_s: float = 1.0) -> tuple[int, int]:
    lo, hi = META["phases"][name]
    return _mono(lo) + int(trim_s * 1e9), _mono(hi) - int(trim_s * 1e9)


def test_device_found(sampler: NvmlSampler) -> None:
    (d,) = sampler.devices
    assert d.info.name == "NVIDIA H200"
    assert d.info.gpm
    assert d.info.memory_total > 140 * 2**30
    assert sampler.errors == 0


def test_processes_mapped_to_their_gpu(sampler: NvmlSampler) -> None:
    assert sampler.device_of(META["server_pid"]) == 0
    assert META["competitor_pid"] not in sampler.pid_device  # gone by the last reading


def _series(s: NvmlSampler, name: str, key: str, step_s: float = 0.5) -> list[float]:
    lo, hi = _phase(name)
    out = []
    t = lo
    while t < hi:
        w = s.window(0, t, t + int(step_s * 1e9))
        v = w.gpm.get(key) if key in w.gpm else getattr(w, key, None)
        if v is not None:
            out.append(float(v))
        t += int(step_s * 1e9)
    return out


def test_pcie_contention_shows_in_gpm(sampler: NvmlSampler) -> None:
    base = statistics.median(_series(sampler, "baseline", "pcie_rx_bytes_per_s"))
    cont = statistics.median(_series(sampler, "contention", "pcie_rx_bytes_per_s"))
    after = statistics.median(_series(sampler, "after", "pcie_rx_bytes_per_s"))
    # the server's 16 MiB inputs alone: a few GB/s; the competitor's pinned copies: ~50 GB/s
    assert 1e9 < base < 10e9
    assert cont > 40e9
    assert cont > 5 * base
    assert after < 10e9


def test_utilisation_samples(sampler: NvmlSampler) -> None:
    base = statistics.median(_series(sampler, "baseline", "util_pct"))
    cont = statistics.median(_series(sampler, "contention", "util_pct"))
    assert 5 <= base <= 50
    assert cont >= 90
    untraced_idle = sampler.window(0, *_phase("untraced", 0.0))
    assert untraced_idle.util_samples > 0


def test_state_readings(sampler: NvmlSampler) -> None:
    lo, hi = _phase("baseline")
    st = sampler.window(0, lo, hi).state
    assert st["pcie_link_gen"] == 5 and st["pcie_link_width"] == 16
    assert st["sm_clock_mhz"] > 1000
    assert 50 < st["power_w"] < 1000
    assert st["memory_used_bytes"] > 0


def test_process_utilisation(sampler: NvmlSampler) -> None:
    lo, hi = _phase("baseline")
    w = sampler.window(0, lo, hi, pid=META["server_pid"])
    assert w.proc_sm_pct is not None and w.proc_sm_pct > 0


def test_old_readings_are_marked_by_age(sampler: NvmlSampler) -> None:
    far = _mono(META["phases"]["after"][1]) + 60_000_000_000
    w = sampler.window(0, far, far + 1_000_000)
    assert 55_000 < w.age_ms <= 60_000  # the recording went on a little past the phase


def test_covering() -> None:
    ts = [10, 20, 30, 40]
    assert covering(ts, 12, 28) == (1, 3, 0)  # 20 and the sample after 28 (30)
    assert covering(ts, 41, 50) == (3, 4, 1)  # nothing newer: the newest, 1 before
    assert covering([], 0, 1) == (0, 0, 0)


def test_value_helpers() -> None:
    class V:
        uiVal, dVal, ullVal = 7, 2.5, 9

    assert sample_value(1, V) == 7.0 and sample_value(0, V) == 2.5 and sample_value(3, V) == 9

    class M:
        def __init__(self, mid: int, ret: int, value: float) -> None:
            self.metricId, self.nvmlReturn, self.value = mid, ret, value

    class G:
        metrics = (M(2, 0, 40.0), M(21, 0, 2.0), M(3, 3, 1.0))

    assert gpm_values(G, 3) == {"sm_active_pct": 40.0, "pcie_rx_bytes_per_s": 2.0 * 2**20}


def test_recording_round_trip(tmp_path: Path) -> None:
    """A recording of a replay replays the same answers (what the fixture relies on)."""
    nv = ReplayNvml(FIXTURE, pynvml)
    rec = RecordingNvml(nv, meta={"clock_offset_ns": nv.clock_offset_ns})
    s1 = NvmlSampler(rec, clock_offset_ns=nv.clock_offset_ns, monotonic_ns=iter(
        range(0, 10**12, 10**8)).__next__)
    for _ in range(30):
        s1.sample_once()
    path = tmp_path / "again.json"
    rec.save(path)
    again = ReplayNvml(path, pynvml)
    s2 = NvmlSampler(again, clock_offset_ns=nv.clock_offset_ns, monotonic_ns=iter(
        range(0, 10**12, 10**8)).__next__)
    for _ in range(30):
        s2.sample_once()
    assert list(s1.devices[0].util.v) == list(s2.devices[0].util.v)
    assert [g.metrics for g in s1.devices[0].gpm] == [g.metrics for g in s2.devices[0].gpm]
    assert s2.pid_device == s1.pid_device


def test_no_nvml_library_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    from sits_trace.agent.signals import nvml

    def broken() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    assert nvml.load_nvml() is None
    assert len([r for r in caplog.records if "GPU signals off" in r.message]) == 1
