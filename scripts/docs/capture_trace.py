"""The run behind docs/trace.md: `sits-trace trace` (table) against nginx over HTTP and HTTPS, then
`trace --json` against uvicorn (TLS, Server-Sent Events). Root; prints what the page quotes.

    sudo .venv/bin/python scripts/docs/capture_trace.py
"""
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.integration.harness import SITS, Nginx, curl, uvicorn_server


def trace(args, drive, secs=25):
    p = subprocess.Popen([SITS, "trace", *args, "-d", str(secs), "--cpu-budget", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait for "agent running"/ready on stderr
    head = []
    for line in p.stderr:
        head.append(line)
        if "tracing;" in line:
            break
    time.sleep(0.5)
    drive()
    out, err = p.communicate(timeout=90)
    return out, "".join(head) + err

with tempfile.TemporaryDirectory() as d:
    ng = Nginx(Path(d))
    try:
        pids = []
        for pid in ng.pids():
            pids += ["-p", str(pid)]
        def drive_ng():
            h, s = ng.http_port, ng.https_port
            curl(f"http://127.0.0.1:{h}/", rid="doc-1")
            curl(f"http://127.0.0.1:{h}/missing")
            curl(f"http://127.0.0.1:{h}/fail")
            curl(f"http://127.0.0.1:{h}/upload", "--data-binary", "x" * 3000)
            curl(f"https://127.0.0.1:{s}/static.txt")
            curl(f"https://127.0.0.1:{s}/", "-H", "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            time.sleep(1)
        out, err = trace(pids, drive_ng)
        print("### NGINX", ng.http_port, ng.https_port, pids)
        print("$ sits-trace trace -p", ng.pids())
        print(out, "--stderr--", err, sep="\n")
    finally:
        ng.stop()
    with uvicorn_server() as (port, _):
        def drive_uv():
            curl(f"https://127.0.0.1:{port}/sse", rid="doc-sse")
            curl(f"https://127.0.0.1:{port}/status/500")
            time.sleep(1)
        out, err = trace(["--json", "--port", str(port)], drive_uv)
        print("### UVICORN", port)
        print(out, "--stderr--", err, sep="\n")
