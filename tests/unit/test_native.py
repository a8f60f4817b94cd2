"""The compiled hot path (agent/native.py): a build is used only while it matches its
sources, all of it or none, and SITS_NATIVE=0 turns it off."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sits_trace.agent import native

EXT = importlib.machinery.EXTENSION_SUFFIXES[0]


def _tree(tmp_path: Path, *, built: bool = True, record: bool = True) -> Path:
    """A tree with every module's source, a (fake) extension beside each and the build
    record naming their digests, as scripts/build_native.py leaves it."""
    root = tmp_path
    digests = {}
    for m in native.MODULES:
        src = native.source_of(m, root)
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {m}\nX = 1\n")
        digests[m] = native._digest(src)
        if built:
            src.with_suffix(EXT).write_bytes(b"")
    if record:
        (root / native.MANIFEST).write_text(json.dumps(
            {"sources": digests, "stamp": native._stamp(), "mypyc": "9.9"}))
    return root


def test_a_build_matching_its_sources_is_used(tmp_path: Path) -> None:
    st = native.check(_tree(tmp_path))
    assert st.compiled and st.stale == ()
    assert "mypyc 9.9" in st.reason


def test_one_changed_source_keeps_the_whole_build_out(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    src = native.source_of("sits_trace.agent.tracing.http1", root)
    src.write_text(src.read_text() + "Y = 2\n")
    st = native.check(root)
    assert not st.compiled
    assert st.stale == ("sits_trace.agent.tracing.http1",)


def test_a_module_the_build_lacks_is_stale(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    native.source_of("sits_trace.agent.model", root).with_suffix(EXT).unlink()
    st = native.check(root)
    assert not st.compiled and st.stale == ("sits_trace.agent.model",)


@pytest.mark.parametrize("record", ["missing", "garbage", "no sources", "other python"])
def test_extensions_without_a_true_record_are_not_used(tmp_path: Path, record: str) -> None:
    root = _tree(tmp_path, record=record != "missing")
    manifest = root / native.MANIFEST
    if record == "garbage":
        manifest.write_text("{not json")
    elif record == "no sources":
        manifest.write_text(json.dumps({"stamp": native._stamp(), "mypyc": "9.9"}))
    elif record == "other python":
        rec = json.loads(manifest.read_text())
        rec["stamp"] = {"python": "cpython-399"}
        manifest.write_text(json.dumps(rec))
    st = native.check(root)
    assert not st.compiled
    assert set(st.stale) == set(native.MODULES)


def test_a_build_of_another_module_set_is_not_used(tmp_path: Path) -> None:
    """A module since left out of the set may still have its extension on disk: it is
    named stale, so the guard imports it from source too."""
    root = _tree(tmp_path)
    manifest = root / native.MANIFEST
    rec = json.loads(manifest.read_text())
    rec["sources"]["sits_trace.analyzers.features"] = "0" * 64
    manifest.write_text(json.dumps(rec))
    st = native.check(root)
    assert not st.compiled and "another set of modules" in st.reason
    assert "sits_trace.analyzers.features" in st.stale
    del rec["sources"]["sits_trace.analyzers.features"]
    del rec["sources"]["sits_trace.agent.model"]
    manifest.write_text(json.dumps(rec))
    assert not native.check(root).compiled


def test_no_build_is_pure_python_and_not_stale(tmp_path: Path) -> None:
    st = native.check(_tree(tmp_path, built=False, record=False))
    assert not st.compiled and st.stale == () and "not built" in st.reason


def _imported_from(env: dict[str, str]) -> tuple[dict[str, str], str]:
    code = ("import importlib, json, sys\n"
            "from sits_trace.agent import native\n"
            "for m in native.MODULES: importlib.import_module(m)\n"
            "print(json.dumps({m: sys.modules[m].__file__ for m in native.MODULES}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=60, check=True)
    return json.loads(r.stdout), r.stderr


def test_sits_native_0_imports_every_module_from_its_source() -> None:
    files, err = _imported_from({"SITS_NATIVE": "0"})
    assert all(f.endswith(".py") for f in files.values()), files
    assert "out of date" not in err


def test_the_hot_path_runs_compiled_where_it_was_built() -> None:
    """In CI (SITS_REQUIRE_NATIVE=1) setup must have built it and this process must run it;
    elsewhere a missing build is a skip, and a test run under SITS_NATIVE=0 runs none."""
    st = native.status()
    if os.environ.get("SITS_NATIVE") == "0":
        assert not st.compiled and not native.in_use()
        return
    if not st.compiled:
        if os.environ.get("SITS_REQUIRE_NATIVE") == "1":
            pytest.fail(f"SITS_REQUIRE_NATIVE=1 but the hot path is not compiled: {st.reason}")
        pytest.skip(f"the hot path is not compiled here: {st.reason}")
    files, err = _imported_from({})
    assert not any(f.endswith(".py") for f in files.values()), files
    assert err == ""
    import sits_trace.agent.tracing.pipeline  # noqa: F401 - in this process too

    assert native.in_use()


def _written_inits() -> list[tuple[str, ast.ClassDef, ast.FunctionDef]]:
    out = []
    for m in native.MODULES:
        tree = ast.parse(native.source_of(m).read_text())
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or not any(
                    "dataclass" in ast.unparse(d) for d in cls.decorator_list):
                continue
            for f in cls.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    out.append((f"{m}.{cls.name}", cls, f))
    return out


def test_hot_classes_write_their_init_out() -> None:
    """The classes made per record compile their __init__ (see model.Chunk)."""
    names = {n.rsplit(".", 1)[1] for n, _, _ in _written_inits()}
    assert {"Chunk", "RequestHead", "ResponseHead", "Exchange", "Span", "DataEvent"} <= names


@pytest.mark.parametrize("name,cls,init", _written_inits(), ids=lambda x: str(x)[:40])
def test_a_written_out_init_takes_the_fields_in_order_with_their_defaults(
        name: str, cls: ast.ClassDef, init: ast.FunctionDef) -> None:
    fields = [(s.target.id, None if s.value is None else ast.unparse(s.value))
              for s in cls.body if isinstance(s, ast.AnnAssign)
              and isinstance(s.target, ast.Name) and "ClassVar" not in ast.unparse(s.annotation)]
    args = [a.arg for a in init.args.args[1:]]
    defaults = [None] * (len(args) - len(init.args.defaults)) + [
        ast.unparse(d) for d in init.args.defaults]
    assert args == [f for f, _ in fields], name
    for (f, want), got in zip(fields, defaults):
        if want is not None and want.startswith("field(default_factory="):
            assert got == "None", f"{name}.{f}: a factory's field takes None, then the factory"
        else:
            assert got == want, f"{name}.{f}: default {got} in __init__, {want} in the field"
    assigned = {t.attr for s in ast.walk(init) if isinstance(s, ast.Assign)
                for t in s.targets if isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert assigned == set(args), name


@pytest.mark.parametrize("env", [{"SITS_NATIVE": "0"}, {}])
def test_doctor_says_whether_the_hot_path_runs_compiled(env: dict[str, str]) -> None:
    code = ("import json, dataclasses\n"
            "from sits_trace.agent.doctor import _native\n"
            "print(json.dumps(dataclasses.asdict(_native())))")
    base = {k: v for k, v in os.environ.items() if k != "SITS_NATIVE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**base, **env}, timeout=60, check=True)
    row = json.loads(r.stdout)
    assert row["name"] == "compiled hot path" and not row["core"]
    if env:
        assert not row["ok"] and row["detail"] == "pure Python: SITS_NATIVE=0"
        assert row["fix"] == "unset SITS_NATIVE to run the build"
    else:
        assert row["ok"] == native.check().compiled
        assert row["ok"] or "make setup" in row["fix"]
