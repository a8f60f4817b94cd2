"""Control actions as OTLP log records (one record per action the control loop takes).

`ActionLog(exporter)` turns the loop's action dicts into log records with event name
`sits.control.<kind>` and `sits.control.*` attributes, batched by the SDK's processor.
`otlp_action_log(endpoint, protocol)` builds one for an OTLP collector; the in-memory
exporter of the SDK serves the tests. Nothing here raises into the loop.
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


class ActionLog:
    def __init__(self, exporter: LogRecordExporter, service_name: str = "sits-trace") -> None:
        self._provider = LoggerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
        self._logger = self._provider.get_logger("sits_trace.control")

    def __call__(self, action: dict[str, Any]) -> None:
        kind = str(action.get("kind", "action"))
        attrs = {f"sits.control.{k}": _attr(v) for k, v in action.items()
                 if v is not None and k != "time_unix"}
        body = f"control {kind} ({action.get('cause') or 'no cause'}, mode {action.get('mode')})"
        self._logger.emit(LogRecord(
            timestamp=int(float(action.get("time_unix", 0)) * 1e9) or None,
            severity_number=SeverityNumber.INFO, severity_text="INFO",
            body=body, attributes=attrs, event_name=f"sits.control.{kind}"))

    def force_flush(self) -> None:
        self._provider.force_flush()

    def shutdown(self) -> None:
        self._provider.shutdown()


def otlp_action_log(endpoint: str, protocol: str = "grpc",
                    service_name: str = "sits-trace") -> ActionLog:
    """An ActionLog exporting to an OTLP collector (grpc or http/protobuf)."""
    exporter: LogRecordExporter
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as Http  # noqa: PLC0415 - only the chosen protocol's

        url = endpoint.rstrip("/")
        exporter = Http(endpoint=url if url.endswith("/v1/logs") else url + "/v1/logs")
    else:
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as Grpc  # noqa: PLC0415 - only the chosen protocol's

        exporter = Grpc(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    return ActionLog(exporter, service_name)
