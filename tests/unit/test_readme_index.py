"""README indexes the project: every page of docs/ is linked, and its module table names every
module of agent/, analyzers/, exporters/ and bpf/ (so a new module cannot go unmentioned)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_docs_page_is_linked() -> None:
    links = set(re.findall(r"\]\((docs/[^)#]+)\)", README))
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert pages - links == set()
    assert {link for link in links if not (ROOT / link).exists()} == set()


def test_every_module_is_named() -> None:
    table = "\n".join(x for x in README.splitlines() if x.startswith("| "))
    unnamed = []
    for pkg in ("agent", "analyzers", "exporters", "bpf"):
        for f in sorted((ROOT / pkg).rglob("*")):
            if f.suffix not in (".py", ".c", ".h") or f.name == "__init__.py":
                continue
            # `name.py`, `name.c`, or a subpackage's `name` in its parenthesised list
            if f"`{f.name}`" not in table and f"`{f.stem}`" not in table:
                unnamed.append(str(f.relative_to(ROOT)))
    assert unnamed == []
