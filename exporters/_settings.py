"""Exporter settings: the config file's [export] keys over the standard OTEL_* variables.

Precedence for each OTLP setting: an [export] key set in the config (or its
SITS_EXPORT_* variable) -> the signal-specific OTEL_EXPORTER_OTLP_TRACES_* /
_METRICS_* variable -> OTEL_EXPORTER_OTLP_* -> the default. Raises ConfigError.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from sits_trace.agent.config import ConfigError, ExportConfig

from ._resource import parse_key_values

PROTOCOLS = ("grpc", "http/protobuf")
_HTTP_PATHS = {"traces": "/v1/traces", "metrics": "/v1/metrics"}


@dataclass(frozen=True, slots=True)
class OtlpSettings:
    protocol: str  # grpc | http/protobuf
    traces_endpoint: str  # grpc: http(s)://host:port ; http: the full URL, /v1/traces included
    metrics_endpoint: str
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0
    service_name: str = ""  # "" is each span's process.executable.name
    resource_attributes: dict[str, str] = field(default_factory=dict)
    metrics: bool = True
    metrics_interval_s: float = 15.0
    queue_size: int = 8192
    batch_size: int = 512
    batch_delay_s: float = 1.0
    retry_deadline_s: float = 30.0
    max_label_sets: int = 1000
    # the standard OTEL_EXPORTER_OTLP_[TRACES_]{COMPRESSION,CERTIFICATE,CLIENT_KEY,
    # CLIENT_CERTIFICATE}: spans are sent by our own sender (_otlp_traces), not the SDK's
    gzip: bool = False
    certificate: str = ""
    client_key: str = ""
    client_certificate: str = ""


def _env(environ: Mapping[str, str], signal: str, name: str) -> str:
    specific = environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_{name}", "").strip()
    return specific or environ.get(f"OTEL_EXPORTER_OTLP_{name}", "").strip()


def _endpoint(cfg: ExportConfig, environ: Mapping[str, str], protocol: str, signal: str) -> str:
    """The URL for one signal; "" when neither the config nor OTEL_* names a collector."""
    specific = environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "").strip()
    if not cfg.otlp_endpoint and specific:
        return specific  # the spec: a signal endpoint is used as is
    base = cfg.otlp_endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not base or protocol == "grpc":
        return base
    path = urlparse(base).path
    if path.endswith(_HTTP_PATHS[signal]):
        return base
    return base.rstrip("/") + _HTTP_PATHS[signal]


def _timeout_s(cfg: ExportConfig, environ: Mapping[str, str]) -> float:
    if cfg.otlp_timeout_s:
        return float(cfg.otlp_timeout_s)
    raw = _env(environ, "traces", "TIMEOUT")
    if not raw:
        return 10.0
    try:
        return float(raw) / 1000.0  # the spec gives OTEL_EXPORTER_OTLP_TIMEOUT in milliseconds
    except ValueError:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_TIMEOUT: {raw!r} is not a number of "
                          "milliseconds") from None


def _check(cfg: ExportConfig) -> None:
    for key, v, lo, hi in (
        ("queue_size", cfg.queue_size, 1, 10_000_000), ("batch_size", cfg.batch_size, 1, 100_000),
        ("batch_delay_s", cfg.batch_delay_s, 0.001, 3600),
        ("retry_deadline_s", cfg.retry_deadline_s, 0, 86400),
        ("otlp_timeout_s", cfg.otlp_timeout_s, 0, 3600),
        ("otlp_metrics_interval_s", cfg.otlp_metrics_interval_s, 0.1, 86400),
        ("max_label_sets", cfg.max_label_sets, 1, 1_000_000),
    ):
        if not lo <= v <= hi:
            raise ConfigError(f"export.{key}: {v} is outside {lo}..{hi}")


def otlp_settings(cfg: ExportConfig, environ: Mapping[str, str]) -> OtlpSettings | None:
    """The OTLP settings, or None when no collector is configured anywhere."""
    _check(cfg)
    protocol = cfg.otlp_protocol or _env(environ, "traces", "PROTOCOL") or "grpc"
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not one of "
                          "'grpc', 'http/protobuf'")
    traces = _endpoint(cfg, environ, protocol, "traces")
    if not traces:
        return None
    if "://" not in traces:
        raise ConfigError(f"OTLP endpoint {traces!r} needs a scheme, e.g. http://localhost:4317")
    headers = parse_key_values(_env(environ, "traces", "HEADERS"))
    headers.update(parse_key_values(cfg.otlp_headers))
    resource = parse_key_values(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    resource.update(parse_key_values(cfg.resource_attributes))
    service = cfg.service_name or environ.get("OTEL_SERVICE_NAME", "").strip()
    compression = _env(environ, "traces", "COMPRESSION").lower()
    if compression not in ("", "none", "gzip"):
        raise ConfigError(f"OTEL_EXPORTER_OTLP_COMPRESSION: {compression!r} is not one of "
                          "'gzip', 'none'")
    for name in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        path = _env(environ, "traces", name)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"OTEL_EXPORTER_OTLP_{name}: {path} is not a readable file")
    return OtlpSettings(
        protocol=protocol, traces_endpoint=traces,
        metrics_endpoint=_endpoint(cfg, environ, protocol, "metrics")
        or traces.replace(_HTTP_PATHS["traces"], _HTTP_PATHS["metrics"]),
        headers=headers, timeout_s=_timeout_s(cfg, environ), service_name=service,
        resource_attributes=resource, metrics=cfg.otlp_metrics,
        metrics_interval_s=cfg.otlp_metrics_interval_s, queue_size=cfg.queue_size,
        batch_size=cfg.batch_size, batch_delay_s=cfg.batch_delay_s,
        retry_deadline_s=cfg.retry_deadline_s, max_label_sets=cfg.max_label_sets,
        gzip=compression == "gzip", certificate=_env(environ, "traces", "CERTIFICATE"),
        client_key=_env(environ, "traces", "CLIENT_KEY"),
        client_certificate=_env(environ, "traces", "CLIENT_CERTIFICATE"),
    )
