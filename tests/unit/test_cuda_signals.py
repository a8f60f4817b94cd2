"""agent/signals/cuda without a kernel: EV_CUDA_COPY records recorded on an H200 (a PyTorch server,
tests/gpu/scenario.py), address-range direction resolution, slot windows over DictCudaMaps."""

from __future__ import annotations

import collections
import ctypes
from pathlib import Path

import pytest
from sits_trace.agent.capture.events import DecodeError, Kind
from sits_trace.agent.capture.loader import RecordedSource
from sits_trace.agent.capture.wire import (
    CopyDir,
    CudaApi,
    CudaCopyEventC,
    CudaInitEventC,
    CudaMemEventC,
    CudaProcC,
    CudaSlotC,
    CudaSlotKeyC,
    MemKind,
)
from sits_trace.agent.model import ConnInfo, Exchange, RequestHead, ResponseHead, Role, Span
from sits_trace.agent.signals.cuda import (
    CUDA_UPROBES,
    AddressMap,
    CudaSignals,
    DictCudaMaps,
    decode_copy,
    decode_totals,
    slot_key,
    unique_files,
)

FIXTURE = Path(__file__).parents[1] / "fixtures/cuda/h200_torch_server.rec"
SHIFT = 20


def _records() -> list[bytes]:
    return list(RecordedSource(FIXTURE, batch=10_000).read(0))


def test_recorded_copies_decode() -> None:
    """Each request of the H200 server: one 16 MiB H2D and one 64 B D2H on the default stream."""
    copies = [decode_copy(r) for r in _records()]
    kinds = collections.Counter((c.api, c.bytes, c.direction, c.stream) for c in copies)
    assert kinds == {(CudaApi.MEMCPY_HTOD_ASYNC, 16 << 20, CopyDir.H2D, 0): 200,
                     (CudaApi.MEMCPY_DTOH_ASYNC, 64, CopyDir.D2H, 0): 200}
    assert len({c.pid for c in copies}) == 1
    assert all(c.ts_exit_ns >= c.ts_enter_ns for c in copies)
    # pageable H2D copies return when copied: milliseconds for 16 MiB
    h2d = sorted(c.ts_exit_ns - c.ts_enter_ns for c in copies if c.direction is CopyDir.H2D)
    assert 0.5e6 < h2d[len(h2d) // 2] < 20e6


def test_decode_rejects_short_and_wrong_kind() -> None:
    raw = _records()[0]
    with pytest.raises(DecodeError):
        decode_copy(raw[:40])
    with pytest.raises(DecodeError):
        decode_copy(bytes([Kind.CUDA_MEM]) + raw[1:])


def test_record_sizes_match_cuda_c() -> None:
    assert ctypes.sizeof(CudaCopyEventC) == 72
    assert ctypes.sizeof(CudaMemEventC) == 48
    assert ctypes.sizeof(CudaInitEventC) == 24
    assert ctypes.sizeof(CudaSlotC) == 48 and ctypes.sizeof(CudaSlotKeyC) == 16
    text = (Path(__file__).parents[2] / "bpf/cuda.c").read_text()
    for p in CUDA_UPROBES:  # every program the probe table names is defined in cuda.c
        for fn in filter(None, (p.fn_enter, p.fn_exit)):
            short = fn.removeprefix("sits_cuda_")
            assert f"int {fn}(" in text or f"CUDA_CALL({short}," in text, fn


def _mem(pid: int, ptr: int, size: int, kind: MemKind, op: int = 1) -> bytes:
    return bytes(CudaMemEventC(kind=Kind.CUDA_MEM, tgid=pid, ptr=ptr, bytes=size, op=op,
                               mem=kind, api=CudaApi.MEM_ALLOC))


def _copy(pid: int, ts: int, dst: int, src: int, n: int, api: CudaApi,
          direction: CopyDir = CopyDir.UNKNOWN) -> bytes:
    return bytes(CudaCopyEventC(kind=Kind.CUDA_COPY, tgid=pid, ts_enter_ns=ts, ts_exit_ns=ts + 10,
                                bytes=n, dst=dst, src=src, api=api, direction=direction,
                                is_async=1))


def test_address_map() -> None:
    m = AddressMap()
    m.add(0x1000, 0x100, MemKind.DEVICE)
    m.add(0x5000, 0x100, MemKind.HOST)
    assert m.kind_of(0x10ff) is MemKind.DEVICE and m.kind_of(0x1100) is None
    assert m.direction(0x1010, 0x5010) is CopyDir.H2D
    assert m.direction(0x5010, 0x1010) is CopyDir.D2H
    assert m.direction(0x1010, 0x1020) is CopyDir.D2D
    assert m.direction(0x1010, 0x9000) is CopyDir.UNKNOWN  # 0x9000: allocations not all seen
    m.complete = True
    assert m.direction(0x1010, 0x9000) is CopyDir.H2D  # now: pageable host memory
    m.remove(0x1000)
    assert m.direction(0x1010, 0x9000) is CopyDir.UNKNOWN  # host to host


def test_unknown_direction_resolved_after_cuinit() -> None:
    sig = CudaSignals(DictCudaMaps(), monotonic_ns=lambda: 1000)
    sig.on_init(bytes(CudaInitEventC(kind=Kind.CUDA_INIT, tgid=7)))
    sig.on_mem(_mem(7, 0x7f00_0000_0000, 1 << 20, MemKind.DEVICE))
    sig.on_copy(_copy(7, 100, 0x7f00_0000_0010, 0x5555_0000, 777, CudaApi.MEMCPY_ASYNC))
    sig.on_copy(_copy(8, 100, 0x7f00_0000_0010, 0x5555_0000, 5, CudaApi.MEMCPY_ASYNC))
    assert sig.window(7, 0, 1000).copy_bytes == {CopyDir.H2D: 777}
    assert sig.window(8, 0, 1000).copy_bytes == {CopyDir.UNKNOWN: 5}  # pid 8: no cuInit seen


def _put_slot(maps: DictCudaMaps, pid: int, slot: int, launches: int, first: int, last: int,
              syncs: int = 0, sync_ns: int = 0) -> None:
    maps.slot_map[slot_key(pid, slot)] = bytes(CudaSlotC(
        launches=launches, syncs=syncs, sync_ns=sync_ns, first_ns=first, last_ns=last))


def test_windows_count_whole_slots_and_share_edges() -> None:
    maps = DictCudaMaps()
    now = [100 << SHIFT]
    sig = CudaSignals(maps, slot_shift=SHIFT, monotonic_ns=lambda: now[0])
    base = 10 << SHIFT
    _put_slot(maps, 1, 10, 10, base + 100, base + 200)  # activity 100..200 ns into slot 10
    _put_slot(maps, 1, 11, 4, (11 << SHIFT) + 0, (11 << SHIFT) + 1000, syncs=2, sync_ns=5000)
    sig.poll()
    assert maps.slot_map == {}  # older than two slots: read and deleted
    w = sig.window(1, base + 50, base + 250)  # holds all of slot 10's activity
    assert (w.launches, w.syncs) == (10, 0)
    w = sig.window(1, base + 150, base + 250)  # half of it
    assert w.launches == 5
    w = sig.window(1, base, (11 << SHIFT) + 500)  # slot 10 whole, half of slot 11
    assert (w.launches, w.syncs, w.sync_wait_ns) == (12, 1, 2500)
    assert sig.window(2, 0, 1 << 40).seen is False


def test_slot_recreated_after_delete_adds_up() -> None:
    maps = DictCudaMaps()
    now = [100 << SHIFT]
    sig = CudaSignals(maps, slot_shift=SHIFT, monotonic_ns=lambda: now[0])
    _put_slot(maps, 1, 50, 3, 50 << SHIFT, (50 << SHIFT) + 10)
    sig.poll()
    _put_slot(maps, 1, 50, 2, (50 << SHIFT) + 20, (50 << SHIFT) + 30)  # a late CPU
    sig.poll()
    assert sig.window(1, 50 << SHIFT, 51 << SHIFT).launches == 5


def test_recent_slots_are_kept_and_replaced() -> None:
    maps = DictCudaMaps()
    now = [100 << SHIFT]
    sig = CudaSignals(maps, slot_shift=SHIFT, monotonic_ns=lambda: now[0])
    _put_slot(maps, 1, 99, 3, 99 << SHIFT, (99 << SHIFT) + 10)
    sig.poll()
    assert len(maps.slot_map) == 1  # a CPU may still add to it
    _put_slot(maps, 1, 99, 7, 99 << SHIFT, (99 << SHIFT) + 20)
    sig.poll()
    assert sig.window(1, 99 << SHIFT, 100 << SHIFT).launches == 7


def test_totals_from_proc_map() -> None:
    maps = DictCudaMaps()
    maps.proc_map[(508).to_bytes(4, "little")] = bytes(CudaProcC(launches=41456, h2d_bytes=3))
    t = CudaSignals(maps).totals()[508]
    assert (t.launches, t.h2d_bytes) == (41456, 3)
    assert decode_totals(bytes(CudaProcC(syncs=2))).syncs == 2


def test_unique_files_by_inode(tmp_path: Path) -> None:
    real = tmp_path / "libcuda.so.1"
    real.write_bytes(b"\x7fELF")
    link = tmp_path / "other-path.so"
    link.symlink_to(real)
    assert unique_files([str(real), str(link), str(tmp_path / "missing")]) == [str(real)]


def test_annotator_on_recorded_copies() -> None:
    """signals/gpu.py: a span gets the copies of its own process and window, from real records."""
    from sits_trace.agent.signals.gpu import GpuSignals

    recs = _records()
    copies = [decode_copy(r) for r in recs]
    now = copies[-1].ts_exit_ns + 1_000_000_000  # the recording machine's clock
    sig = CudaSignals(DictCudaMaps(), monotonic_ns=lambda: now)
    for r in recs:
        sig.on_copy(r)
    first, second = copies[0], copies[2]  # H2D of request 1, H2D of request 2
    pid = first.pid
    req = RequestHead("GET", "/infer", "1.1", [], first.ts_enter_ns - 1000, first.ts_enter_ns)
    resp = ResponseHead(200, "1.1", [], second.ts_enter_ns - 2, second.ts_enter_ns - 1)
    ex = Exchange(ConnInfo(1, pid, 5, Role.SERVER), req, resp)
    span = Span("0" * 32, "0" * 16, None, "GET", "SERVER", 0, 1)
    GpuSignals(sig, None, None).annotate(ex, span)
    a = span.attributes
    assert (a["sits.cuda.h2d_bytes"], a["sits.cuda.h2d_copies"]) == (16 << 20, 1)
    assert (a["sits.cuda.d2h_bytes"], a["sits.cuda.d2h_copies"]) == (64, 1)
    assert "sits.gpu.index" not in a  # no NVML here


def test_no_slot_map_read_until_a_libcuda_is_probed() -> None:
    """signals/gpu.py: with no libcuda probed the kernel's CUDA maps stay empty, so the loop
    does not read them (a batch lookup sized to the whole map, each loop); once one is
    probed, it does."""
    from types import SimpleNamespace

    from sits_trace.agent.signals.gpu import GpuSignals

    maps = DictCudaMaps()
    reads: list[int] = []
    real = maps.slots

    def counted() -> list[tuple[bytes, bytes]]:
        reads.append(1)
        return real()

    maps.slots = counted  # type: ignore[method-assign]
    now = [100 << SHIFT]
    sig = CudaSignals(maps, slot_shift=SHIFT, monotonic_ns=lambda: now[0])
    probes = SimpleNamespace(libraries=[], check_process=lambda pid: None)
    gpu = GpuSignals(sig, probes, None)  # type: ignore[arg-type]
    tracer = SimpleNamespace(handlers={}, annotators=[])
    gpu.install(tracer)  # type: ignore[arg-type]
    assert tracer.annotators == []  # nothing to read: no annotator, no cost per span
    ex = Exchange(ConnInfo(1, 7, 5, Role.SERVER), RequestHead("GET", "/", "1.1", [], 1, 2),
                  ResponseHead(200, "1.1", [], 3, now[0]))
    span = Span("0" * 32, "0" * 16, None, "GET", "SERVER", 0, 1)
    gpu.poll()
    gpu.annotate(ex, span)
    assert reads == [] and "sits.cuda.kernel_launches" not in span.attributes
    probes.libraries.append("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    gpu.check_process(7)  # a process that exec'd and maps libcuda: the annotator joins, once
    gpu.check_process(7)
    assert tracer.annotators == [gpu.annotate]
    _put_slot(maps, 7, 99, 3, 99 << SHIFT, (99 << SHIFT) + 10)
    gpu.poll()
    assert reads == [1]
    gpu.annotate(ex, span)
    assert span.attributes["sits.cuda.kernel_launches"] == 3
