"""What an operator sees when the node cannot trace: no privileges, partial capabilities, the
kernel refusing bpf() (a seccomp filter, as in a container), BCC missing, and no GPU. Each is
one `sits-trace:` line on stderr and a non-zero exit, never a traceback; no GPU is a note and
everything else traces. (Bad config files: tests/unit/test_config*.py.)"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import SITS, curl, python_server

pytestmark = pytest.mark.bpf

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

# exec the command under a seccomp filter that makes bpf() fail with EPERM (x86_64 numbers):
# what a container runtime's default profile does
NO_BPF = r'''
import ctypes, os, struct, sys
prog = b"".join(struct.pack("HBBI", *f) for f in (
    (0x20, 0, 0, 0), (0x15, 0, 1, 321), (0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7FFF0000)))
filt = ctypes.create_string_buffer(prog, len(prog))
fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", 4, ctypes.addressof(filt)))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, fprog, 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
os.execv(sys.argv[1], sys.argv[1:])
'''


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (setpriv to another user, seccomp filters)")


def one_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1 and lines[0].startswith("sits-trace: "), p.stderr
    return lines[0]


def sits(*args: str, prefix: list[str] | None = None, env: dict[str, str] | None = None,
         timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), SITS, *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/", env=env, check=False)


@pytest.mark.parametrize("cmd", [["run"], ["trace", "--json"]])
def test_no_privileges(cmd: list[str]) -> None:
    needs_root()
    p = sits(*cmd, prefix=NOBODY)
    assert p.returncode == 2
    assert "needs root (or CAP_BPF+CAP_PERFMON)" in one_line(p)


def test_top_with_no_daemon_and_no_privileges() -> None:
    needs_root()
    p = sits("top", "--once", "--socket", "/nonexistent/api.sock", prefix=NOBODY)
    assert p.returncode != 0
    line = one_line(p)
    assert "no daemon answers" in line and "needs root" in line


def test_bpf_capabilities_without_tracefs_access() -> None:
    needs_root()
    caps = "+bpf,+perfmon"
    p = sits("run", prefix=[*NOBODY, f"--inh-caps={caps}", f"--ambient-caps={caps}"])
    assert p.returncode == 2
    assert "CAP_DAC_READ_SEARCH" in one_line(p)


def test_doctor_without_privileges_fails_with_rows_not_a_traceback() -> None:
    needs_root()
    p = sits("doctor", "--json", prefix=NOBODY)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    rows = {c["name"]: c for c in json.loads(p.stdout)}
    assert not rows["privileges"]["ok"] and "CAP_BPF" in rows["privileges"]["fix"]
    assert not rows["tracefs"]["ok"] and "CAP_DAC_READ_SEARCH" in rows["tracefs"]["fix"]


def test_kernel_refusing_bpf_is_one_line() -> None:
    needs_root()
    if platform.machine() != "x86_64":
        pytest.skip("the seccomp filter uses x86_64 system call numbers")
    p = sits("run", prefix=[sys.executable, "-c", NO_BPF])
    assert p.returncode == 2
    assert "refused bpf()" in one_line(p) and "seccomp" in p.stderr
    d = sits("doctor", "--json", prefix=[sys.executable, "-c", NO_BPF])
    assert d.returncode == 1
    bpf = next(c for c in json.loads(d.stdout) if c["name"] == "bpf")
    assert not bpf["ok"] and "seccomp" in bpf["detail"]


def test_bcc_missing_is_one_line(tmp_path: Path) -> None:
    shadow = tmp_path / "bcc"
    shadow.mkdir()
    (shadow / "__init__.py").write_text('raise ImportError("bcc hidden by the test")\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = sits("run", env=env)
    assert p.returncode == 2
    assert "bcc Python module is missing" in one_line(p)


def test_no_gpu_is_a_note_and_the_rest_traces(tmp_path: Path) -> None:
    needs_root()
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA GPU")
    out = tmp_path / "spans.jsonl"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[trace]\ncpu_budget = 0\n[export]\njsonl_path = "{out}"\n'
                   f'[api]\nsocket = "{tmp_path / "api.sock"}"\n')
    env = {**os.environ, "SITS_STATS_PATH": str(tmp_path / "stats.json")}
    with python_server() as (port, _):
        p = subprocess.Popen([SITS, "run", "-c", str(cfg)], stderr=subprocess.PIPE, text=True,
                             env=env)
        assert p.stderr is not None
        start: list[str] = []
        try:
            for line in p.stderr:  # the note comes before "agent running"
                start.append(line)
                if "agent running" in line:
                    break
            curl(f"http://127.0.0.1:{port}/no-gpu", rid="no-gpu")
        finally:
            p.terminate()
            rest = p.communicate(timeout=60)[1]
    assert p.returncode == 0, rest
    notes = [x for x in start if "GPU" in x]
    assert len(notes) == 1 and notes[0].startswith("GPU signals off: NVML unavailable"), start
    spans = [json.loads(x) for x in out.read_text().splitlines() if '"no-gpu"' in x]
    assert {s["kind"] for s in spans} == {"SERVER", "CLIENT"}
    assert all(not any(k.startswith("sits.gpu.") for k in s["attributes"]) for s in spans)
