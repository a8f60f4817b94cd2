"""Assemble the BPF C text that BCC compiles.

BCC rewrites map calls (``conns.lookup(...)``) and generates tracepoint argument
structs only in the main text it is given, not in files reached through
``#include``. So the project's own headers and programs are inlined here, in
order, each once; system headers stay as includes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path

_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


def bpf_dir() -> Path:
    """The folder holding the installed .c and .h files."""
    return Path(str(resources.files("sits_trace.bpf")))


def _inline(name: str, root: Path, done: set[str]) -> str:
    if name in done:
        return ""
    done.add(name)
    text = (root / name).read_text()

    def repl(m: re.Match[str]) -> str:
        return _inline(m.group(1), root, done)

    return f"/* ---- {name} ---- */\n" + _LOCAL_INCLUDE.sub(repl, text)


def program_text(files: Iterable[str], root: Path | None = None) -> str:
    """One C text from the named program files, local headers inlined once."""
    base = root or bpf_dir()
    done: set[str] = set()
    return "\n".join(_inline(f, base, done) for f in files)


def cflags(defines: Mapping[str, int | str]) -> list[str]:
    """``-DNAME=value`` flags: options reach the C code this way, never by editing text."""
    return [f"-D{k}={v}" for k, v in sorted(defines.items())] + ["-Wno-macro-redefined"]
