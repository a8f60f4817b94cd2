"""bpf_refusal: the one line said when the kernel refuses bpf() to a privileged process."""

from __future__ import annotations

import os

from sits_trace.agent.capture.loader import bpf_refusal


def test_refusal_lines() -> None:
    assert "seccomp" in (bpf_refusal(lambda: (-1, 1)) or "")  # EPERM
    assert "CONFIG_BPF_SYSCALL" in (bpf_refusal(lambda: (-1, 38)) or "")  # ENOSYS
    assert bpf_refusal(lambda: (-1, 22)) is None  # EINVAL: BCC's own error says more


def test_a_created_map_is_closed() -> None:
    r, w = os.pipe()
    os.close(w)
    assert bpf_refusal(lambda: (r, 0)) is None
    try:
        os.fstat(r)
        closed = False
    except OSError:
        closed = True
    assert closed
