"""The fallbacks of the kernel side, forced here so they cannot rot: per-thread state in a
hash (kernels without task storage for tracing programs) and BCC's callback ring reader
(where the mmap reader is not supported). The same HTTP and HTTPS requests must come out."""

from __future__ import annotations

import time

import pytest
from sits_trace.agent.capture.loader import LoadOptions, RingSource, load
from sits_trace.agent.model import Span
from sits_trace.agent.tracing.pipeline import Tracer
from sits_trace.agent.tracing.spans import SpanBuilder

from .harness import curl, python_server

pytestmark = pytest.mark.bpf


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_hash_thread_state_and_bcc_reader(tls: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SITS_RING_READER", "bcc")
    with python_server(tls=tls) as (port, proc):
        kernel = load(LoadOptions(target_pids=[proc.pid], extra_defines={"SITS_TASK_STORAGE": 0}))
        src = RingSource(kernel)
        assert src.reader == "bcc"
        spans: list[Span] = []
        tracer = Tracer(src, spans.append, SpanBuilder(clock_offset_ns=0))
        scheme = "https" if tls else "http"
        for i in range(3):
            assert curl(f"{scheme}://127.0.0.1:{port}/fallback/{i}", rid=f"fb-{i}").returncode == 0
        deadline = time.monotonic() + 10
        while len(spans) < 3 and time.monotonic() < deadline:
            tracer.poll(50)
        src.close()
    got = sorted((s.attributes["url.path"], s.attributes["http.request.header.x-request-id"],
                  s.attributes["tls"]) for s in spans if s.kind == "SERVER")
    assert got == [(f"/fallback/{i}", f"fb-{i}", tls) for i in range(3)]
