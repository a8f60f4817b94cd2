"""GPU causes: a victim's slower copies are pcie_contention only when another process's transfers
rose; with only another process's kernel launches rising they are gpu_compute_contention (seen
on the H200: a compute competitor made the server's pageable copies 3.4 ms slower)."""

from __future__ import annotations

import pandas as pd
from sits_trace.analyzers.rca import causes as C
from sits_trace.analyzers.rca.decompose import Decomposition
from sits_trace.analyzers.rca.rank import Context, ranked


def _frame(rows: dict[tuple[str, str], float]) -> pd.DataFrame:
    df = pd.DataFrame([rows] * 4)
    df.columns = pd.MultiIndex.from_tuples(list(df.columns), names=["signal", "entity"])
    return df


def _ctx(win: dict[tuple[str, str], float]) -> Context:
    base = {("cuda_h2d_bytes_per_s", "pid100"): 4e9, ("cuda_kernel_launches_per_s", "pid100"): 2400}
    empty = pd.DataFrame()
    return Context(victim_pids={100}, win=empty, base=empty, frame_win=_frame({**base, **win}),
                   frame_base=_frame(base), exclude_pids=set())


def _decomp() -> Decomposition:
    steady = dict.fromkeys(['chunks', 'error', 'in_flight', 'req_bytes', 'requests_per_s', 'retransmits_per_request', 'srtt_ms'], (1.0, 1.0))
    return Decomposition("duration_ms", 7.0, 10.4, explained_ms={C.PCIE_CONTENTION: 3.4},
                         signals={**steady, "cuda_copy_ms": (6.1, 9.5), "cuda_sync_ms": (0.2, 0.2)})


SCORES = {C.PCIE_CONTENTION: 0.98, C.CPU_STARVATION: 0.9, C.GPU_COMPUTE_CONTENTION: 0.01}


def test_kernel_launches_of_another_process_make_it_compute_contention() -> None:
    ctx = _ctx({("cuda_kernel_launches_per_s", "pid866"): 300.0,
                ("cuda_h2d_bytes_per_s", "pid866"): 0.0})
    top = ranked(_decomp(), ctx, SCORES)[0]
    assert top.cause == C.GPU_COMPUTE_CONTENTION
    assert top.culprit is not None and top.culprit["pid"] == 866
    assert abs(top.explained_ms - 3.4) < 1e-9


def test_transfers_of_another_process_stay_pcie_contention() -> None:
    ctx = _ctx({("cuda_h2d_bytes_per_s", "pid545"): 40e9,
                ("cuda_kernel_launches_per_s", "pid545"): 0.0})
    top = ranked(_decomp(), ctx, SCORES)[0]
    assert top.cause == C.PCIE_CONTENTION
    assert top.culprit is not None and top.culprit["pid"] == 545


def test_a_cause_that_explains_nothing_does_not_lead() -> None:
    """The H200 copy run: the copier spins in cudaStreamSynchronize, its CPU rises and the
    server's run-queue delay moves 0.06 ms; its transfers explain 3.4 ms."""
    d = _decomp()
    d.explained_ms[C.CPU_STARVATION] = 0.06
    ctx = _ctx({("cuda_h2d_bytes_per_s", "pid545"): 40e9})
    scores = {C.CPU_STARVATION: 0.95, C.PCIE_CONTENTION: 0.6}
    assert ranked(d, ctx, scores)[0].cause == C.PCIE_CONTENTION
