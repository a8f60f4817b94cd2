"""The import rule of docs/architecture.md, checked on the source (ast, no import executed).

Stages, in pipeline order:
  0 plain data and settings   agent/model.py, agent/clock.py, agent/config.py, agent/sinks.py
  1 capture                   agent/capture/
  2 tracing                   agent/tracing/
  3 signals                   agent/signals/
  4 analyzers                 analyzers/
  5 exporters                 exporters/
  6 composition root          agent/cli.py, agent/daemon.py, agent/doctor.py
A module imports only its own stage or earlier ones (every import counts: module level,
inside functions, under TYPE_CHECKING); analyzers/ and exporters/ are imported only from
inside themselves and by the root; and module-level imports form no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "analyzers", "exporters")
STAGE_OF_PREFIX = (  # most specific first
    ("sits_trace.agent.model", 0), ("sits_trace.agent.clock", 0), ("sits_trace.agent.config", 0),
    ("sits_trace.agent.native", 0), ("sits_trace.agent.sinks", 0),
    ("sits_trace.agent.capture", 1), ("sits_trace.agent.tracing", 2),
    ("sits_trace.agent.signals", 3), ("sits_trace.analyzers", 4), ("sits_trace.exporters", 5),
    ("sits_trace.agent.cli", 6), ("sits_trace.agent.daemon", 6), ("sits_trace.agent.doctor", 6),
    ("sits_trace.agent", 6),  # the package itself (its __init__)
)
ROOT_STAGE = 6
IMPORTED_BY_ROOT_ONLY = ("sits_trace.analyzers", "sits_trace.exporters")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["sits_trace", *parts])


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def stage(mod: str) -> int:
    for prefix, s in STAGE_OF_PREFIX:
        if mod == prefix or mod.startswith(prefix + "."):
            return s
    raise AssertionError(f"{mod}: in no stage (add it to STAGE_OF_PREFIX and docs/architecture.md)")


def _in_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, with whether it runs when the module is imported (module level,
    not under TYPE_CHECKING)."""

    def walk(nodes: list[ast.stmt], top: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                yield n, top
            elif isinstance(n, ast.If) and _in_type_checking(n):
                yield from walk(n.body, False)
                yield from walk(n.orelse, top)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from walk(n.body, False if not isinstance(n, ast.ClassDef) else top)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(n, field, None)
                    if isinstance(sub, list):
                        yield from walk([s for s in sub if isinstance(s, ast.stmt)]
                                        + [s for h in sub if isinstance(h, ast.ExceptHandler)
                                           for s in h.body], top)

    yield from walk(tree.body, True)


def edges(known: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """(importer, imported, at module level) for every import between project modules."""
    out: list[tuple[str, str, bool]] = []
    for mod, path in known.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node, top in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".")
                    base = base if is_pkg else base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                for a in node.names:  # `from pkg import submodule` names the submodule
                    sub = f"{stem}.{a.name}"
                    targets.append(sub if sub in known else stem)
            for t in targets:
                while t and t not in known:  # `import sits_trace.agent.x.y` -> deepest known
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    out.append((mod, t, top))
    return out


def violations(known: dict[str, Path]) -> list[str]:
    bad: list[str] = []
    for a, b, _ in edges(known):
        sa, sb = stage(a), stage(b)
        if sb > sa:
            bad.append(f"{a} (stage {sa}) imports {b} (stage {sb}): a later stage")
        elif (b.startswith(IMPORTED_BY_ROOT_ONLY) and sa != ROOT_STAGE
              and not any(a.startswith(p) and b.startswith(p) for p in IMPORTED_BY_ROOT_ONLY)):
            bad.append(f"{a} imports {b}: only the composition root imports analyzers/exporters")
    return bad


def cycles(known: dict[str, Path]) -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in known}
    for a, b, top in edges(known):
        if top:
            graph[a].add(b)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append([*stack[stack.index(n):], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_every_module_has_a_stage_and_the_scan_sees_imports() -> None:
    known = modules()
    assert "sits_trace.agent.capture.wire" in known and "sits_trace.agent.signals.cuda" in known
    for m in known:
        stage(m)
    found = edges(known)
    # the scan must see each kind of import it judges, or an empty list would prove nothing
    assert ("sits_trace.agent.capture.events", "sits_trace.agent.capture.wire", True) in found
    assert ("sits_trace.agent.cli", "sits_trace.exporters", False) in found  # in a function
    assert ("sits_trace.agent.signals.gpu", "sits_trace.agent.tracing.pipeline", False) in found
    assert ("sits_trace.agent.signals.cuda.windows", "sits_trace.agent.signals.cuda.addrmap",
            True) in found  # relative


def test_no_module_imports_a_later_stage() -> None:
    assert violations(modules()) == []


def test_no_import_cycle() -> None:
    assert cycles(modules()) == []


def _tree(tmp: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in PACKAGES:
        (tmp / pkg).mkdir(exist_ok=True)
    return modules(tmp)


@pytest.mark.parametrize(("files", "complaint"), [
    ({"agent/capture/loader.py": "def f():\n    from sits_trace.agent.signals import tcp\n",
      "agent/signals/tcp.py": ""}, "a later stage"),
    ({"agent/tracing/spans.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
      "    from sits_trace.agent.daemon import Agent\n", "agent/daemon.py": ""}, "a later stage"),
    ({"agent/signals/node.py": "from sits_trace.exporters.node_metrics import x\n",
      "exporters/node_metrics.py": ""}, "a later stage"),
    ({"exporters/otlp.py": "from sits_trace.analyzers import features\n",
      "analyzers/features.py": ""}, "only the composition root"),
])
def test_a_back_import_is_caught(tmp_path: Path, files: dict[str, str], complaint: str) -> None:
    found = violations(_tree(tmp_path, files))
    assert len(found) == 1 and complaint in found[0], found


def test_a_cycle_is_caught(tmp_path: Path) -> None:
    known = _tree(tmp_path, {"agent/capture/a.py": "from . import b\n",
                             "agent/capture/b.py": "from sits_trace.agent.capture import a\n"})
    assert cycles(known) == [["sits_trace.agent.capture.a", "sits_trace.agent.capture.b",
                              "sits_trace.agent.capture.a"]]
