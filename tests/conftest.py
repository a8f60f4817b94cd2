"""Shared test settings.

Tests marked `bpf` need root and a kernel that loads the programs. Where that is
missing they skip, except when SITS_REQUIRE_BPF=1 (CI): there a skipped eBPF test
is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest


def bpf_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not importable (run `make setup`)"
    if not os.path.isdir("/sys/kernel/tracing/events"):
        return "tracefs is not mounted"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = bpf_unavailable_reason()
    if reason is None:
        return
    for item in items:
        if "bpf" in item.keywords:
            if os.environ.get("SITS_REQUIRE_BPF") == "1":
                item.add_marker(pytest.mark.usefixtures("_require_bpf_failure"))
            else:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def _require_bpf_failure() -> None:
    pytest.fail(f"SITS_REQUIRE_BPF=1 but eBPF tests cannot run: {bpf_unavailable_reason()}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    """Under SITS_REQUIRE_BPF=1 a bpf test that skipped itself (pytest.skip inside) fails."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    # an expected failure (xfail: a known bug, named in its reason) is reported as skipped too
    if (rep.skipped and not hasattr(rep, "wasxfail") and "bpf" in item.keywords
            and os.environ.get("SITS_REQUIRE_BPF") == "1" and call.when in ("setup", "call")):
        rep.outcome = "failed"
        rep.longrepr = f"SITS_REQUIRE_BPF=1: eBPF test skipped: {rep.longrepr}"
