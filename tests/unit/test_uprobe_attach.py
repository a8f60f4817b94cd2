"""How the agent attaches a uprobe pair (no kernel: BCC's BPF object is recorded).

A call that enters between its entry probe's and its return probe's attachment has its entry
seen and its return never: tls.c's per-thread `ssl_active` stays set, and the thread's next
socket read, of any connection, was taken for ciphertext under that SSL call and tied the
SSL* to it (CI, node: two streams' records crossed). With the return probe attached first,
every call whose entry is seen has its return seen."""

from __future__ import annotations

from sits_trace.agent.capture.loader import Kernel, LoadOptions
from sits_trace.agent.capture.probes import TLS_UPROBES, ProbeReport


class RecordingBpf:
    def __init__(self, fail_on: str = "") -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_on = fail_on

    def _attach(self, kind: str, sym: str) -> None:
        if f"{kind}:{sym}" == self.fail_on:
            raise Exception(f"could not attach {kind} {sym}")  # bcc raises bare Exception
        self.calls.append((kind, sym))

    def attach_uprobe(self, name: str, sym: str, fn_name: str) -> None:
        self._attach("entry", sym)

    def attach_uretprobe(self, name: str, sym: str, fn_name: str) -> None:
        self._attach("return", sym)


def test_each_return_probe_is_attached_before_its_entry() -> None:
    bpf = RecordingBpf()
    k = Kernel(bpf, ProbeReport(), LoadOptions())
    statuses = k.attach_uprobes("/usr/lib/libssl.so.3", TLS_UPROBES)
    assert all(s.ok for s in statuses)
    for p in TLS_UPROBES:
        entry = bpf.calls.index(("entry", p.symbol))
        if p.fn_exit:
            assert bpf.calls.index(("return", p.symbol)) < entry, p.symbol
        else:
            assert ("return", p.symbol) not in bpf.calls
    # a second call attaches nothing again
    n = len(bpf.calls)
    assert k.attach_uprobes("/usr/lib/libssl.so.3", TLS_UPROBES) == []
    assert len(bpf.calls) == n


def test_a_return_probe_that_fails_leaves_its_entry_unattached() -> None:
    """An entry with no return would leave the same state standing after every call."""
    bpf = RecordingBpf(fail_on="return:SSL_read")
    k = Kernel(bpf, ProbeReport(), LoadOptions())
    statuses = {s.name.rsplit(":", 1)[1]: s for s in k.attach_uprobes("libssl.so.3", TLS_UPROBES)}
    assert not statuses["SSL_read"].ok and "could not attach return SSL_read" in statuses["SSL_read"].detail
    assert ("entry", "SSL_read") not in bpf.calls
    assert statuses["SSL_write"].ok and ("entry", "SSL_write") in bpf.calls
