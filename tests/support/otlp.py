"""In-process OTLP receivers (gRPC and HTTP/protobuf) and sample spans, for tests.

Both keep every span and log record they receive, with its resource attributes, and can be
stopped and started again on the same port to play a collector that goes away.
Built from opentelemetry-proto's service definitions, so what they accept is
what a real collector accepts.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord as PbLogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from sits_trace.agent.model import AttrValue, Span

NOW = 1_733_140_000_000_000_000


def any_value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@dataclass(slots=True)
class ReceivedSpan:
    resource: dict[str, Any]
    scope: str
    span: PbSpan

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes(self.span.attributes)


@dataclass(slots=True)
class ReceivedLog:
    resource: dict[str, Any]
    scope: str
    record: PbLogRecord

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes(self.record.attributes)

    @property
    def body(self) -> Any:
        return any_value(self.record.body)


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.spans: list[ReceivedSpan] = []
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.logs: list[ReceivedLog] = []
        self.headers: list[dict[str, str]] = []
        # a stalled collector: clear it and every trace export waits (answered with nothing)
        # until it is set again
        self.gate = threading.Event()
        self.gate.set()

    def add_traces(self, req: trace_service_pb2.ExportTraceServiceRequest,
                   headers: dict[str, str]) -> None:
        self.gate.wait(60)
        got = [ReceivedSpan(attributes(rs.resource.attributes), ss.scope.name, sp)
               for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
        with self.lock:
            self.requests.append(req)
            self.headers.append(headers)
            self.spans.extend(got)
            self.lock.notify_all()

    def add_metrics(self, req: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self.lock:
            self.metrics.append(req)
            self.lock.notify_all()

    def add_logs(self, req: logs_service_pb2.ExportLogsServiceRequest) -> None:
        got = [ReceivedLog(attributes(rl.resource.attributes), sl.scope.name, lr)
               for rl in req.resource_logs for sl in rl.scope_logs for lr in sl.log_records]
        with self.lock:
            self.logs.extend(got)
            self.lock.notify_all()

    def metric_names(self) -> set[str]:
        with self.lock:
            return {m.name for r in self.metrics for rm in r.resource_metrics
                    for sm in rm.scope_metrics for m in sm.metrics}

    def wait_for(self, pred: Any, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 0.1))
            return True

    def wait_spans(self, n: int, timeout_s: float = 10.0) -> bool:
        return self.wait_for(lambda: len(self.spans) >= n, timeout_s)


class GrpcReceiver(_Store):
    """OTLP/gRPC TraceService, MetricsService and LogsService on 127.0.0.1."""

    def __init__(self, port: int = 0) -> None:
        super().__init__()
        self.port = port
        self._server: grpc.Server | None = None

    def start(self) -> GrpcReceiver:
        store = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                store.add_traces(request, dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                store.add_metrics(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                store.add_logs(request)
                return logs_service_pb2.ExportLogsServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Logs(), server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Traces(), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Metrics(), server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self._server = server
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None


class HttpReceiver(_Store):
    """OTLP/HTTP (protobuf) POST /v1/traces, /v1/metrics and /v1/logs on 127.0.0.1."""

    def __init__(self, port: int = 0) -> None:
        super().__init__()
        self.port = port
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> HttpReceiver:
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                enc = self.headers.get("Content-Encoding", "")
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                if self.path == "/v1/traces":
                    req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                    store.add_traces(req, {k.lower(): v for k, v in self.headers.items()})
                    out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    store.add_metrics(metrics_service_pb2.ExportMetricsServiceRequest.FromString(body))
                    out = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                elif self.path == "/v1/logs":
                    store.add_logs(logs_service_pb2.ExportLogsServiceRequest.FromString(body))
                    out = logs_service_pb2.ExportLogsServiceResponse().SerializeToString()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        self._server = server
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def sample_span(i: int, *, pid: int = 4242, exe: str = "uvicorn", kind: str = "SERVER",
              parent: str | None = None, status: int = 200, trace: str | None = None,
              path: str = "/v1/completions", **extra: AttrValue) -> Span:
    """A span shaped like the tracer's (OTel semconv attributes), numbered `i`."""
    start = NOW + i * 1_000_000
    attrs: dict[str, AttrValue] = {
        "http.request.method": "POST", "url.path": path, "url.scheme": "http",
        "http.response.status_code": status, "network.protocol.version": "1.1",
        "server.address": "127.0.0.1", "server.port": 8000, "client.address": "127.0.0.1",
        "client.port": 40000 + i % 20000, "user_agent.original": "curl/7.88.1",
        "http.request.header.x-request-id": f"req-{i}", "sits.ttfb_ms": 12.5,
        "process.pid": pid, "process.executable.name": exe, **extra,
    }
    return Span(trace_id=trace or f"{i + 1:032x}", span_id=f"{(i + 1) * 7:016x}",
                parent_span_id=parent, name=f"POST {path}", kind=kind,
                start_time_unix_nano=start, end_time_unix_nano=start + 250_000_000,
                attributes=attrs,
                status_code="ERROR" if status >= 500 else "UNSET")
