"""The agent's per-record hot path, compiled to C with mypyc, and the guard that keeps a
stale build from running.

The modules in MODULES are ordinary typed Python (mypy --strict passes on them); `make
setup` compiles them with mypyc (scripts/build_native.py), which turns their classes into
C structs and their functions into C functions. The extension modules sit next to the
sources, where Python's import system prefers them to the `.py` files. Nothing else in the
project knows whether it runs compiled: the compiled and the interpreted modules behave
the same and the unit tests run on both (`make test`).

A compiled module that no longer matches its source would run old code with no sign of it,
so `sits_trace.agent` calls `guard()` before any of them is imported (sits_trace.exporters
imports sits_trace.agent before its own modules): the build wrote the
SHA-256 of every source it compiled to `native.json`; if one differs, or there is no such
record, or `SITS_NATIVE=0` is set, every module of the set is imported from its source for
this process (all or none: the compiled modules use each other's C structs directly), and
a stale build says so in one line on stderr.

What compiling changes, and the modules are written for: a class of the set cannot be
subclassed by interpreted code, or given attributes its body does not declare; a value of
the wrong type assigned to a typed attribute raises TypeError instead of passing through; a
module-level name rebound from outside (a test's monkeypatch) is not seen by compiled code,
so a test that needs that runs under SITS_NATIVE=0 (`make test` runs the unit tests both
ways). py-spy sees the compiled functions only with `--native`.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# the folder that holds agent/ and exporters/ (the sits_trace namespace: pyproject.toml)
BASE = Path(__file__).resolve().parents[1]
MODULES = (
    "sits_trace.agent.model",
    "sits_trace.agent.capture.ringbuf",
    "sits_trace.agent.capture.events",
    "sits_trace.agent.tracing.redact",
    "sits_trace.agent.tracing.genai",
    "sits_trace.agent.tracing.http1",
    "sits_trace.agent.tracing.pipeline",
    "sits_trace.agent.tracing.spans",
    "sits_trace.agent.signals.tcp",
    "sits_trace.agent.signals.sched",
    "sits_trace.exporters._otlp_traces",
    "sits_trace.analyzers.live",
    "sits_trace.exporters._red",
    "sits_trace.analyzers.control.latency",
)
# the C library every compiled module's code lives in (mypyc's "group")
GROUP = "sits_trace.agent.hotpath"
MANIFEST = Path("agent") / "native.json"  # under BASE
ENV = "SITS_NATIVE"  # 0: import the sources even where a fresh build exists


def source_of(module: str, base: Path = BASE) -> Path:
    return base.joinpath(*module.split(".")[1:]).with_suffix(".py")


def _ext_paths(module: str, base: Path = BASE) -> list[Path]:
    src = source_of(module, base)
    return [src.with_suffix(s) for s in importlib.machinery.EXTENSION_SUFFIXES
            if src.with_suffix(s).exists()]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stamp() -> dict[str, str]:
    """What else a build depends on: the interpreter it was built for."""
    return {"python": sys.implementation.cache_tag or sys.version}


@dataclass(frozen=True)
class Status:
    compiled: bool  # the modules run from the build
    reason: str  # why not, or what the build is
    stale: tuple[str, ...] = ()  # sources changed since the build


def check(base: Path = BASE) -> Status:
    """Whether a fresh build of MODULES exists under `base` (does not look at SITS_NATIVE)."""
    built = [m for m in MODULES if _ext_paths(m, base)]
    if not built:
        return Status(False, "not built (`make setup` compiles it; pure Python meanwhile)")
    manifest = base / MANIFEST
    try:
        record = json.loads(manifest.read_text())
        sources, stamp, mypyc = dict(record["sources"]), record["stamp"], record["mypyc"]
    except (OSError, ValueError, KeyError, TypeError):
        return Status(False, f"no readable build record ({manifest.name})", tuple(built))
    if stamp != _stamp():
        return Status(False, f"built for another interpreter ({stamp})", tuple(built))
    if set(sources) != set(MODULES):  # a module added to the set, or one left out of it since
        return Status(False, "built for another set of modules",
                      tuple(sorted(set(built) | (set(sources) - set(MODULES)))))

    def fresh(m: str) -> bool:
        try:
            return bool(_ext_paths(m, base)) and sources.get(m) == _digest(source_of(m, base))
        except OSError:
            return False

    stale = tuple(m for m in MODULES if not fresh(m))
    if stale:
        return Status(False, "sources changed since the build", stale)
    return Status(True, f"compiled by mypyc {mypyc}, {len(MODULES)} modules")


class _FromSource(importlib.abc.MetaPathFinder):
    """Imports each module of `names` from its .py file."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        return importlib.util.spec_from_file_location(fullname, source_of(fullname))


_status: Status | None = None


def guard() -> Status:
    """Called once by sits_trace.agent: keeps a stale or unwanted build out of this process."""
    global _status
    if _status is not None:
        return _status
    st = check()
    if os.environ.get(ENV, "") == "0":
        st = Status(False, f"{ENV}=0", st.stale)
    elif not st.compiled and st.stale:
        which = ", ".join(str(source_of(m).relative_to(BASE)) for m in st.stale[:3])
        print(f"sits-trace: the compiled hot path is out of date ({st.reason}: {which}); "
              "running it as Python until `make setup` rebuilds it", file=sys.stderr)
    names = set(MODULES) | set(st.stale)  # a module the set no longer lists may be built too
    if not st.compiled and any(_ext_paths(m) for m in names):
        sys.meta_path.insert(0, _FromSource(names))
    _status = st
    return st


def status() -> Status:
    return _status if _status is not None else guard()


def in_use() -> bool:
    """Whether the modules of the set this process has imported are the compiled ones."""
    mods = [sys.modules[m] for m in MODULES if m in sys.modules]
    return bool(mods) and not any(str(getattr(m, "__file__", "")).endswith(".py")
                                  for m in mods)
