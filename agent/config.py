"""Configuration: defaults -> TOML file -> SITS_* environment -> CLI flags, then validate().

A key is written `section.name` in errors and `[section] name = ...` in TOML;
its environment form is SITS_SECTION_NAME (e.g. SITS_EXPORT_JSONL_PATH).
"""

from __future__ import annotations

import os
import socket
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

STATS_PATH = Path(os.environ.get("SITS_STATS_PATH", "/run/sits-trace/stats.json"))


# query keys whose values are replaced (compared case-insensitively); trace.redact_query_keys
DEFAULT_QUERY_KEYS: tuple[str, ...] = (
    "access_token", "api_key", "apikey", "auth", "client_secret", "code", "key", "passwd",
    "password", "secret", "sig", "signature", "token", "x-amz-signature", "x-goog-signature",
    "awsaccesskeyid",
)


def default_cpu_budget(cpus: int | None = None) -> float:
    """5% of the node's CPUs, at least 0.1 and at most 1 core: 0.1 on a 2-core VM, 1 core
    on a 20-core-or-larger GPU node."""
    n = cpus if cpus is not None else (os.cpu_count() or 1)
    return round(min(1.0, max(0.1, 0.05 * n)), 3)


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what is allowed."""


@dataclass(slots=True)
class TraceConfig:
    pids: list[int] = field(default_factory=list)  # only these processes and their children; []: all
    port: int = 0  # 0: every port
    tls: bool = True  # uprobes on OpenSSL SSL_read/SSL_write(_ex) for HTTPS plaintext
    # payload captured per read/write (a power of two, 256..16384); a longer read or write
    # also sends the rest, up to its last 512 bytes; past a request's first 64 KiB its reads
    # send only their last 512 (folded into one such record a second), and past a response's
    # first 64 KiB so do the server's writes longer than the capture
    capture_bytes: int = 4096
    ringbuf_mib: int = 16  # ring buffer size (a power of two)
    # how often the ring buffer is drained (1..1000); sooner when 1/16 of the ring waits
    poll_ms: int = 100
    idle_timeout_s: float = 30.0  # an exchange stuck this long is given up
    # cores the agent may use; above it the kernel captures one exchange in 2**n (and counts
    # the rest) until it fits: see agent/capture/shedding.py. 0: capture everything, whatever it costs
    cpu_budget: float = field(default_factory=default_cpu_budget)  # 5% of CPUs, 0.1..1
    ssl_libraries: list[str] = field(default_factory=list)  # extra libssl paths to probe
    # seconds between looks at the libraries of processes with traced connections (a libssl
    # dlopen()ed late gets its TLS probes within this long)
    library_rescan_s: float = 10.0
    # a connection found to carry no HTTP (another protocol: a cache, a database, gRPC; a
    # tunnel or WebSocket after its upgrade; TLS from a library the agent cannot probe) is
    # no longer sent by the kernel, only counted (conns_muted): its bytes cost the agent and
    # its load shedding would have dropped real requests' spans
    mute_non_http: bool = True
    # query-string keys whose values every output shows as REDACTED ([] turns it off)
    redact_query_keys: list[str] = field(default_factory=lambda: list(DEFAULT_QUERY_KEYS))


@dataclass(slots=True)
class ExportConfig:
    jsonl_path: str = "-"  # "-" is stdout; "" disables
    otlp_endpoint: str = ""  # e.g. http://localhost:4317 ; "" disables (or OTEL_EXPORTER_OTLP_ENDPOINT)
    otlp_protocol: str = ""  # grpc | http/protobuf ; "" is OTEL_EXPORTER_OTLP_PROTOCOL, else grpc
    prometheus_port: int = 0  # 0 disables /metrics
    prometheus_address: str = "127.0.0.1"  # address /metrics listens on
    service_name: str = ""  # "" is OTEL_SERVICE_NAME, else each span's process.executable.name
    # the rest belongs to exporters/ (checked by exporters/_settings.py); see docs/export.md
    otlp_headers: str = ""  # "k=v,k2=v2"; "" is OTEL_EXPORTER_OTLP_HEADERS
    otlp_timeout_s: float = 0.0  # one export request; 0 is OTEL_EXPORTER_OTLP_TIMEOUT (ms), else 10
    otlp_metrics: bool = True  # RED + agent metrics over OTLP as well as traces
    otlp_metrics_interval_s: float = 15.0  # how often metrics are pushed over OTLP
    resource_attributes: str = ""  # "k=v,..." over OTEL_RESOURCE_ATTRIBUTES
    queue_size: int = 8192  # spans held per exporter; more are dropped and counted
    batch_size: int = 512  # spans per export request
    batch_delay_s: float = 1.0  # longest a span waits for its batch to fill
    retry_deadline_s: float = 30.0  # a batch the collector keeps refusing is dropped after this
    max_label_sets: int = 1000  # distinct label sets per HTTP duration metric; more go to route="_other"


@dataclass(slots=True)
class SignalsConfig:
    """Node signals beside the spans (docs/gpu.md); each can be turned off."""

    tcp: bool = True  # bpf/tcp.c: retransmits, resets, TIME_WAIT, RTT (sits.tcp.*)
    sched: bool = True  # bpf/sched.c: run-queue delay of traced threads (sits.cpu.*)
    sched_all: bool = False  # every process's threads, not only those with traced connections
    cuda: bool = True  # bpf/cuda.c: libcuda uprobes (sits.cuda.*)
    nvml: bool = True  # GPU state through NVML (sits.gpu.*)
    features: bool = True  # the per-second feature frame (RCA input, node metrics)
    features_keep_s: int = 3600  # rows (seconds) the frame keeps


@dataclass(slots=True)
class ApiConfig:
    """The daemon's local read-only API (`sits-trace top` reads it): JSON lines on a Unix socket."""

    socket: str = "/run/sits-trace/api.sock"  # "" disables; the directory is made root-only
    window_s: float = 30.0  # request rate, error rate and percentiles cover this many seconds
    slowest: int = 5  # slowest recent spans kept per route, with all their attributes


@dataclass(slots=True)
class ControlConfig:
    """The closed loop (docs/control.md): batch window, CPU and GPU priorities."""

    enabled: bool = True  # run the control loop and its socket at all
    mode: str = "advise"  # observe | advise (publish decisions, touch nothing) | act
    socket_path: str = "/run/sits-trace/control.sock"  # "" disables the API
    socket_group: str = ""  # group that may use the API (mode 0660); "" is root's
    service: str = ""  # whose batch window is controlled; "" is the busiest service
    slo_ms: float = 1000.0  # the latency target the window controller holds P95 under
    controller: str = "verdict"  # verdict (ours) | rule (published) | aimd | static
    window_ms: float = 20.0  # the starting window
    window_min_ms: float = 10.0  # the window's floor (the published rule's: 10 ms)
    window_max_ms: float = 500.0  # the window's ceiling (the published rule's: 500 ms)
    interval_s: float = 1.0  # the loop's period: one decision per interval
    verdicts_path: str = ""  # the RCA's verdicts as JSON lines; "" is none from a file
    min_score: float = 0.5  # a verdict's top cause below this score is not acted on
    cpu_fraction: float = 0.25  # a throttled culprit's CPU cap, in CPUs (at least 0.05)
    cpu_weight: int = 10  # its cgroup weight (100 is the default share)
    max_actions: int = 4  # throttles at once
    # cpu_starvation: also reserve CPU for the served process's busiest threads (SCHED_DEADLINE,
    # sized from their use; undone like a throttle)
    cpu_reservation: bool = False
    clear_after_s: float = 10.0  # the cause is gone this long: the action is undone
    stream_priority: int = -1  # asked of the served process's compute stream (lower: higher)
    copy_budget_bytes_per_s: float = 0.0  # asked of a cooperating copier; 0: none
    state_path: str = "/run/sits-trace/control-actions.json"  # undo after a crash


CONTROL_MODES = ("observe", "advise", "act")
CONTROLLERS = ("verdict", "rule", "aimd", "static")


@dataclass(slots=True)
class RcaConfig:
    """Root-cause analysis (docs/rca.md); the objectives themselves are [[slo]] tables."""

    enabled: bool = False  # `sits-trace run`: judge windows and export verdicts
    window_s: float = 10.0  # seconds of spans judged together (one verdict per service and window)
    baseline_windows: int = 12  # normal windows a breach is compared with
    min_spans: int = 5  # a window with fewer spans of a service is not judged
    degradation_ratio: float = 1.5  # no SLO: p95 this many times the baseline's is a breach
    min_increase_ms: float = 2.0  # ... and at least this much higher
    model: str = ""  # "" is the shipped model (analyzers/rca/model_v1.json); "none": rules only


# [[slo]] keys: service (required), route, error_rate, <metric>_p<NN> with metric one of these
SLO_METRICS = ("duration_ms", "ttft_ms", "tbt_ms")


@dataclass(slots=True)
class Config:
    trace: TraceConfig = field(default_factory=TraceConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    rca: RcaConfig = field(default_factory=RcaConfig)
    slo: list[dict[str, Any]] = field(default_factory=list)  # [[slo]] tables, checked below

    def validate(self) -> Config:
        t = self.trace
        _power_of_two("trace.capture_bytes", t.capture_bytes, 256, 16384)
        _power_of_two("trace.ringbuf_mib", t.ringbuf_mib, 1, 1024)
        _range("trace.port", t.port, 0, 65535)
        _range("trace.poll_ms", t.poll_ms, 1, 1000)
        _range("trace.library_rescan_s", t.library_rescan_s, 0.5, 3600)
        _range("trace.idle_timeout_s", t.idle_timeout_s, 0.1, 86400)
        _range("trace.cpu_budget", t.cpu_budget, 0, 1024)
        for p in t.pids:
            _range("trace.pids", p, 1, 2**22)
        e = self.export
        if e.otlp_protocol not in ("", "grpc", "http/protobuf"):
            raise ConfigError(f"export.otlp_protocol: {e.otlp_protocol!r} is not one of "
                              "'grpc', 'http/protobuf'")
        _range("export.prometheus_port", e.prometheus_port, 0, 65535)
        if e.otlp_endpoint:
            _endpoint("export.otlp_endpoint", e.otlp_endpoint)
        _jsonl_path("export.jsonl_path", e.jsonl_path)
        if e.prometheus_port:
            _resolvable("export.prometheus_address", e.prometheus_address)
        _range("signals.features_keep_s", self.signals.features_keep_s, 10, 86400)
        _range("api.window_s", self.api.window_s, 1, 3600)
        _range("api.slowest", self.api.slowest, 0, 100)
        _validate_control(self.control)
        r = self.rca
        _range("rca.window_s", r.window_s, 0.5, 3600)
        _range("rca.baseline_windows", r.baseline_windows, 1, 1000)
        _range("rca.min_spans", r.min_spans, 1, 100000)
        _range("rca.degradation_ratio", r.degradation_ratio, 1.0, 100)
        for i, entry in enumerate(self.slo):
            _check_slo(f"slo[{i}]", entry)
        return self


def _check_slo(key: str, entry: Mapping[str, Any]) -> None:
    if not isinstance(entry.get("service"), str) or not entry["service"]:
        raise ConfigError(f"{key}.service: required (the service name, e.g. the executable)")
    if "route" in entry and not str(entry["route"]).startswith("/"):
        raise ConfigError(f"{key}.route: {entry['route']!r} must start with '/'")
    objectives = 0
    for k, v in entry.items():
        if k in ("service", "route"):
            continue
        metric, _, pct = k.rpartition("_p")
        ok = k == "error_rate" or (metric in SLO_METRICS and pct.replace(".", "", 1).isdigit()
                                   and 0 < float(pct) < 100)
        if not ok:
            raise ConfigError(f"{key}.{k}: unknown objective (allowed: error_rate, "
                              f"<{'|'.join(SLO_METRICS)}>_p<NN>, e.g. ttft_ms_p95)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{key}.{k}: {v!r} is not a non-negative number")
        objectives += 1
    if not objectives:
        raise ConfigError(f"{key}: no objective (e.g. duration_ms_p95 = 200)")


SECTIONS = ("trace", "export", "signals", "api", "control", "rca")


def _endpoint(key: str, url: str) -> None:
    """http(s)://host[:port][/path], with a bracketed IPv6 host; the fix named when not."""
    example = "e.g. http://localhost:4317 or http://[::1]:4317"
    if "://" not in url:
        raise ConfigError(f"{key}: {url!r} needs a scheme, {example}")
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises on a bad port
    except ValueError as exc:
        raise ConfigError(f"{key}: {url!r} is not a valid URL ({exc}), {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: {url!r} must be http:// or https:// with a host, {example}")


def _jsonl_path(key: str, path: str) -> None:
    """"-" (stdout), "" (off) or a file whose directory exists."""
    if path in ("", "-"):
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{key}: {path!r} is a directory; give a file path, e.g. "
                          f"{p / 'spans.jsonl'}")
    if not p.parent.is_dir():
        raise ConfigError(f"{key}: directory {str(p.parent)!r} does not exist; create it or "
                          "choose another path ('-' is stdout, '' turns it off)")


def _resolvable(key: str, host: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        raise ConfigError(f"{key}: {host!r} does not resolve; use an address of this node, "
                          "e.g. 127.0.0.1 or 0.0.0.0") from None


def _validate_control(c: ControlConfig) -> None:
    if c.mode not in CONTROL_MODES:
        raise ConfigError(f"control.mode: {c.mode!r} is not one of "
                          f"{', '.join(repr(m) for m in CONTROL_MODES)}")
    if c.controller not in CONTROLLERS:
        raise ConfigError(f"control.controller: {c.controller!r} is not one of "
                          f"{', '.join(repr(m) for m in CONTROLLERS)}")
    _range("control.window_min_ms", c.window_min_ms, 0.1, 60000)
    _range("control.window_max_ms", c.window_max_ms, c.window_min_ms, 60000)
    _range("control.window_ms", c.window_ms, c.window_min_ms, c.window_max_ms)
    _range("control.slo_ms", c.slo_ms, 0.1, 3600000)
    _range("control.interval_s", c.interval_s, 0.05, 3600)
    _range("control.min_score", c.min_score, 0, 1)
    _range("control.cpu_fraction", c.cpu_fraction, 0.05, 1024)
    _range("control.cpu_weight", c.cpu_weight, 1, 100)
    _range("control.max_actions", c.max_actions, 0, 64)
    _range("control.clear_after_s", c.clear_after_s, 0, 86400)
    _range("control.stream_priority", c.stream_priority, -16, 16)
    _range("control.copy_budget_bytes_per_s", c.copy_budget_bytes_per_s, 0, 1e13)


def _range(key: str, v: float, lo: float, hi: float) -> None:
    if not lo <= v <= hi:
        raise ConfigError(f"{key}: {v} is outside {lo}..{hi}")


def _power_of_two(key: str, v: int, lo: int, hi: int) -> None:
    _range(key, v, lo, hi)
    if v & (v - 1):
        raise ConfigError(f"{key}: {v} is not a power of two ({lo}..{hi})")


def _coerce(key: str, current: Any, raw: Any) -> Any:
    """Convert a TOML or environment value to the type of the field's default."""
    try:
        if isinstance(current, bool):
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(current, list):
            if not isinstance(raw, (list, str)):
                raise TypeError(raw)
            items = raw if isinstance(raw, list) else [x for x in str(raw).split(",") if x.strip()]
            kind = int if key.endswith("pids") else str
            return [kind(x) for x in items]
        if isinstance(current, int):
            if isinstance(raw, float) or (isinstance(raw, str) and not raw.strip().lstrip("-").isdigit()):
                raise ValueError(raw)
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if not isinstance(raw, str):
            raise ValueError(raw)
        return raw
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {raw!r} is not a valid {type(current).__name__}") from None


def _apply(cfg: Config, section: str, values: Mapping[str, Any], origin: str) -> None:
    sub = getattr(cfg, section, None) if section in SECTIONS else None
    if sub is None:
        raise ConfigError(f"{origin}: unknown section [{section}] "
                          f"(allowed: {', '.join(SECTIONS)})")
    names = {f.name for f in fields(sub)}
    for k, v in values.items():
        if k not in names:
            raise ConfigError(f"{origin}: unknown key {section}.{k} "
                              f"(allowed: {', '.join(sorted(names))})")
        setattr(sub, k, _coerce(f"{section}.{k}", getattr(sub, k), v))


def load(path: str | Path | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """Build and validate the configuration. Raises ConfigError."""
    cfg = Config()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path}: not UTF-8 (byte {exc.start}); save it as "
                              "UTF-8") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: not valid TOML ({exc})") from None
        slos = data.pop("slo", [])
        if not isinstance(slos, list) or not all(isinstance(e, dict) for e in slos):
            raise ConfigError(f"{path}: slo must be [[slo]] tables")
        cfg.slo = list(slos)
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: {section} must be a [section] table")
            _apply(cfg, section, values, str(path))
    environ = os.environ if env is None else env
    for section in SECTIONS:
        prefix = f"SITS_{section.upper()}_"
        vals = {k[len(prefix):].lower(): v for k, v in environ.items() if k.startswith(prefix)}
        if vals:
            _apply(cfg, section, vals, "environment")
    for dotted, v in (overrides or {}).items():
        if v is None:
            continue
        section, _, name = dotted.partition(".")
        _apply(cfg, section, {name: v}, "command line")
    return cfg.validate()
