"""Compile the agent's hot path (sits_trace.agent.native.MODULES) with mypyc.

    .venv/bin/python scripts/build_native.py [--force] [--log FILE]

Run by scripts/setup.sh. Does nothing when the build on disk matches the sources. Needs a C
compiler, Python's headers (python3-dev) and mypy (the test extras); without them, or if
the compiler fails, it says so in one line, removes any old build and exits 0: the agent
then runs the same modules as Python, slower (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

os.environ["SITS_NATIVE"] = "0"  # this process imports the sources, never an old build
REPO = Path(__file__).resolve().parents[1]

from sits_trace.agent import native  # noqa: E402


def remove_build() -> None:
    """The extensions of the modules listed now and of those the last build compiled."""
    manifest = native.BASE / native.MANIFEST
    try:
        before = set(json.loads(manifest.read_text())["sources"])
    except (OSError, ValueError, KeyError, TypeError):
        before = set()
    manifest.unlink(missing_ok=True)
    for m in set(native.MODULES) | before:
        for p in native._ext_paths(m):
            p.unlink()
    group = native.source_of(native.GROUP)
    for p in group.parent.glob(group.stem + "__mypyc.*"):
        p.unlink()


@contextlib.contextmanager
def _fds_to(f: IO[str]) -> Iterator[None]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        yield
    finally:
        f.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def build(log: Path) -> str | None:
    """Compiles into a scratch folder, then moves the extensions next to the sources.
    Returns None, or why it could not."""
    try:
        from mypyc.build import mypycify  # noqa: PLC0415 - only the build needs mypyc
        from setuptools import Distribution  # noqa: PLC0415
    except ImportError as e:
        return f"mypyc is not installed ({e.name}); pip install -e '.[test]' brings it"
    import mypy.version  # noqa: PLC0415

    digests = {m: native._digest(native.source_of(m)) for m in native.MODULES}
    with tempfile.TemporaryDirectory(prefix="sits-native-") as tmp:
        work = Path(tmp)
        # module names come from the paths: sits_trace/agent/..., sits_trace/exporters/...
        # (the namespace over the top-level folders, pyproject.toml)
        (work / "sits_trace").mkdir()
        for top in sorted({m.split(".")[1] for m in native.MODULES}):
            (work / "sits_trace" / top).symlink_to(native.BASE / top)
        paths = ["sits_trace/" + str(native.source_of(m).relative_to(native.BASE))
                 for m in native.MODULES]
        cwd = Path.cwd()
        # the compiler writes to file descriptors 1 and 2, not sys.stdout: all of it to the log
        with log.open("w") as out, _fds_to(out), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(out):
            try:
                os.chdir(work)
                exts = mypycify(["--ignore-missing-imports", "--explicit-package-bases",
                                 "--cache-dir", str(work / "cache"), *paths],
                                group_name=native.GROUP, target_dir=str(work / "c"))
                dist = Distribution({"name": "sits-trace-hotpath", "ext_modules": exts})
                cmd = dist.get_command_obj("build_ext")
                cmd.build_lib = str(work / "lib")
                cmd.build_temp = str(work / "tmp")
                dist.run_command("build_ext")
            except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure: stay pure
                print(f"build failed: {e!r}")
                return f"the compiler failed (see {log})"
            finally:
                os.chdir(cwd)
        built = list((work / "lib").rglob("*.so"))
        remove_build()
        for so in built:
            shutil.copy2(so, native.BASE / so.relative_to(work / "lib" / "sits_trace"))
    # written last: a build cut short leaves no record and is not used
    (native.BASE / native.MANIFEST).write_text(json.dumps({
        "sources": digests, "stamp": native._stamp(), "mypyc": mypy.version.__version__,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--log", type=Path, default=REPO / "build" / "native.log")
    a = ap.parse_args()
    st = native.check()
    if st.compiled and not a.force:
        print(f"setup: compiled hot path up to date ({st.reason})")
        return 0
    a.log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    why = build(a.log)
    if why is not None:
        remove_build()
        print(f"setup: the agent's hot path stays Python: {why}")
        return 0
    st = native.check()
    print(f"setup: compiled the hot path in {time.monotonic() - t0:.0f} s ({st.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
