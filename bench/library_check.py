"""What one library rescan costs per traced process, as the daemon makes it.

    .venv/bin/python bench/library_check.py [--servers 30] [--repeat 5]
    <other checkout>/.venv/bin/python bench/library_check.py   # to compare, one after the other

Every `trace.library_rescan_s` the agent looks at each traced process again for a libssl or
libcuda it may have loaded late (agent/daemon.py `_check_libraries`): the TLS libraries it
maps, whether its program carries OpenSSL itself, and its libcuda. This starts `--servers`
nginx (bench/scale.py's config: a master and a worker each) and times those questions over
all their processes, min of `--repeat`, in ms per process. A checkout from before
`read_maps` (agent/capture/probes.py) is timed the way its daemon asked them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # the sibling bench: nginx config and process tree
import sits_trace.agent.capture.probes as probes
from overhead import free_port


def check(pid: int) -> None:
    if hasattr(probes, "read_maps"):
        maps = probes.read_maps(pid)
        for short, _ in probes.TLS_LIBRARIES:
            probes.libraries_in(maps, pid, short)
        probes.ssl_executable(pid, "/proc", maps)
    else:  # before session 34: a read of the maps per question
        for short, _ in probes.TLS_LIBRARIES:
            probes.mapped_libraries(pid, short)
        probes.ssl_executable(pid)
    probes.mapped_libraries(pid, "libcuda")  # the GPU signals' own look


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sits-libcheck-") as tmp:
        os.chmod(tmp, 0o755)
        ports = [free_port() for _ in range(a.servers)]
        ngx = [scale.start_nginx(Path(tmp) / f"n{i}", p) for i, p in enumerate(ports)]
        try:
            for p in ports:
                scale.wait_port(p)
            pids = [q for n in ngx for q in scale.tree(n.pid)]
            best = float("inf")
            for _ in range(a.repeat):
                t = time.perf_counter()
                for pid in pids:
                    check(pid)
                best = min(best, time.perf_counter() - t)
        finally:
            for n in ngx:
                n.terminate()
            for n in ngx:
                n.wait(10)
    print(f"{probes.__file__}: {len(pids)} nginx processes, "
          f"{best / len(pids) * 1e3:.3f} ms per process (min of {a.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
