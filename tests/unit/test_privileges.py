"""Who may load the probes: root, or CAP_BPF+CAP_PERFMON (the systemd unit), or CAP_SYS_ADMIN."""

from __future__ import annotations

from sits_trace.agent.capture.loader import bpf_privileged


def status(caps: int) -> str:
    return f"Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t{caps:016x}\nCapBnd:\t000001ffffffffff\n"


def test_capabilities_decide_without_root() -> None:
    assert bpf_privileged(status((1 << 39) | (1 << 38)))  # CAP_BPF + CAP_PERFMON
    assert bpf_privileged(status(1 << 21))  # CAP_SYS_ADMIN
    assert not bpf_privileged(status(1 << 39))  # CAP_BPF alone
    assert not bpf_privileged(status(1 << 38))
    assert not bpf_privileged(status(0))
    assert not bpf_privileged("Name:\tx\n")
