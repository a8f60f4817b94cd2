"""The run behind docs/run.md: `sits-trace run` with Prometheus /metrics and OTLP/gRPC to the tests' in-process
receiver, Debian's `prometheus` scraping it, three PromQL queries. Root; prints what the page quotes.

    sudo .venv/bin/python scripts/docs/capture_run.py
"""
import json
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.integration.harness import SITS, curl, free_port, python_server, wait_port
from tests.support.otlp import GrpcReceiver


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()

with tempfile.TemporaryDirectory() as d, python_server() as (port, _):
    d = Path(d)
    rx = GrpcReceiver().start()
    mport, pport = free_port(), free_port()
    cfg = d / "config.toml"
    cfg.write_text(f'''[trace]
cpu_budget = 0
[export]
jsonl_path = ""
prometheus_port = {mport}
otlp_endpoint = "{rx.endpoint}"
otlp_protocol = "grpc"
otlp_metrics_interval_s = 5
[api]
socket = "{d}/api.sock"
''')
    print("### config.toml\n" + cfg.read_text())
    env = {"PATH": "/usr/bin:/bin", "SITS_STATS_PATH": str(d / "stats.json"), "HOME": str(d)}
    agent = subprocess.Popen([SITS, "run", "-c", str(cfg)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    head = []
    for line in agent.stderr:
        head.append(line)
        if "agent running" in line:
            break
    print("### agent stderr (start)\n" + "".join(head))
    (d / "prometheus.yml").write_text(f'''global:
  scrape_interval: 2s
scrape_configs:
  - job_name: sits-trace
    static_configs: [{{targets: ["127.0.0.1:{mport}"]}}]
''')
    prom = subprocess.Popen(["prometheus", f"--config.file={d}/prometheus.yml", f"--storage.tsdb.path={d}/tsdb",
                             f"--web.listen-address=127.0.0.1:{pport}", "--enable-feature=exemplar-storage"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(pport, 30)
        for _ in range(60):
            r = json.loads(get(f"http://127.0.0.1:{pport}/api/v1/query?query=up"))
            if r["data"]["result"] and r["data"]["result"][0]["value"][1] == "1":
                break
            time.sleep(0.5)
        time.sleep(2)
        for i in range(40):
            time.sleep(0.15)
            curl(f"http://127.0.0.1:{port}/models/{i % 4}/infer")
        for _ in range(10):
            curl(f"http://127.0.0.1:{port}/status/503")
        for _ in range(5):
            curl(f"http://127.0.0.1:{port}/slow")
        time.sleep(12)
        m = get(f"http://127.0.0.1:{mport}/metrics")
        print("### /metrics (server histogram, excerpt)")
        print("\n".join(x for x in m.splitlines() if x.startswith(("http_server_request_duration_seconds_count", "# TYPE http_server", "sits_spans_total", "sits_bpf_events_lost_total"))))
        for q in ['sum by (http_route, http_response_status_code) (increase(http_server_request_duration_seconds_count{service_name="python3.11",http_route=~"/models/.*|/slow|/status/.*"}[1m]))',
                  'histogram_quantile(0.95, sum by (le, http_route) (rate(http_server_request_duration_seconds_bucket{service_name="python3.11",http_route=~"/models/.*|/slow|/status/.*"}[1m])))',
                  'up{job="sits-trace"}']:
            r = json.loads(get(f"http://127.0.0.1:{pport}/api/v1/query?" + urllib.parse.urlencode({"query": q})))
            print("### query:", q)
            for s in r["data"]["result"]:
                print(json.dumps(s["metric"]), s["value"][1])
    finally:
        prom.terminate()
        prom.wait(10)
        agent.terminate()
        _, err = agent.communicate(timeout=60)
        print("### agent stderr (stop)\n" + err)
        time.sleep(1)
        spans = rx.spans if hasattr(rx, "spans") else []
        print("### OTLP receiver:", len(spans), "spans")
        mine = [s for s in spans if str(s.attributes.get("url.path", "")).startswith("/models/")]
        print("spans with /models/:", len(mine), "metric export requests:", len(rx.metrics))
        if mine:
            s0 = mine[0]
            print("resource:", s0.resource)
            print("span:", s0.span.name, s0.span.kind, s0.span.trace_id.hex(), json.dumps(s0.attributes, default=str))
        rx.stop()
