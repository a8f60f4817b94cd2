"""The OTLP exporter against real in-process receivers (gRPC and HTTP/protobuf).

The receivers are opentelemetry-proto's own service definitions on 127.0.0.1, so
what is asserted is what a collector would get: span and trace ids, parent links,
kinds, semantic-convention attributes, resources grouped per process, and a
collector outage that costs counted drops but never a blocked tracing thread.
"""

from __future__ import annotations

import random
import statistics
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus
from sits_trace.agent.config import ConfigError, ExportConfig
from sits_trace.agent.model import AgentStats
from sits_trace.exporters._queue import RetryPolicy
from sits_trace.exporters._settings import OtlpSettings, otlp_settings
from sits_trace.exporters.otlp import OtlpExporter

from tests.support.otlp import GrpcReceiver, HttpReceiver
from tests.support.otlp import sample_span as make_span

CONTAINER = "3f4c9d2b8a1e7f6c5d4b3a29180f7e6d5c4b3a2918f0e1d2c3b4a59687f6e5d4"


@pytest.fixture
def proc_root(tmp_path: Path) -> str:
    """A fake /proc: pid 4242 in a containerd pod, pid 777 on the host."""
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b.slice/"
        f"cri-containerd-{CONTAINER}.scope\n")
    (tmp_path / "777").mkdir()
    (tmp_path / "777" / "cgroup").write_text("0::/user.slice/user-0.slice/session-3.scope\n")
    return str(tmp_path)


def settings(endpoint: str, protocol: str = "grpc", **kw: object) -> OtlpSettings:
    cfg = ExportConfig(otlp_endpoint=endpoint, otlp_protocol=protocol, batch_delay_s=0.05,
                       otlp_metrics=False, otlp_timeout_s=2.0)
    for k, v in kw.items():
        setattr(cfg, k, v)
    s = otlp_settings(cfg, {})
    assert s is not None
    return s


RECEIVERS = {"grpc": GrpcReceiver, "http/protobuf": HttpReceiver}


@pytest.fixture(params=sorted(RECEIVERS))
def receiver(request: pytest.FixtureRequest) -> Iterator[Any]:
    r = RECEIVERS[request.param]().start()
    r.protocol = request.param
    yield r
    r.stop()


def test_spans_arrive_with_ids_parents_kinds_attributes_and_resources(
        receiver: Any, proc_root: str) -> None:
    exp = OtlpExporter(settings(receiver.endpoint, receiver.protocol),
                       proc_root=proc_root, hostname="gpu-node-7")
    server = make_span(0)
    client = make_span(1, pid=777, exe="python3", kind="CLIENT", trace=server.trace_id,
                       parent=server.span_id, status=503, path="/generate")
    exp.export([server, client])
    assert exp.force_flush(5)
    assert receiver.wait_spans(2)
    exp.shutdown()

    by_id = {r.span.span_id.hex(): r for r in receiver.spans}
    assert set(by_id) == {server.span_id, client.span_id}
    s, c = by_id[server.span_id], by_id[client.span_id]
    assert s.span.trace_id.hex() == c.span.trace_id.hex() == server.trace_id
    assert s.span.parent_span_id == b"" and c.span.parent_span_id.hex() == server.span_id
    assert s.span.kind == PbSpan.SPAN_KIND_SERVER and c.span.kind == PbSpan.SPAN_KIND_CLIENT
    assert s.span.name == "POST /v1/completions"
    assert (s.span.start_time_unix_nano, s.span.end_time_unix_nano) == \
        (server.start_time_unix_nano, server.end_time_unix_nano)
    assert c.span.status.code == PbStatus.STATUS_CODE_ERROR
    assert s.span.status.code == PbStatus.STATUS_CODE_UNSET
    assert s.attributes["http.request.method"] == "POST"
    assert s.attributes["url.path"] == "/v1/completions"
    assert s.attributes["http.response.status_code"] == 200
    assert s.attributes["server.port"] == 8000
    assert s.attributes["http.request.header.x-request-id"] == "req-0"
    assert s.attributes["sits.ttfb_ms"] == 12.5
    assert "process.pid" not in s.attributes  # it is on the resource
    assert s.resource == {"service.name": "uvicorn", "host.name": "gpu-node-7",
                          "process.pid": 4242, "process.executable.name": "uvicorn",
                          "container.id": CONTAINER}
    assert c.resource == {"service.name": "python3", "host.name": "gpu-node-7",
                          "process.pid": 777, "process.executable.name": "python3"}
    assert s.scope == "sits-trace"
    assert exp.stats().exported == 2


def test_one_batch_groups_spans_by_resource(receiver: Any, proc_root: str) -> None:
    exp = OtlpExporter(settings(receiver.endpoint, receiver.protocol,
                                batch_delay_s=5.0, batch_size=30),
                       proc_root=proc_root, hostname="h")
    spans = [make_span(i, pid=4242 if i % 3 else 777, exe="uvicorn" if i % 3 else "python3")
             for i in range(30)]
    exp.export(spans)  # a full batch: sent at once, as one request
    assert receiver.wait_spans(30)
    exp.shutdown()
    assert len(receiver.requests) == 1
    groups = {rs.resource.attributes[0].value.string_value: len(rs.scope_spans[0].spans)
              for rs in receiver.requests[0].resource_spans}
    assert len(receiver.requests[0].resource_spans) == 2
    assert sorted(groups.values()) == [10, 20]


def test_standard_otel_environment_configures_the_exporter(proc_root: str) -> None:
    r = HttpReceiver().start()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": r.endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=team%20a,authorization=Bearer t0k",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "2500", "OTEL_SERVICE_NAME": "llm-gateway",
               "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.node.name=n7"}
        s = otlp_settings(ExportConfig(batch_delay_s=0.05, otlp_metrics=False), env)
        assert s is not None
        assert s.traces_endpoint == r.endpoint + "/v1/traces" and s.timeout_s == 2.5
        exp = OtlpExporter(s, proc_root=proc_root, hostname="h")
        exp.export([make_span(0)])
        assert r.wait_spans(1)
        exp.shutdown()
        assert r.headers[0]["x-tenant"] == "team a"
        assert r.headers[0]["authorization"] == "Bearer t0k"
        res = r.spans[0].resource
        assert res["service.name"] == "llm-gateway"
        assert res["deployment.environment"] == "prod" and res["k8s.node.name"] == "n7"
        assert res["container.id"] == CONTAINER
    finally:
        r.stop()


def test_config_file_wins_over_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "from-env"}
    s = otlp_settings(ExportConfig(otlp_endpoint="http://other:4318/", service_name="cfg",
                                   otlp_protocol="http/protobuf"), env)
    assert s is not None
    assert s.protocol == "http/protobuf" and s.service_name == "cfg"
    assert s.traces_endpoint == "http://other:4318/v1/traces"
    assert s.metrics_endpoint == "http://other:4318/v1/metrics"
    g = otlp_settings(ExportConfig(), env)
    assert g is not None and g.traces_endpoint == "http://collector:4317"
    sig = otlp_settings(ExportConfig(), {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert sig is not None and sig.traces_endpoint == "http://c:4318/custom/traces"
    assert otlp_settings(ExportConfig(), {}) is None  # no collector anywhere: no OTLP
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        otlp_settings(ExportConfig(), {**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ConfigError, match="export.queue_size"):
        otlp_settings(ExportConfig(queue_size=0), env)


def test_metrics_go_over_otlp_too(proc_root: str) -> None:
    r = GrpcReceiver().start()
    try:
        s = settings(r.endpoint, otlp_metrics=True, otlp_metrics_interval_s=60.0)
        exp = OtlpExporter(s, proc_root=proc_root, hostname="h")
        exp.attach_agent(lambda: AgentStats(kernel_seen={"data": 10}, kernel_lost={"data": 1},
                                            tracer={"conns_active": 3}))
        exp.export([make_span(i) for i in range(5)] + [make_span(9, kind="CLIENT")])
        assert exp.force_flush(10)
        assert r.wait_for(lambda: {"http.server.request.duration", "sits.bpf.events",
                                   "sits.bpf.events.lost"} <= r.metric_names(), 10)
        exp.shutdown()
        names = r.metric_names()
        assert {"http.client.request.duration", "sits.connections.active",
                "sits.spans.exported", "sits.export.queue"} <= names
        hist = next(m for req in r.metrics for rm in req.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == "http.server.request.duration")
        point = hist.histogram.data_points[0]
        assert point.count == 5 and abs(point.sum - 1.25) < 1e-9
        assert point.min == point.max == 0.25 and sum(point.bucket_counts) == 5
        assert list(point.explicit_bounds)[:2] == [0.005, 0.01]
        assert point.bucket_counts[list(point.explicit_bounds).index(0.25)] == 5  # le 0.25
        assert hist.histogram.aggregation_temporality == 2  # cumulative
        assert point.start_time_unix_nano < point.time_unix_nano
        attrs = {kv.key: kv.value for kv in point.attributes}
        assert attrs["http.route"].string_value == "/v1/completions"
        assert attrs["service.name"].string_value == "uvicorn"
    finally:
        r.stop()


def _red_points(r: GrpcReceiver, req: int) -> list[Any]:
    return [p for rm in r.metrics[req].resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics if m.name == "http.server.request.duration"
            for p in m.histogram.data_points]


def test_red_histograms_over_otlp_are_re_weighted_and_follow_a_delta_preference(
        proc_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RED histograms come from our aggregator (exporters/_red.py), not from SDK
    instruments: a span shed 1 in 4 counts 4, as on /metrics; with the exporter preferring
    delta temporality each export carries what is new since the last one, and an export
    with nothing new carries no point for it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    r = GrpcReceiver().start()
    try:
        s = settings(r.endpoint, otlp_metrics=True, otlp_metrics_interval_s=60.0)
        exp = OtlpExporter(s, proc_root=proc_root, hostname="h")
        exp.attach_agent(lambda: AgentStats())
        exp.export([make_span(0, **{"sampling.probability": 0.25}), make_span(1)])
        assert exp.force_flush(10)
        exp.export([make_span(2), make_span(3, status=503)])
        assert exp.force_flush(10)
        assert exp.force_flush(10)
        exp.shutdown()
        assert len(r.metrics) >= 3
        (first,) = _red_points(r, 0)
        assert first.count == 5 and abs(first.sum - 5 * 0.25) < 1e-9 and first.min == 0.25
        second = {next(kv.value.string_value for kv in p.attributes
                       if kv.key == "http.response.status_code"): p for p in _red_points(r, 1)}
        assert {k: p.count for k, p in second.items()} == {"200": 1, "503": 1}
        assert not second["200"].HasField("min")  # an interval's min is not known
        assert second["200"].start_time_unix_nano == first.time_unix_nano
        assert _red_points(r, 2) == []  # nothing new
        hist = next(m for rm in r.metrics[1].resource_metrics for sm in rm.scope_metrics
                    for m in sm.metrics if m.name == "http.server.request.duration")
        assert hist.histogram.aggregation_temporality == 1  # delta
    finally:
        r.stop()


@pytest.mark.parametrize("protocol", sorted(RECEIVERS))
def test_nothing_listening_costs_counted_drops_and_a_bounded_shutdown(protocol: str) -> None:
    port = _free_port()
    s = settings(f"http://127.0.0.1:{port}", protocol, otlp_timeout_s=0.5)
    exp = OtlpExporter(s, hostname="h",
                       retry=RetryPolicy(initial_s=0.05, max_s=0.1, deadline_s=0.3))
    exp.export([make_span(i) for i in range(10)])
    assert not exp.force_flush(0.2) or exp.stats().dropped.get("export_failed") == 10
    t0 = time.monotonic()
    exp.shutdown(1.0)
    assert time.monotonic() - t0 < 4
    st = exp.stats()
    assert st.exported == 0 and sum(st.dropped.values()) == 10
    exp.export([make_span(99)])  # after shutdown: counted, not raised
    assert exp.stats().dropped["shutdown"] >= 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("protocol", sorted(RECEIVERS))
def test_collector_outage_under_load(protocol: str, proc_root: str) -> None:
    """20k spans offered while the collector is down: export() stays fast, memory stays
    bounded, drops are counted, and export resumes when the collector is back."""
    r = RECEIVERS[protocol]().start()
    port = r.port
    cap, batch = 2000, 256
    s = settings(r.endpoint, protocol, queue_size=cap, batch_size=batch, otlp_timeout_s=0.5)
    exp = OtlpExporter(s, proc_root=proc_root, hostname="h",
                       retry=RetryPolicy(initial_s=0.05, max_s=0.3, deadline_s=1.0))
    try:
        exp.export([make_span(i) for i in range(100)])
        assert r.wait_spans(100)
        r.stop()

        per_span = _bytes_per_span()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        lat, offered = [], 100
        rng = random.Random(7)
        t_end = time.monotonic() + 2.5
        while offered < 20_100 and time.monotonic() < t_end + 5:
            for _ in range(500):
                sp = make_span(offered, path=f"/v1/models/{rng.randrange(1000)}")
                t0 = time.perf_counter()
                exp.export([sp])
                lat.append(time.perf_counter() - t0)
                offered += 1
            assert exp.stats().queue_depth <= cap
            time.sleep(0.06)  # 20k spans over ~2.5 s: ~8k spans/s
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        st = exp.stats()
        assert st.dropped.get("queue_full", 0) > 0
        assert st.export_errors > 0
        bound = per_span * (cap + batch) * 2 + 8 * 2**20
        assert peak < bound, f"python heap grew {peak} bytes (bound {bound})"
        lat.sort()
        p99, worst = lat[int(len(lat) * 0.99)], lat[-1]
        print(f"{protocol}: offered={offered} p50={statistics.median(lat)*1e6:.1f}us "
              f"p99={p99*1e6:.1f}us max={worst*1e3:.2f}ms peak_heap={peak/2**20:.1f}MiB "
              f"(~{per_span}B/span) dropped={st.dropped}")
        # worst: under otlp_timeout_s (0.5 s), with room for the scheduler of a loaded
        # 2-core machine (a 188-ms pause seen once in CI in the test below)
        assert p99 < 0.002 and worst < 0.4

        r2 = RECEIVERS[protocol](port).start()
        try:
            assert r2.wait_spans(1, 20), "the queued backlog never reached the collector"
            assert exp.force_flush(10)
            exp.export([make_span(50_000 + i, marker="after") for i in range(50)])
            assert r2.wait_for(lambda: sum(1 for x in r2.spans
                                           if x.attributes.get("marker") == "after") == 50, 20)
            assert exp.force_flush(10)
            st = exp.stats()
            assert st.exported + sum(st.dropped.values()) + st.queue_depth == offered + 50
            # a batch whose request timed out (otlp_timeout_s) counts as export_failed but
            # may still have reached the collector (at-least-once): seen once on a loaded
            # machine, 2306 counted exported against more received
            failed = st.dropped.get("export_failed", 0)
            assert st.exported <= 100 + len(r2.spans) <= st.exported + failed
        finally:
            r2.stop()
    finally:
        t0 = time.monotonic()
        exp.shutdown(2)
        assert time.monotonic() - t0 < 5
        r.stop()


def _bytes_per_span() -> int:
    tracemalloc.start()
    a = tracemalloc.get_traced_memory()[0]
    keep = [make_span(i) for i in range(1000)]
    b = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del keep
    return max((b - a) // 1000, 1)


def test_stalled_collector_never_stalls_the_caller(proc_root: str) -> None:
    r = GrpcReceiver().start()
    r.gate.clear()  # the collector takes requests and answers none until released
    s = settings(r.endpoint, queue_size=1000, batch_size=100)
    exp = OtlpExporter(s, proc_root=proc_root, hostname="h")
    try:
        lat = []
        for i in range(5000):
            t0 = time.perf_counter()
            exp.export([make_span(i)])
            lat.append(time.perf_counter() - t0)
            assert lat[-1] < 1.0, f"export {i} waited {lat[-1]:.2f} s on the stalled collector"
        # the caller finished while the collector had answered nothing: it waited on no request
        assert not r.spans
        r.gate.set()
        lat.sort()
        # a caller that waited on the collector would wait out otlp_timeout_s (2 s): the 1-s
        # bound on each call leaves room for the scheduler of a loaded 2-core machine (188 ms
        # seen once in CI); the p99 is where the queue's cost shows
        assert lat[int(len(lat) * 0.99)] < 0.002, (lat[len(lat) // 2], lat[-1])
        assert exp.stats().dropped["queue_full"] > 0
        assert exp.force_flush(15)
        st = exp.stats()
        # as above: a timed-out request may have arrived after all
        assert 0 < st.exported <= len(r.spans) <= st.exported + st.dropped.get("export_failed", 0)
        assert st.exported + st.dropped["queue_full"] == 5000
    finally:
        r.gate.set()
        exp.shutdown()
        r.stop()


def test_our_encoder_writes_what_the_sdk_encoder_wrote() -> None:
    """exporters/_otlp_traces.encode against the SDK path it replaced (a ReadableSpan per
    span, the SDK's encode_spans; kept in bench/span_cost.py to compare): the same spans,
    ids, flags, kinds, times, status and attributes, field for field, for server, client,
    error and parentless spans."""
    import importlib.util

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from sits_trace.exporters._otlp_traces import encode

    spec = importlib.util.spec_from_file_location(
        "span_cost", Path(__file__).resolve().parents[2] / "bench" / "span_cost.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sdk = bench.otlp_sdk_encoder()
    assert sdk is not None
    spans = [make_span(0), make_span(1, kind="CLIENT", parent="00000000000000ab"),
             make_span(2, status=503), make_span(3, flag=True, ratio=0.25, n=-7)]
    ours = ExportTraceServiceRequest.FromString(encode(spans, lambda s: {"service.name": "nginx"}))
    theirs = sdk.request(spans)
    a = [s for rs in ours.resource_spans for ss in rs.scope_spans for s in ss.spans]
    b = [s for rs in theirs.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(a) == len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert x == y, (x, y)
    assert ours.resource_spans[0].scope_spans[0].scope.name == "sits-trace"


def _messages_encode(batch: list[Any], resource_of: Any) -> bytes:
    """The reference: the same request built from opentelemetry-proto's messages (what the
    exporter did before it wrote the bytes itself), serialized by protobuf."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    def value(v: Any) -> AnyValue:
        if isinstance(v, bool):
            return AnyValue(bool_value=v)
        if isinstance(v, int):
            return AnyValue(int_value=v)
        if isinstance(v, float):
            return AnyValue(double_value=v)
        return AnyValue(string_value=str(v))

    def ident(text: str | None, digits: int) -> bytes:
        try:
            return bytes.fromhex(text) if text and len(text) == digits else b""
        except ValueError:
            return b""

    kinds = {"SERVER": PbSpan.SPAN_KIND_SERVER, "CLIENT": PbSpan.SPAN_KIND_CLIENT}
    groups: dict[Any, list[Any]] = {}
    first: dict[Any, Any] = {}  # a resource's attributes in the order its first span gave them
    for s in batch:
        attrs = resource_of(s)
        key = tuple(sorted(attrs.items()))
        groups.setdefault(key, []).append(s)
        first.setdefault(key, attrs)
    req = ExportTraceServiceRequest()
    for key, spans in groups.items():
        rs = req.resource_spans.add()
        rs.resource.CopyFrom(Resource(attributes=[KeyValue(key=k, value=value(v))
                                                  for k, v in first[key].items()]))
        ss = rs.scope_spans.add()
        ss.scope.CopyFrom(InstrumentationScope(name="sits-trace", version="0.1.0"))
        for s in spans:
            parent = ident(s.parent_span_id, 16)
            ss.spans.add(
                trace_id=ident(s.trace_id, 32), span_id=ident(s.span_id, 16),
                parent_span_id=parent, name=s.name,
                kind=kinds.get(s.kind, PbSpan.SPAN_KIND_INTERNAL),
                start_time_unix_nano=s.start_time_unix_nano,
                end_time_unix_nano=s.end_time_unix_nano,
                attributes=[KeyValue(key=k, value=value(v)) for k, v in s.attributes.items()
                            if not k.startswith("process.")],
                status=PbStatus(code=PbStatus.STATUS_CODE_ERROR) if s.status_code == "ERROR"
                else PbStatus(),
                flags=0x100 | (0x200 if parent else 0))
    return req.SerializeToString()


def test_the_bytes_are_what_protobuf_serializes_for_the_same_messages() -> None:
    """Byte for byte against opentelemetry-proto's messages, over spans that reach every
    branch: zero, negative, huge and boolean ints, floats, empty, long and non-ASCII strings,
    an empty key, bad and absent ids, an unknown kind, no attributes, spans of several
    resources (process.* attributes move there), long spans (lengths past one varint byte)."""
    from sits_trace.exporters._otlp_traces import KeyValueCache, encode

    rng = random.Random(5)
    spans = [make_span(0), make_span(1, kind="CLIENT", parent="00000000000000ab"),
             make_span(2, status=503, pid=7, exe="nginx"),
             make_span(3, flag=True, no=False, zero=0, neg=-1, big=(1 << 63) - 1,
                       low=-(1 << 63), ratio=0.0, nan=float("inf"), empty="",
                       text="żółw ✓ \x00", long="x" * 5000),
             make_span(4, kind="INTERNAL-ish", trace="zz" * 16, parent="nothex"),
             make_span(5, **{"": "empty key"})]
    bare = make_span(6)
    bare.attributes = {}
    bare.name, bare.parent_span_id, bare.span_id = "", None, ""
    spans.append(bare)
    for i in range(200):
        extra: dict[str, Any] = {f"k{j}": rng.choice([rng.randint(-10**12, 10**12),
                                                      rng.random(), "v" * rng.randint(0, 300),
                                                      rng.random() < 0.5])
                                 for j in range(rng.randint(0, 12))}
        spans.append(make_span(10 + i, pid=4242 + i % 3, **extra))
    res = lambda s: {"service.name": "svc", "process.pid": s.attributes.get("process.pid", 0)}
    cache = KeyValueCache(limit=64)
    assert encode(spans, res, cache) == _messages_encode(spans, res)
    assert encode(spans, res, cache) == _messages_encode(spans, res)  # from the cache
    # what protobuf's serializer refuses (and with it the batch) is written, not raised: an
    # int past int64 as its digits, a lone surrogate as "?"
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    odd = ExportTraceServiceRequest.FromString(
        encode([make_span(0, huge=1 << 63, bad="a\udcffb")], res))
    got = {kv.key: kv.value for kv in odd.resource_spans[0].scope_spans[0].spans[0].attributes}
    assert got["huge"].string_value == str(1 << 63) and got["bad"].string_value == "a?b"


def test_gzip_and_bad_tls_files_from_the_standard_environment(proc_root: str) -> None:
    r = HttpReceiver().start()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": r.endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}
        s = otlp_settings(ExportConfig(batch_delay_s=0.05, otlp_metrics=False), env)
        assert s is not None and s.gzip
        exp = OtlpExporter(s, proc_root=proc_root, hostname="h")
        exp.export([make_span(i) for i in range(3)])
        assert r.wait_spans(3)
        exp.shutdown()
        assert r.headers[0]["content-encoding"] == "gzip"
    finally:
        r.stop()
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_COMPRESSION"):
        otlp_settings(ExportConfig(), {**env, "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"})
    with pytest.raises(ConfigError, match="/nonexistent/ca.pem is not a readable file"):
        otlp_settings(ExportConfig(), {**env, "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"})


def test_the_encoders_cache_of_attribute_values_changes_nothing_it_encodes() -> None:
    """exporters/_otlp_traces.KeyValueCache: spans encoded through a cache that has seen their
    values are the bytes encoded without it; equal values of different types (True, 1, 1.0)
    stay their own type; the cache never holds more than its limit, nor floats or long
    strings."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from sits_trace.exporters._otlp_traces import KeyValueCache, encode

    res = lambda s: {"service.name": "nginx"}
    spans = [make_span(i, flag=v) for i, v in enumerate((True, 1, 1.0, False, 0, 1, True))]
    spans += [make_span(7, path="/" + "x" * 300), make_span(8, ratio=0.5), make_span(9)]
    cache = KeyValueCache(limit=64, max_len=256)
    once = encode(spans, res, cache)
    again = encode(spans, res, cache)
    assert again == once == encode(spans, res, KeyValueCache(limit=0))
    msg = ExportTraceServiceRequest.FromString(again)
    flags = [next(kv.value for kv in s.attributes if kv.key == "flag")
             for s in msg.resource_spans[0].scope_spans[0].spans[:7]]
    assert [f.WhichOneof("value") for f in flags] == [
        "bool_value", "int_value", "double_value", "bool_value", "int_value", "int_value",
        "bool_value"]
    held = cache.values()
    assert held and not any(isinstance(v, float) or (isinstance(v, str) and len(v) > 256)
                            for _k, v in held)
    assert len(held) == len(cache)
    for i in range(1000):
        encode([make_span(i)], res, cache)
        assert len(cache) <= 64 and len(cache.values()) == len(cache)


def test_the_encoders_cache_holds_skipped_attributes_as_nothing_for_that_skip_only() -> None:
    """KeyValueCache.add holds a skipped attribute (process.*, which go to the resource) as
    b"": nothing of it reaches the span, from the cache or not, int, str or float; and a
    cache asked with another set of keys to skip drops what it held, so an attribute held
    as b"" is encoded once it is no longer skipped."""
    from sits_trace.exporters._otlp_traces import KeyValueCache, key_value

    attrs = {"process.pid": 7, "process.executable.name": "nginx", "process.cpu": 0.5,
             "http.response.status_code": 200}
    cache = KeyValueCache()
    skip = frozenset({"process.pid", "process.executable.name", "process.cpu"})
    for _ in range(2):  # the first from scratch, the second from the cache
        out: list[bytes] = []
        cache.add(out, attrs, skip)
        assert b"".join(out) == key_value("http.response.status_code", 200, b"\x4a")
    out = []
    cache.add(out, attrs, frozenset())
    assert b"".join(out) == b"".join(key_value(k, v, b"\x4a") for k, v in attrs.items())
