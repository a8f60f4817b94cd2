"""A py-spy flame graph of the agent tracing nginx at a paced load, full capture.

    .venv/bin/python bench/flame.py --out docs/flame-after.svg [--seconds 15] [--connections 20]
                                    [--paced-ms 2] [--python /path/to/other/.venv/bin/python]

nginx (`return 200`) under wrk with each of `--connections` pacing `--paced-ms` between
requests (20 x 2 ms: about 10k requests/s asked); the agent (`--python`'s checkout, default
this one) runs `trace --json --pid <nginx> --cpu-budget 0` (`--otlp`: as the service ships, `run`,
exporting every span over OTLP/HTTP, as bench/agent_cpu.py --otlp) and py-spy records it for
`--seconds` (an --out ending in .txt gets collapsed stacks instead of an SVG; `--native` for
the compiled hot path's frames). Prints the spans/s it traced and its CPU per span. Needs py-spy (PyPI) in the venv.

`--perf` (root, Linux `perf`): samples the agent with `perf record --call-graph dwarf` instead
and prints, for the compiled hot path, a table of where its CPU went: each sample is charged
to the innermost compiled function on its stack (`CPyDef_<module>___<name>`), with the
interpreter's and libc's work it called directly (allocation, dict lookups, int boxing)
included; py-spy's native mode cannot name the static inline helpers the compiled code
spends its time in. `--out` then receives the table.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_cpu  # the sibling bench: its OTLP receiver and service config
import overhead  # the sibling bench: nginx and wrk helpers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--connections", type=int, default=20)
    ap.add_argument("--paced-ms", type=int, default=2)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--perf", action="store_true",
                    help="perf with DWARF stacks: a table by compiled function (see above)")
    ap.add_argument("--otlp", action="store_true",
                    help="the agent as the service (`run`), every span over OTLP/HTTP to a "
                         "receiver here, as bench/agent_cpu.py --otlp --as-shipped")
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
        if a.otlp:
            receiver = agent_cpu.Receiver()
            cmd = [sits, "run", "--config",
                   agent_cpu._service_config(Path(d), nginx.pid, receiver.base, None,
                                             shipped=True)]
            ready = overhead.RUN_READY
        else:
            cmd = [sits, "trace", "--json", "--pid", str(nginx.pid), "--cpu-budget", "0"]
            ready = overhead.TRACE_READY
        agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        try:
            assert agent.stderr is not None
            for line in agent.stderr:
                if line.startswith(ready):
                    break
            wrk = subprocess.Popen(["wrk", "-t1", f"-c{a.connections}", f"-d{a.seconds + 4}s",
                                    "-s", str(pace), f"http://127.0.0.1:{port}/"],
                                   stdout=subprocess.PIPE, text=True)
            time.sleep(2)
            c0 = overhead.cpu_seconds(agent.pid)
            if a.perf:
                data = Path(d) / "perf.data"
                subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "700",
                                "--call-graph", "dwarf,16384", "-p", str(agent.pid), "-o",
                                str(data), "--", "sleep", str(a.seconds)],
                               check=True, capture_output=True)
            else:
                fmt = ["--format", "raw"] if a.out.endswith(".txt") else []  # collapsed stacks
                how = ["--native"] if a.native else ["--nonblocking"]
                subprocess.run([pyspy, "record", "-o", a.out, *fmt, "-d", str(a.seconds),
                                "-r", "200", "--pid", str(agent.pid), *how], check=True,
                               capture_output=True)
            cpu = overhead.cpu_seconds(agent.pid) - c0
            out, _ = wrk.communicate(timeout=60)
        finally:
            lines = overhead.stop_agent(agent)
            nginx.terminate()
            nginx.wait(timeout=10)
        if a.perf:
            script = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,sym,dso"],
                                    check=True, capture_output=True, text=True).stdout
            table = compiled_table(script)
            Path(a.out).write_text(table)
            print(table)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"\bspans=(\d+)", lines[-1] if lines else "")
    print(f"wrk {rps:.0f} req/s; agent {cpu / a.seconds:.2f} cores while profiled "
          f"({'perf' if a.perf else 'py-spy'}'s sampling included); {lines[-1] if lines else ''}")
    if m:
        print(f"spans={m.group(1)}; {'table' if a.perf else 'flame graph'}: {a.out}")
    return 0


def compiled_table(script: str, top: int = 40) -> str:
    """`perf script` stacks (innermost frame first) -> the share of samples whose innermost
    compiled function is each one ("self", what it called in the runtime included) and the
    share with it anywhere on the stack ("total")."""
    stacks: list[list[str]] = [[]]
    for line in script.splitlines():
        if not line.strip():
            if stacks[-1]:
                stacks.append([])
            continue
        m = re.match(r"\s*[0-9a-f]+ (.*?) \(", line)
        if m:
            stacks[-1].append(m.group(1).replace(" (inlined)", ""))
    stacks = [s for s in stacks if s]
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    for frames in stacks:
        compiled = [f[len("CPyDef_"):] for f in frames if f.startswith("CPyDef_")]
        own[compiled[0] if compiled else "(no compiled frame: interpreted or idle)"] += 1
        total.update(set(compiled))
    n = max(1, len(stacks))
    rows = [f"{len(stacks)} samples; self = innermost compiled function, total = anywhere on "
            "the stack", f"{'self %':>7} {'total %':>8}  function"]
    for name, k in own.most_common(top):
        rows.append(f"{100 * k / n:7.1f} {100 * total.get(name, k) / n:8.1f}  {name}")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
