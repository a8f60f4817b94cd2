"""What the agent decides, as OTLP log records: the control loop's actions and the RCA's
verdicts, beside the spans in the same collector.

`ActionLog(exporter)` turns the loop's action dicts into records with event name
`sits.control.<kind>` and `sits.control.*` attributes; `VerdictLog(exporter)` turns verdicts
(their `to_json()` form) into `sits.rca.verdict` records (severity WARN) with `sits.rca.*`
attributes: service, route, kind, the breach, the top cause with its culprit and the ms it
explains, the window, and the whole ranking as JSON. Both are batched by the SDK's processor,
so a collector that is down costs a dropped batch, never the caller's time; nothing here
raises into the caller. `otlp_log_exporter(endpoint, protocol)` builds the OTLP exporter;
the SDK's in-memory exporter serves the tests.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter
from opentelemetry.sdk.resources import Resource

log = logging.getLogger(__name__)


def _attr(v: Any) -> str | bool | int | float:
    if isinstance(v, (str, bool, int, float)):
        return v
    return json.dumps(v, default=str)


class _RecordLog:
    """One logger provider with a batching processor, for one kind of record."""

    def __init__(self, exporter: LogRecordExporter, scope: str, service_name: str) -> None:
        self._provider = LoggerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
        self._logger = self._provider.get_logger(scope)

    def _emit(self, time_unix_nano: int, severity: SeverityNumber, body: str,
              attrs: dict[str, str | bool | int | float], event_name: str) -> None:
        try:
            self._logger.emit(LogRecord(
                timestamp=time_unix_nano or None, severity_number=severity,
                severity_text=severity.name, body=body, attributes=attrs,
                event_name=event_name))
        except Exception as exc:  # noqa: BLE001 - the exporter's failure is not the caller's
            log.warning("OTLP log record dropped: %s", exc)

    def force_flush(self) -> None:
        self._provider.force_flush()

    def shutdown(self) -> None:
        self._provider.shutdown()


class ActionLog(_RecordLog):
    """Control actions (docs/control.md), one record each."""

    def __init__(self, exporter: LogRecordExporter, service_name: str = "sits-trace") -> None:
        super().__init__(exporter, "sits_trace.control", service_name)

    def __call__(self, action: dict[str, Any]) -> None:
        kind = str(action.get("kind", "action"))
        attrs = {f"sits.control.{k}": _attr(v) for k, v in action.items()
                 if v is not None and k != "time_unix"}
        body = f"control {kind} ({action.get('cause') or 'no cause'}, mode {action.get('mode')})"
        self._emit(int(float(action.get("time_unix", 0)) * 1e9), SeverityNumber.INFO, body,
                   attrs, f"sits.control.{kind}")


def verdict_attributes(v: dict[str, Any]) -> dict[str, str | bool | int | float]:
    """The `sits.rca.*` attributes of a verdict in its `to_json()` form (docs/rca.md)."""
    out: dict[str, str | bool | int | float] = {
        "sits.rca.service": str(v.get("service", "")), "sits.rca.kind": str(v.get("kind", ""))}
    if v.get("route"):
        out["sits.rca.route"] = str(v["route"])
    for k, val in (v.get("breach") or {}).items():
        if val is not None:
            out[f"sits.rca.breach.{k}"] = _attr(val)
    window = v.get("window") or {}
    for k in ("start_unix_nano", "end_unix_nano"):
        if window.get(k):
            out[f"sits.rca.window.{k}"] = int(window[k])
    causes = v.get("causes") or []
    if causes:
        top = causes[0]
        out["sits.rca.cause"] = str(top.get("cause", "unknown"))
        out["sits.rca.score"] = float(top.get("score", 0.0))
        out["sits.rca.explained_ms"] = float(top.get("explained_ms", 0.0))
        for k, val in (top.get("culprit") or {}).items():
            if val is not None:
                out[f"sits.rca.culprit.{k}"] = _attr(val)
        out["sits.rca.causes"] = json.dumps(causes, separators=(",", ":"), default=str)
    return out


def verdict_body(v: dict[str, Any]) -> str:
    """`service route: objective observed > target: top cause (culprit)`."""
    b = v.get("breach") or {}
    route = f" {v['route']}" if v.get("route") else ""
    head = f"{v.get('service', '')}{route}: {b.get('objective', 'degradation')}"
    if isinstance(b.get("observed"), (int, float)) and isinstance(b.get("target"), (int, float)):
        head += f" {b['observed']:.1f} > {b['target']:.1f}"
    causes = v.get("causes") or []
    if not causes:
        return head
    top = causes[0]
    culprit = top.get("culprit") or {}
    who = ", ".join(f"{k} {val}" for k, val in culprit.items() if val is not None)
    return f"{head}: {top.get('cause')}" + (f" ({who})" if who else "")


class VerdictLog(_RecordLog):
    """RCA verdicts (docs/rca.md), one `sits.rca.verdict` record each."""

    def __init__(self, exporter: LogRecordExporter, service_name: str = "sits-trace") -> None:
        super().__init__(exporter, "sits_trace.rca", service_name)

    def __call__(self, verdict: dict[str, Any]) -> None:
        self._emit(int(verdict.get("time_unix_nano", 0)), SeverityNumber.WARN,
                   verdict_body(verdict), verdict_attributes(verdict), "sits.rca.verdict")


def otlp_log_exporter(endpoint: str, protocol: str = "grpc") -> LogRecordExporter:
    """The SDK's OTLP log exporter for a collector (grpc or http/protobuf)."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as Http  # noqa: PLC0415 - only the chosen protocol's

        url = endpoint.rstrip("/")
        return Http(endpoint=url if url.endswith("/v1/logs") else url + "/v1/logs")
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as Grpc  # noqa: PLC0415 - only the chosen protocol's

    return Grpc(endpoint=endpoint, insecure=endpoint.startswith("http://"))


def otlp_action_log(endpoint: str, protocol: str = "grpc",
                    service_name: str = "sits-trace") -> ActionLog:
    """An ActionLog exporting to an OTLP collector."""
    return ActionLog(otlp_log_exporter(endpoint, protocol), service_name)


def otlp_verdict_log(endpoint: str, protocol: str = "grpc",
                     service_name: str = "sits-trace") -> VerdictLog:
    """A VerdictLog exporting to an OTLP collector."""
    return VerdictLog(otlp_log_exporter(endpoint, protocol), service_name)
