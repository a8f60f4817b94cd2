"""Where the kernel programs' time goes: `perf record -a -g` over bench/prog_cost.py's hot
loop (a traced loopback connection, the programs loaded as `run` loads them), each sample
under a BPF program's frame counted against the helper it was in ("(self)": the program's
own instructions, inlined array lookups included).

Usage: bench/prog_perf.py [--count 100000] [--freq 10000] [--min-samples 100] [--untraced]
(--untraced: prog_cost.py's --untraced, the programs where they should return at once)
Prints, per program with enough samples, the share of its samples in each helper.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_OFFSET = re.compile(r"\+0x[0-9a-f]+$")


def by_helper(script: str) -> dict[str, collections.Counter[str]]:
    """perf script's stacks -> program name -> helper -> samples."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    stack: list[str] = []

    def flush() -> None:
        for i, sym in enumerate(stack):
            if sym.startswith("bpf_prog_"):
                name = sym.split("_", 3)[-1]  # bpf_prog_<tag>_<name>
                out[name][stack[i - 1] if i else "(self)"] += 1
                return

    for line in script.splitlines():
        if not line.strip() or line[0] not in " \t":
            flush()
            stack = []
            continue
        parts = line.split()
        if len(parts) >= 2:
            stack.append(_OFFSET.sub("", parts[1]))
    flush()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--freq", type=int, default=10000)
    ap.add_argument("--min-samples", type=int, default=100)
    ap.add_argument("--untraced", action="store_true",
                    help="the child's exchanges untraced (bench/prog_cost.py --untraced)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        data = str(Path(d) / "perf.data")
        subprocess.run(["perf", "record", "-a", "-g", "-F", str(args.freq), "-o", data, "--",
                        sys.executable, str(HERE / "prog_cost.py"), "--one", "--count",
                        str(args.count), *(["--untraced"] if args.untraced else [])],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        script = subprocess.run(["perf", "script", "-i", data], capture_output=True,
                                text=True, errors="replace", check=True).stdout
    progs = by_helper(script)
    for name, helpers in sorted(progs.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(helpers.values())
        if n < args.min_samples or not name.startswith(("tracepoint", "raw", "sits")):
            continue
        shares = ", ".join(f"{h} {100 * c / n:.0f}%" for h, c in helpers.most_common(12))
        print(f"{name} ({n} samples): {shares}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
