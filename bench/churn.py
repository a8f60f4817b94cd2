"""Fresh-connection churn: traced/sent at N new connections/s with thousands of TIME_WAIT
sockets on the host (issue 10). Needs root, nginx and hey.

    .venv/bin/python bench/churn.py --rates 100 300 --seconds 10 --time-wait 6000 [--all]

Prints one line per rate: requests sent, server spans traced, the agent's stats line.
Default agent settings (the default CPU budget), `-p` nginx's pids.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SITS = str(Path(sys.executable).parent / "sits-trace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nginx(root: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    conf = root / "nginx.conf"
    conf.write_text(f"""user root; worker_processes 1; daemon off; pid {root}/nginx.pid;
error_log {root}/error.log warn; events {{ worker_connections 4096; }}
http {{ access_log off; client_body_temp_path {root}/b; proxy_temp_path {root}/p;
fastcgi_temp_path {root}/f; uwsgi_temp_path {root}/u; scgi_temp_path {root}/s;
server {{ listen 127.0.0.1:{port} backlog=4096; location = / {{ return 200 "ok\\n"; }} }} }}
""")
    p = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(root)])
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nginx did not start")


def _time_wait(port: int, n: int) -> int:
    """Client-closed connections: each leaves a TIME_WAIT socket on the host for 60 s."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    out = subprocess.run(["ss", "-tan", "state", "time-wait"], check=False, capture_output=True, text=True)
    return max(0, len(out.stdout.splitlines()) - 1)


def _measure(port: int, pids: list[int], rate: int, seconds: int) -> str:
    """`pids` empty: every process (hey's client side too, the case issue 10 measured)."""
    out = Path(tempfile.mkstemp(suffix=".jsonl")[1])
    args = [SITS, "trace", "--json"] + [a for p in pids for a in ("-p", str(p))]
    with out.open("w") as f:
        agent = subprocess.Popen(args, stdout=f, stderr=subprocess.PIPE, text=True)
        assert agent.stderr is not None
        for line in agent.stderr:
            if line.startswith("sits-trace: tracing;"):  # not a path in a warning
                break
        n = rate * seconds
        subprocess.run(["hey", "-n", str(n), "-c", "10", "-q", str(rate // 10),
                        "-disable-keepalive", f"http://127.0.0.1:{port}/"],
                       capture_output=True, check=True)
        time.sleep(2)
        agent.send_signal(signal.SIGINT)
        _, err = agent.communicate(timeout=30)
    spans = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    server = sum(1 for s in spans if s["kind"] == "SERVER")
    with_peer = sum(1 for s in spans if s["kind"] == "SERVER" and s["attributes"].get("client.port"))
    stats = next((x for x in err.splitlines() if "records=" in x), "")
    out.unlink()
    return (f"rate={rate}/s sent={n} traced={server} ({100 * server / n:.1f}%) "
            f"with_client_port={with_peer} | {stats}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rates", type=int, nargs="+", default=[100, 300])
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--time-wait", type=int, default=6000)
    ap.add_argument("--all", action="store_true", help="trace every process, not only nginx")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        nginx, port = _nginx(Path(d))
        try:
            pids = [nginx.pid] + [int(x) for x in subprocess.run(
                ["pgrep", "-P", str(nginx.pid)], check=False, capture_output=True, text=True).stdout.split()]
            tw = _time_wait(port, a.time_wait)
            print(f"time_wait_sockets={tw}")
            for rate in a.rates:
                print(_measure(port, [] if a.all else pids, rate, a.seconds), flush=True)
        finally:
            nginx.terminate()
            nginx.wait(10)


if __name__ == "__main__":
    main()
