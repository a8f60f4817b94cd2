"""A py-spy flame graph of the agent tracing nginx at a paced load, full capture.

    .venv/bin/python bench/flame.py --out docs/flame-after.svg [--seconds 15] [--connections 20]
                                    [--paced-ms 2] [--python /path/to/other/.venv/bin/python]

nginx (`return 200`) under wrk with each of `--connections` pacing `--paced-ms` between
requests (20 x 2 ms: about 10k requests/s asked); the agent (`--python`'s checkout, default
this one) runs `trace --json --pid <nginx> --cpu-budget 0` and py-spy records it for
`--seconds` (an --out ending in .txt gets collapsed stacks instead of an SVG; `--native` for
the compiled hot path's frames). Prints the spans/s it traced and its CPU per span. Needs py-spy (PyPI) in the venv.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # the sibling bench: nginx and wrk helpers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--connections", type=int, default=20)
    ap.add_argument("--paced-ms", type=int, default=2)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--native", action="store_true",
                    help="C frames too: the compiled hot path's functions (agent/native.py) show "
                         "only so; py-spy then stops the agent at each sample")
    a = ap.parse_args()
    pyspy = str(Path(sys.executable).parent / "py-spy")
    sits = str(Path(a.python).parent / "sits-trace")
    port = overhead.free_port()
    with tempfile.TemporaryDirectory() as d:
        pace = Path(d) / "pace.lua"
        pace.write_text(f"function delay() return {a.paced_ms} end\n")
        nginx = overhead.start_nginx(Path(d), port, 1)
        agent = subprocess.Popen([sits, "trace", "--json", "--pid", str(nginx.pid), "--cpu-budget",
                                  "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        try:
            assert agent.stderr is not None
            for line in agent.stderr:
                if "tracing" in line:
                    break
            wrk = subprocess.Popen(["wrk", "-t1", f"-c{a.connections}", f"-d{a.seconds + 4}s",
                                    "-s", str(pace), f"http://127.0.0.1:{port}/"],
                                   stdout=subprocess.PIPE, text=True)
            time.sleep(2)
            c0 = overhead.cpu_seconds(agent.pid)
            fmt = ["--format", "raw"] if a.out.endswith(".txt") else []  # collapsed stacks
            how = ["--native"] if a.native else ["--nonblocking"]
            subprocess.run([pyspy, "record", "-o", a.out, *fmt, "-d", str(a.seconds), "-r", "200",
                            "--pid", str(agent.pid), *how], check=True, capture_output=True)
            cpu = overhead.cpu_seconds(agent.pid) - c0
            out, _ = wrk.communicate(timeout=60)
        finally:
            lines = overhead.stop_agent(agent)
            nginx.terminate()
            nginx.wait(timeout=10)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"\bspans=(\d+)", lines[-1] if lines else "")
    print(f"wrk {rps:.0f} req/s; agent {cpu / a.seconds:.2f} cores while profiled "
          f"(py-spy's sampling included); {lines[-1] if lines else ''}")
    if m:
        print(f"spans={m.group(1)}; flame graph: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
