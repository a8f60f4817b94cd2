"""Verdicts and control actions as OTLP log records (exporters/otlp_logs.py), through the
SDK's in-memory exporter: names, severities, bodies and attributes; a verdict without causes
or culprit, and a failing exporter, never raise into the caller."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import (
    InMemoryLogRecordExporter,
    LogRecordExporter,
    LogRecordExportResult,
)
from sits_trace.exporters.otlp_logs import ActionLog, VerdictLog, verdict_body

VERDICT: dict[str, Any] = {
    "time_unix_nano": 1_733_140_000_000_000_000, "service": "vllm",
    "route": "/v1/chat/completions",
    "breach": {"objective": "ttft_ms_p95", "observed": 812.25, "target": 500.0},
    "causes": [
        {"cause": "cpu_starvation", "score": 0.91, "culprit": {"pid": 4242, "name": "stress-ng"},
         "evidence": [{"signal": "sits.cpu.runq_delay_us", "baseline": 40.0,
                       "observed": 5100.0}], "explained_ms": 290.5},
        {"cause": "server_queueing", "score": 0.06, "culprit": None, "evidence": [],
         "explained_ms": 12.0}],
    "window": {"start_unix_nano": 1_733_139_990_000_000_000,
               "end_unix_nano": 1_733_140_000_000_000_000},
    "kind": "SERVER"}


def _records(log: VerdictLog | ActionLog, mem: InMemoryLogRecordExporter) -> list[Any]:
    log.force_flush()
    return [r.log_record for r in mem.get_finished_logs()]


def test_a_verdict_is_one_warn_record_with_the_top_cause_and_culprit() -> None:
    mem = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
    log = VerdictLog(mem)
    log(VERDICT)
    (rec,) = _records(log, mem)
    assert rec.event_name == "sits.rca.verdict" and rec.severity_text == "WARN"
    assert rec.timestamp == VERDICT["time_unix_nano"]
    assert rec.body == ("vllm /v1/chat/completions: ttft_ms_p95 812.2 > 500.0: "
                        "cpu_starvation (pid 4242, name stress-ng)")
    a = dict(rec.attributes)
    assert a["sits.rca.cause"] == "cpu_starvation" and a["sits.rca.score"] == 0.91
    assert a["sits.rca.culprit.pid"] == 4242 and a["sits.rca.culprit.name"] == "stress-ng"
    assert a["sits.rca.explained_ms"] == 290.5
    assert a["sits.rca.breach.observed"] == 812.25 and a["sits.rca.route"] == VERDICT["route"]
    assert a["sits.rca.window.start_unix_nano"] == VERDICT["window"]["start_unix_nano"]
    assert [c["cause"] for c in json.loads(a["sits.rca.causes"])] == [
        "cpu_starvation", "server_queueing"]
    log.shutdown()


def test_degradation_without_causes_or_route() -> None:
    v = {"time_unix_nano": 5, "service": "api", "route": None, "kind": "CLIENT",
         "breach": {"objective": "degradation:duration_ms_p95", "observed": 30.0,
                    "target": 12.0, "baseline": 8.0}, "causes": []}
    mem = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
    log = VerdictLog(mem)
    log(v)
    (rec,) = _records(log, mem)
    a = dict(rec.attributes)
    assert "sits.rca.cause" not in a and "sits.rca.route" not in a
    assert a["sits.rca.breach.baseline"] == 8.0 and a["sits.rca.kind"] == "CLIENT"
    assert rec.body == "api: degradation:duration_ms_p95 30.0 > 12.0"
    log.shutdown()


def test_peer_and_gpu_culprits_name_themselves() -> None:
    v = dict(VERDICT, causes=[{"cause": "network_loss", "score": 0.7,
                               "culprit": {"peer": "10.0.0.2"}, "explained_ms": 1.0}])
    assert verdict_body(v).endswith("network_loss (peer 10.0.0.2)")
    v = dict(VERDICT, causes=[{"cause": "gpu_throttling", "score": 0.7, "culprit": {"gpu": 0}}])
    assert verdict_body(v).endswith("gpu_throttling (gpu 0)")


class _Down(LogRecordExporter):
    """A collector that is down: every export fails."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        self.calls += 1
        raise ConnectionError("collector down")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_a_collector_that_is_down_never_raises_into_the_caller() -> None:
    down = _Down()
    log = VerdictLog(down)
    for _ in range(3):
        log(VERDICT)
    log.force_flush()
    log.shutdown()
    assert down.calls >= 1


def test_an_action_is_one_info_record() -> None:
    mem = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
    log = ActionLog(mem)
    log({"kind": "cpu_throttle", "cause": "cpu_starvation", "mode": "act", "pid": 42,
         "time_unix": 1.5, "applied": True})
    (rec,) = _records(log, mem)
    assert rec.event_name == "sits.control.cpu_throttle" and rec.severity_text == "INFO"
    assert rec.timestamp == 1_500_000_000 and dict(rec.attributes)["sits.control.pid"] == 42
    log.shutdown()
