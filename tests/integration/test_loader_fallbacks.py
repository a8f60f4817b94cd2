"""The fallbacks of the kernel side, forced here so they cannot rot: per-thread state in a
hash (kernels without task storage for tracing programs), BCC's callback ring reader
(where the mmap reader is not supported) and reads and writes traced at enter and exit
(where their arguments cannot be read at the exit: not x86-64, or a kernel before 5.15).
The same HTTP and HTTPS requests must come out."""

from __future__ import annotations

import platform
import time

import pytest
from sits_trace.agent.capture.loader import LoadOptions, RingSource, load
from sits_trace.agent.model import Span
from sits_trace.agent.tracing.pipeline import Tracer
from sits_trace.agent.tracing.spans import SpanBuilder

from .harness import curl, python_server

pytestmark = pytest.mark.bpf


def _attached(kernel: object) -> set[str]:
    return {t.decode() if isinstance(t, bytes) else str(t)
            for t in kernel.bpf.tracepoint_fds}  # type: ignore[attr-defined]


def test_reads_and_writes_are_traced_at_their_exit_only() -> None:
    """The default on x86-64: no enter tracepoint for the data syscalls (each costs every
    process on the node a dispatch a call), an exit tracepoint each."""
    if platform.machine() != "x86_64":
        pytest.skip("the exit-only build is for x86-64")
    with python_server(tls=False) as (_port, proc):
        kernel = load(LoadOptions(target_pids=[proc.pid]))
        tps = _attached(kernel)
        kernel.bpf.cleanup()
    assert kernel.defines["SITS_EXIT_ARGS"] == 1
    for name in ("read", "write", "recvfrom", "sendto", "readv", "writev", "recvmsg", "sendmsg"):
        assert f"syscalls:sys_exit_{name}" in tps
        assert f"syscalls:sys_enter_{name}" not in tps
    assert "syscalls:sys_enter_close" in tps  # connections' own programs are unchanged


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize("exit_args", [1, 0], ids=["exit-only", "enter-and-exit"])
def test_hash_thread_state_and_bcc_reader(tls: bool, exit_args: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SITS_RING_READER", "bcc")
    with python_server(tls=tls) as (port, proc):
        kernel = load(LoadOptions(target_pids=[proc.pid], extra_defines={
            "SITS_TASK_STORAGE": 0, "SITS_EXIT_ARGS": exit_args}))
        assert ("syscalls:sys_enter_read" in _attached(kernel)) == (not exit_args)
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
