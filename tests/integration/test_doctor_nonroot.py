"""`sits-trace doctor` as a non-root user (issue 10): the table with what it could check, a
row saying what it could not, no traceback, and a non-zero exit (privileges are core).
Run as `nobody` through runuser, as an operator without sudo would run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bpf  # root is needed to become another user

SITS = str(Path(sys.executable).parent / "sits-trace")


@pytest.mark.skipif(shutil.which("runuser") is None, reason="runuser (util-linux) missing")
def test_doctor_as_nobody_prints_its_table() -> None:
    assert os.geteuid() == 0
    r = subprocess.run(["runuser", "-u", "nobody", "--", SITS, "doctor"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-2000:]
    assert r.returncode == 1, (r.returncode, r.stderr[-500:])
    out = r.stdout
    assert "sits-trace doctor" in out
    assert "uid 65534" in out  # privileges row: FAIL, with its fix
    assert "could not check as uid 65534" in out  # tracefs is root-only here
    assert "bcc" in out and "libssl" in out  # what a non-root user can check, checked
