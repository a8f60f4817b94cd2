"""Spans as columns: each span becomes one row of plain numbers on arrival (O(1) per span);
the analysis then works on whole windows with pandas/numpy.

Columns (NaN where the span lacks the signal):
  end_ns, start_ns, dur_ms, ttfb_ms, ttft_ms (sits.time_to_first_chunk_ms), tbt_ms (mean time
  between chunks: (last chunk - first chunk) / (chunks - 1)), chunks, req_bytes, resp_bytes,
  error (0/1), runq_ms, retrans, srtt_ms, cuda_sync_ms, cuda_copy_ms, cuda_h2d_bytes,
  gpu_index, gpu_clock_reasons, gpu_sm_clock_mhz, weight (1 / sampling.probability),
  pid, client (0 SERVER / 1 CLIENT), service, route, peer (network.peer.address),
  server (server.address:server.port, the callee of a CLIENT span)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from sits_trace.agent.model import AttrValue, Span

if TYPE_CHECKING:
    import pandas as pd

NUMERIC = ("end_ns", "start_ns", "dur_ms", "ttfb_ms", "ttft_ms", "tbt_ms", "chunks", "req_bytes",
           "resp_bytes", "error", "runq_ms", "retrans", "srtt_ms", "cuda_sync_ms",
           "cuda_copy_ms", "cuda_h2d_bytes", "gpu_index", "gpu_clock_reasons",
           "gpu_sm_clock_mhz", "weight", "pid", "client")
TEXT = ("service", "route", "peer", "server")
COLUMNS = NUMERIC + TEXT
_NAN = math.nan

Row = tuple[float | str, ...]


def _num(a: Mapping[str, AttrValue], key: str, scale: float = 1.0) -> float:
    v = a.get(key)
    if v is None or isinstance(v, str):
        return _NAN
    return float(v) * scale


def _tbt_ms(a: Mapping[str, AttrValue]) -> float:
    first, last = _num(a, "sits.time_to_first_chunk_ms"), _num(a, "sits.time_to_last_chunk_ms")
    n = _num(a, "sits.stream.chunks")
    if math.isnan(n) or n < 2 or math.isnan(first) or math.isnan(last):
        return _NAN
    return (last - first) / (n - 1)


def span_row(s: Span, service: str) -> Row:
    """One span as a row of COLUMNS (service: the name its SLOs are configured under)."""
    a = s.attributes
    prob = _num(a, "sampling.probability")
    srv = a.get("server.address")
    return (
        float(s.end_time_unix_nano), float(s.start_time_unix_nano),
        (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6,
        _num(a, "sits.ttfb_ms"), _num(a, "sits.time_to_first_chunk_ms"), _tbt_ms(a),
        _num(a, "sits.stream.chunks"), _num(a, "http.request.body.size"),
        _num(a, "http.response.body.size"), 1.0 if s.status_code == "ERROR" else 0.0,
        _num(a, "sits.cpu.runq_delay_us", 1e-3), _num(a, "sits.tcp.retransmits"),
        _num(a, "sits.tcp.srtt_us", 1e-3), _num(a, "sits.cuda.sync_wait_ms"),
        _num(a, "sits.cuda.copy_call_ms"), _num(a, "sits.cuda.h2d_bytes"),
        _num(a, "sits.gpu.index"), _num(a, "sits.gpu.clocks_event_reasons"),
        _num(a, "sits.gpu.sm_clock_mhz"), 1.0 / prob if prob > 0 else 1.0,
        _num(a, "process.pid"), 1.0 if s.kind == "CLIENT" else 0.0,
        service, str(a.get("http.route") or a.get("url.path") or ""),
        str(a.get("network.peer.address", "")),
        f"{srv}:{a.get('server.port', '')}" if srv is not None else "",
    )


def service_of(s: Span, service_name: str = "") -> str:
    """The service a span belongs to: the configured name (export.service_name), else the
    process's executable name, else "pid<n>"."""
    if service_name:
        return service_name
    a = s.attributes
    return str(a.get("process.executable.name") or f"pid{a.get('process.pid', 0)}")


def to_frame(rows: Iterable[Row]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame.from_records(list(rows), columns=list(COLUMNS))
    for c in NUMERIC:
        df[c] = df[c].astype("float64")
    return df


def empty_frame() -> pd.DataFrame:
    return to_frame(())
