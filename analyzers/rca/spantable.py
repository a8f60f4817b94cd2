"""Spans as columns: each span becomes one row of plain numbers on arrival (O(1) per span);
the analysis then works on whole windows with pandas/numpy.

Columns (NaN where the span lacks the signal):
  end_ns, start_ns, dur_ms, ttfb_ms, ttft_ms (sits.gen_ai.time_to_first_token_ms on model
  routes, else sits.time_to_first_chunk_ms), tbt_ms (mean time
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


_NUMBER = (int, float, bool)


def _f(v: AttrValue | None) -> float:
    return float(v) if v.__class__ in _NUMBER else _NAN


def _num(a: Mapping[str, AttrValue], key: str, scale: float = 1.0) -> float:
    return _f(a.get(key)) * scale


def _tbt_ms(first: float, last: float, n: float) -> float:
    if math.isnan(n) or n < 2 or math.isnan(first) or math.isnan(last):
        return _NAN
    return (last - first) / (n - 1)


def span_row(s: Span, service: str) -> Row:
    """One span as a row of COLUMNS (service: the name its SLOs are configured under).
    Called for every span: plain lookups, no loops."""
    g = s.attributes.get
    prob = _f(g("sampling.probability"))
    srv = g("server.address")
    first, n = _f(g("sits.time_to_first_chunk_ms")), _f(g("sits.stream.chunks"))
    token = g("sits.gen_ai.time_to_first_token_ms")  # a chat stream's role event skipped
    ttft = first if token is None else _f(token)
    end, start = s.end_time_unix_nano, s.start_time_unix_nano
    return (
        float(end), float(start), (end - start) / 1e6, _f(g("sits.ttfb_ms")), ttft,
        _tbt_ms(first, _f(g("sits.time_to_last_chunk_ms")), n), n,
        _f(g("http.request.body.size")), _f(g("http.response.body.size")),
        1.0 if s.status_code == "ERROR" else 0.0, _f(g("sits.cpu.runq_delay_us")) * 1e-3,
        _f(g("sits.tcp.retransmits")), _f(g("sits.tcp.srtt_us")) * 1e-3,
        _f(g("sits.cuda.sync_wait_ms")), _f(g("sits.cuda.copy_call_ms")),
        _f(g("sits.cuda.h2d_bytes")), _f(g("sits.gpu.index")),
        _f(g("sits.gpu.clocks_event_reasons")), _f(g("sits.gpu.sm_clock_mhz")),
        1.0 / prob if prob > 0 else 1.0, _f(g("process.pid")),
        1.0 if s.kind == "CLIENT" else 0.0, service,
        str(g("http.route") or g("url.path") or ""), str(g("network.peer.address", "")),
        f"{srv}:{g('server.port', '')}" if srv is not None else "",
    )


def service_of(s: Span, service_name: str = "") -> str:
    """The service a span belongs to: the configured name (export.service_name), else the
    process's executable name, else "pid<n>"."""
    if service_name:
        return service_name
    a = s.attributes
    return str(a.get("process.executable.name") or f"pid{a.get('process.pid', 0)}")


def to_frame(rows: Iterable[Row]) -> pd.DataFrame:
    import pandas as pd  # noqa: PLC0415 - pandas when a window is judged, not per span

    df = pd.DataFrame.from_records(list(rows), columns=list(COLUMNS))
    for c in NUMERIC:
        df[c] = df[c].astype("float64")
    return df


def empty_frame() -> pd.DataFrame:
    return to_frame(())
