"""RCA verdicts reach an OTLP collector as log records: `sits-trace run` with [rca] on and an
SLO the traced server misses (its /slow answers in 300 ms, the objective is 100 ms), exporting
to a real OTLP/gRPC receiver built on opentelemetry-proto. Each verdict is one
`sits.rca.verdict` record beside the spans, carrying the breach and the ranked causes."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support.otlp import GrpcReceiver

from .harness import SITS, curl, python_server

pytestmark = pytest.mark.bpf


def test_verdicts_are_otlp_log_records(tmp_path: Path) -> None:
    rx = GrpcReceiver().start()
    try:
        with python_server() as (port, server):
            cfg = tmp_path / "c.toml"
            cfg.write_text(
                f'[trace]\ncpu_budget = 0\npids = [{server.pid}]\n'
                f'[export]\notlp_endpoint = "{rx.endpoint}"\notlp_protocol = "grpc"\n'
                f'service_name = "rca-otlp"\n'
                f'[api]\nsocket = "{tmp_path / "api.sock"}"\n'
                f'[rca]\nenabled = true\nwindow_s = 2\nmin_spans = 3\n'
                f'[[slo]]\nservice = "rca-otlp"\nduration_ms_p95 = 100\n')
            env = {**os.environ, "SITS_STATS_PATH": str(tmp_path / "stats.json")}
            agent = subprocess.Popen([SITS, "run", "-c", str(cfg)], stderr=subprocess.PIPE,
                                     text=True, env=env)
            assert agent.stderr is not None
            try:
                for line in agent.stderr:
                    if "agent running" in line:
                        break
                stop = time.monotonic() + 8

                def load(i: int) -> None:
                    n = 0
                    while time.monotonic() < stop:
                        curl(f"http://127.0.0.1:{port}/slow", rid=f"rca-otlp-{i}-{n}")
                        n += 1

                threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert rx.wait_for(lambda: any(r.record.event_name == "sits.rca.verdict"
                                               for r in rx.logs), 15), \
                    f"no verdict record; logs: {len(rx.logs)}, spans: {len(rx.spans)}"
            finally:
                agent.terminate()
                rest = agent.communicate(timeout=60)[1]
            assert agent.returncode == 0, rest
    finally:
        rx.stop()
    verdicts = [r for r in rx.logs if r.record.event_name == "sits.rca.verdict"]
    v = verdicts[0]
    a = v.attributes
    assert v.scope == "sits_trace.rca" and v.record.severity_text == "WARN"
    assert a["sits.rca.service"] == "rca-otlp" and a["sits.rca.kind"] == "SERVER"
    assert a["sits.rca.breach.objective"] == "duration_ms_p95"
    assert a["sits.rca.breach.target"] == 100 and a["sits.rca.breach.observed"] >= 250
    causes = json.loads(a["sits.rca.causes"])
    assert causes and a["sits.rca.cause"] == causes[0]["cause"]
    assert a["sits.rca.window.end_unix_nano"] > a["sits.rca.window.start_unix_nano"]
    assert v.body.startswith("rca-otlp: duration_ms_p95 ") and a["sits.rca.cause"] in v.body
    assert v.record.time_unix_nano > 0
    # the spans it judged went to the same collector
    assert any(s.attributes.get("url.path") == "/slow" for s in rx.spans)
