"""`sits-trace doctor`: what works, what is missing, and the one-line fix for each.

`core` checks are the ones tracing cannot run without; the command exits
non-zero when one of them fails.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from sits_trace.agent.capture.loader import bpf_privileged, bpf_refusal
from sits_trace.agent.capture.probes import (
    HTTP_TRACEPOINTS,
    TLS_UPROBES,
    elf_has_symbol,
    find_libraries,
    tracefs_root,
    tracepoint_checks,
)
from sits_trace.agent.model import AgentStats, Check

SETUP_HINT = "run `make setup` (scripts/setup.sh) as root"


def _privileges() -> Check:
    uid = os.geteuid()
    ok = bpf_privileged()  # root, or the capabilities the systemd unit gives
    detail = "root" if uid == 0 else f"uid {uid}" + (" with BPF capabilities" if ok else "")
    return Check("privileges", ok, detail,
                 "run as root (sudo sits-trace ...) or with CAP_BPF+CAP_PERFMON", core=True)


def _bcc() -> Check:
    try:
        import bcc  # noqa: PLC0415

        return Check("bcc", True, f"python bcc at {Path(bcc.__file__).parent}", core=True)
    except ImportError:
        return Check("bcc", False, "the bcc Python module is not importable",
                     f"apt-get install python3-bpfcc, or {SETUP_HINT}", core=True)


def _bpf_syscall() -> Check:
    try:
        from bcc import BPF  # noqa: PLC0415

        b = BPF(text="int f(void *ctx) { return 0; }")
        b.load_func("f", BPF.SOCKET_FILTER)
        b.cleanup()
        return Check("bpf", True, "a test program loaded", core=True)
    except ImportError:
        return Check("bpf", False, "skipped: bcc missing", SETUP_HINT, core=True)
    except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception
        refused = bpf_refusal() if bpf_privileged() and os.uname().machine == "x86_64" else None
        return Check("bpf", False, refused or str(exc).splitlines()[0][:120],
                     "needs root and a kernel with CONFIG_BPF_SYSCALL", core=True)


def _btf() -> Check:
    ok = Path("/sys/kernel/btf/vmlinux").exists()
    return Check("btf", ok, "/sys/kernel/btf/vmlinux" if ok else "no kernel BTF",
                 "optional: a kernel built with CONFIG_DEBUG_INFO_BTF")


def _tracefs() -> Check:
    try:
        root = tracefs_root()
    except PermissionError:
        return Check("tracefs", False, "/sys/kernel/tracing is not readable (mode 0700 root)",
                     "run as root, or give CAP_DAC_READ_SEARCH", core=True)
    return Check("tracefs", root is not None, str(root) if root else "not mounted",
                 "mount -t tracefs nodev /sys/kernel/tracing", core=True)


def _headers() -> Check:
    build = Path(f"/lib/modules/{platform.release()}/build")
    ok = (build / "include").exists() or (build / "Makefile").exists()
    detail = f"{build} -> {os.path.realpath(build)}" if build.exists() else f"{build} missing"
    return Check("kernel headers", ok, detail,
                 f"install linux-headers-$(uname -r) or {SETUP_HINT} (links Debian's)", core=True)


def _libssl() -> list[Check]:
    libs = find_libraries("libssl")
    if not libs:
        return [Check("libssl", False, "no libssl found on the system or in processes",
                      "apt-get install libssl3 (TLS tracing is off without it)")]
    out = []
    for lib in libs:
        syms = [u.symbol for u in TLS_UPROBES if elf_has_symbol(lib, u.symbol)]
        missing = [u.symbol for u in TLS_UPROBES if u.symbol not in syms]
        out.append(Check(f"libssl {lib}", bool(syms), "symbols: " + ", ".join(syms)
                         + (f"; missing {', '.join(missing)}" if missing else ""),
                         "" if syms else "a stripped or non-OpenSSL library: TLS not traced here"))
    return out


def _nvml() -> Check:
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        return Check("nvml", False, "nvidia-ml-py not installed", "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        drv = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
        return Check("nvml", True, f"{n} GPU(s), driver {drv}")
    except Exception as exc:  # noqa: BLE001 - pynvml.NVMLError and library load errors
        return Check("nvml", False, f"no GPU signals: {exc}",
                     "optional: install the NVIDIA driver on GPU nodes")


def _agent_stats() -> Check:
    from sits_trace.agent.config import STATS_PATH  # noqa: PLC0415

    try:
        st = AgentStats.from_json(json.loads(STATS_PATH.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return Check("agent stats", True, f"no running agent ({STATS_PATH} absent)")
    lost = st.lost_total
    detail = (f"lost in kernel {lost}, parser resyncs {st.parser_count('resyncs')}, "
              f"malformed {st.parser_count('malformed')}, spans {st.count('spans')}")
    return Check("agent stats", lost == 0, detail,
                 "events lost: raise trace.ringbuf_mib or lower trace.poll_ms")


def _native() -> Check:
    from sits_trace.agent import native  # noqa: PLC0415

    st = native.status()
    detail = st.reason if st.compiled else f"pure Python: {st.reason}"
    fix = (f"unset {native.ENV} to run the build" if st.reason.startswith(native.ENV) else
           f"{SETUP_HINT}: it compiles the hot path (needs gcc and python3-dev), "
           "less than half the agent's CPU per span")
    return Check("compiled hot path", st.compiled, detail, fix)


EXTRA_CHECKS: list[Callable[[], list[Check]]] = []  # other stages add theirs (CUDA, TCP...)


def _cuda_checks() -> list[Check]:
    from sits_trace.agent.signals.cuda import doctor_checks  # noqa: PLC0415

    return doctor_checks()


def _node_checks() -> list[Check]:
    from sits_trace.agent.signals.node import doctor_checks  # noqa: PLC0415

    return doctor_checks()


EXTRA_CHECKS.append(_cuda_checks)  # libcuda symbols the CUDA probes need (never core)
EXTRA_CHECKS.append(_node_checks)  # tcp: and sched: tracepoints of the node signals (optional)


def _guarded(name: str, check: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one check; one it cannot make (a non-root user may not read tracefs or other
    processes' maps) becomes a row that says so, never a traceback."""
    try:
        got = check()
    except OSError as exc:
        return [Check(name, False, f"could not check as uid {os.geteuid()}: "
                      f"{exc.strerror or exc}", "run `sits-trace doctor` as root to check this")]
    return got if isinstance(got, list) else [got]


def run_checks() -> list[Check]:
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("privileges", _privileges), ("bcc", _bcc), ("bpf", _bpf_syscall), ("btf", _btf),
        ("tracefs", _tracefs), ("kernel headers", _headers),
        ("tracepoints", lambda: tracepoint_checks(HTTP_TRACEPOINTS, tracefs_root())),
        ("libssl", _libssl),
    ]
    steps += [(getattr(extra, "__name__", "extra").strip("_").replace("_checks", ""), extra)
              for extra in EXTRA_CHECKS]
    steps += [("nvml", _nvml), ("compiled hot path", _native), ("agent stats", _agent_stats)]
    checks: list[Check] = []
    for name, check in steps:
        checks += _guarded(name, check)
    return checks


def render(checks: list[Check]) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title="sits-trace doctor")
    for col in ("check", "", "detail", "fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        mark = "[green]ok[/]" if c.ok else ("[red]FAIL[/]" if c.core else "[yellow]missing[/]")
        t.add_row(c.name, mark, c.detail, "" if c.ok else c.fix)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(t)
