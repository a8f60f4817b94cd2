"""JSON lines, the bounded queue, resources from a fake /proc, and build_exporters()."""

from __future__ import annotations

import bisect
import io
import itertools
import json
import random
import threading
import time
from pathlib import Path

import pytest
from sits_trace.agent.config import Config, ConfigError
from sits_trace.agent.model import Span
from sits_trace.exporters import ExporterSet, build_exporters
from sits_trace.exporters._queue import QueuedExporter, RetryPolicy
from sits_trace.exporters._red import LabelLimiter, RedAggregator, path_template, span_labels
from sits_trace.exporters._resource import ResourceResolver, container_id_from_cgroup
from sits_trace.exporters.jsonl import JsonlExporter

from tests.support.otlp import sample_span as make_span

DOCKER_V1 = ("12:pids:/docker/" + "a" * 64 + "\n11:memory:/docker/" + "a" * 64 + "\n")
CGROUPS = {
    "docker v2": ("0::/system.slice/docker-" + "b" * 64 + ".scope\n", "b" * 64),
    "docker v1": (DOCKER_V1, "a" * 64),
    "containerd k8s": ("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod9.slice"
                       "/cri-containerd-" + "c" * 64 + ".scope\n", "c" * 64),
    "kubepods v1": ("4:cpu,cpuacct:/kubepods/burstable/pod1-2/" + "d" * 64 + "\n", "d" * 64),
    "crio": ("0::/kubepods.slice/kubepods-pod7.slice/crio-" + "e" * 64 + ".scope\n", "e" * 64),
    "host": ("0::/user.slice/user-1000.slice/session-2.scope\n", None),
    "systemd unit": ("0::/system.slice/nginx.service\n", None),
}


@pytest.mark.parametrize("name", sorted(CGROUPS))
def test_container_id_from_cgroup(name: str) -> None:
    text, want = CGROUPS[name]
    assert container_id_from_cgroup(text) == want


def test_resource_resolver_reads_proc_once_per_process(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    cg = tmp_path / "4242" / "cgroup"
    cg.write_text(CGROUPS["docker v2"][0])
    rr = ResourceResolver(proc_root=str(tmp_path), hostname="n1", extra={"k8s.node.name": "n1"})
    a = rr.attributes(make_span(0))
    assert a == {"service.name": "uvicorn", "host.name": "n1", "process.pid": 4242,
                 "process.executable.name": "uvicorn", "container.id": "b" * 64,
                 "k8s.node.name": "n1"}
    cg.unlink()
    assert rr.attributes(make_span(1))["container.id"] == "b" * 64  # cached
    assert "container.id" not in rr.attributes(make_span(2, pid=31337))  # no /proc entry
    # the same pid after an exec: another executable, another resource (not the last one's)
    execd = make_span(3)
    execd.attributes["process.executable.name"] = "python3"
    assert rr.attributes(execd)["service.name"] == "python3"
    assert rr.attributes(make_span(4))["service.name"] == "uvicorn"
    assert ResourceResolver(service_name="svc", hostname="x").attributes(
        make_span(0))["service.name"] == "svc"


def test_jsonl_writes_span_to_json_lines() -> None:
    out = io.StringIO()
    exp = JsonlExporter(stream=out, batch_delay_s=0.01)
    spans = [make_span(i) for i in range(3)]
    exp.export(spans)
    assert exp.force_flush(5)
    exp.shutdown()
    lines = out.getvalue().splitlines()
    assert [json.loads(x) for x in lines] == [s.to_json() for s in spans]
    assert exp.stats().exported == 3


def test_jsonl_to_a_file(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    exp = JsonlExporter(str(path))
    exp.export([make_span(7)])
    exp.shutdown()
    assert json.loads(path.read_text())["span_id"] == make_span(7).span_id


class _StuckStream(io.StringIO):
    """stdout piped to a reader that never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, s: str) -> int:
        self.release.wait(10)
        return super().write(s)


def test_jsonl_blocked_output_drops_instead_of_blocking() -> None:
    out = _StuckStream()
    exp = JsonlExporter(stream=out, capacity=100, batch_size=10, batch_delay_s=0.01)
    t0 = time.monotonic()
    for i in range(1000):
        exp.export([make_span(i)])
    assert time.monotonic() - t0 < 0.5
    st = exp.stats()
    assert st.queue_depth <= 100 and st.dropped["queue_full"] >= 880
    out.release.set()
    exp.shutdown()
    st = exp.stats()
    assert st.exported + sum(st.dropped.values()) == 1000


def test_queue_retries_with_jittered_backoff_until_the_deadline() -> None:
    calls: list[float] = []
    ok_after = 3

    def send(batch: list[Span]) -> bool:
        calls.append(time.monotonic())
        if len(calls) <= ok_after:
            raise ConnectionError("collector down")
        return True

    q = QueuedExporter("t", send, batch_size=5, batch_delay_s=0.01,
                       retry=RetryPolicy(initial_s=0.02, max_s=0.05, deadline_s=2.0),
                       rng=random.Random(1))
    q.export([make_span(i) for i in range(5)])
    assert q.force_flush(5)
    q.shutdown()
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert len(calls) == 4 and q.stats().exported == 5 and q.stats().export_errors == 3
    assert 0.015 <= gaps[0] < 0.2 and gaps[1] > gaps[0] * 1.2  # backoff grows


def test_queue_gives_a_batch_up_at_its_deadline() -> None:
    q = QueuedExporter("t", lambda b: False, batch_size=4, batch_delay_s=0.01,
                       retry=RetryPolicy(initial_s=0.01, max_s=0.02, deadline_s=0.1))
    q.export([make_span(i) for i in range(4)])
    assert q.force_flush(3)
    q.shutdown()
    assert q.stats().dropped == {"export_failed": 4} and q.stats().exported == 0


def test_retry_delays_are_jittered_and_capped() -> None:
    d = RetryPolicy(initial_s=1.0, max_s=4.0, jitter=0.2).delays(random.Random(3))
    got = [next(d) for _ in range(6)]
    assert 0.8 <= got[0] <= 1.2 and 1.6 <= got[1] <= 2.4 and all(x <= 4.8 for x in got)
    assert len(set(got)) == 6


def test_path_templates_keep_cardinality_low() -> None:
    assert path_template("/v1/models/123/versions/9?x=1") == "/v1/models/{id}/versions/{id}"
    assert path_template("/u/3fa85f64-5717-4562-b3fc-2c963f66afa6") == "/u/{id}"
    assert path_template("/blobs/9f86d081884c7d659a2feaa0c55ad015") == "/blobs/{id}"
    assert path_template("/v1/chat/completions") == "/v1/chat/completions"
    assert path_template("/healthz") == "/healthz"
    assert path_template("/a/b/c/d/e/f/g/h/i/j/k") == "/a/b/c/d/e/f/g/h/{rest}"


def test_label_limiter_folds_new_routes_into_other() -> None:
    lim = LabelLimiter(2)
    a = span_labels(make_span(0, path="/a"), "svc")
    b = span_labels(make_span(0, path="/b"), "svc")
    c = span_labels(make_span(0, path="/c"), "svc")
    assert lim.admit(a) == a and lim.admit(b) == b
    assert lim.admit(c) == ("svc", "POST", "_other", "200") and lim.overflowed == 1
    assert lim.admit(a) == a
    routed, brew = make_span(0), make_span(1)
    routed.attributes["http.route"] = "/items/{id}"
    brew.attributes["http.request.method"] = "BREW"
    assert span_labels(routed, "s")[2] == "/items/{id}"
    assert span_labels(brew, "s")[1] == "_OTHER"


def test_red_aggregator_matches_labels_worked_out_span_by_span_past_its_limits() -> None:
    """exporters/_red.RedAggregator keeps, per span's raw fields, the histogram they land in
    and whether they were folded into _other: the histograms and the overflow count are what
    span_labels and a LabelLimiter give span by span, without that cache, for spans of both
    kinds, routes past the label-set limit (folded, and each folded span counted), a raw-field
    cache that empties itself many times over, and sampled spans (weights)."""
    from sits_trace.exporters._red import DURATION_BUCKETS_S, METRIC_OF_KIND

    rng = random.Random(11)
    spans = []
    for i in range(3000):
        sp = make_span(i, kind=rng.choice(["SERVER", "CLIENT", "INTERNAL"]),
                       path=f"/r{rng.randint(0, 9)}/x{rng.randint(0, 40)}",
                       status=rng.choice([200, 404, 503]))
        sp.end_time_unix_nano = sp.start_time_unix_nano + rng.randint(0, 3 * 10**9)
        if rng.random() < 0.1:
            sp.attributes["sampling.probability"] = 0.25
        spans.append(sp)
    red = RedAggregator(max_label_sets=7)  # caches 28 raw field sets: emptied again and again
    red.observe_many(spans, lambda sp: "svc" if sp.span_id[-1] in "02468ace" else "other")
    for metric in METRIC_OF_KIND.values():
        limiter = LabelLimiter(7)
        want: dict[tuple[str, str, str, str], list[float]] = {}
        for sp in spans:
            if METRIC_OF_KIND.get(sp.kind) != metric:
                continue
            svc = "svc" if sp.span_id[-1] in "02468ace" else "other"
            labels = limiter.admit(span_labels(sp, svc))
            w = 4 if "sampling.probability" in sp.attributes else 1
            want.setdefault(labels, []).extend(
                [(sp.end_time_unix_nano - sp.start_time_unix_nano) / 1e9] * w)
        got = red.snapshot(metric)
        assert set(got) == set(want)
        assert sum(1 for k in want if k[2] != "_other") == 7 < len(want)  # and folded ones
        for labels, seconds in want.items():
            h = got[labels]
            assert h.count == len(seconds) and h.min == min(seconds) and h.max == max(seconds)
            assert h.sum == pytest.approx(sum(seconds))
            buckets = [0] * (len(DURATION_BUCKETS_S) + 1)
            for x in seconds:
                buckets[bisect.bisect_left(DURATION_BUCKETS_S, x)] += 1
            assert h.buckets == buckets
        assert red.overflowed(metric) == limiter.overflowed > 100


def test_red_aggregator_takes_a_batch_with_labels_worked_out_once_and_odd_spans_skipped() -> None:
    """exporters/_red.RedAggregator.observe_many: the same histograms as span by span; a
    span's labels are looked up by its raw fields (bounded), so ids in paths still become
    {id} and fold into _other past the limit; a span that cannot be observed is counted and
    the rest of its batch still is."""
    spans = [make_span(i, path=f"/users/{i}/orders", status=200 + (i % 2) * 300)
             for i in range(200)]
    one, many = RedAggregator(max_label_sets=3), RedAggregator(max_label_sets=3)
    for sp in spans:
        one.observe(sp, "svc")
    many.observe_many(spans, lambda _s: "svc")
    metric = "http.server.request.duration"
    assert many.snapshot(metric) == one.snapshot(metric)
    assert set(many.snapshot(metric)) == {("svc", "POST", "/users/{id}/orders", "200"),
                                          ("svc", "POST", "/users/{id}/orders", "500")}
    assert len(many._slots) <= 4 * 3
    odd = RedAggregator()
    bad = make_span(1)

    def service_of(sp: Span) -> str:
        if sp is bad:
            raise ValueError("odd")
        return "svc"

    odd.observe_many([make_span(0), bad, make_span(2)], service_of)
    (h,) = odd.snapshot(metric).values()
    assert h.count == 2 and odd.skipped == 1 and h.min == h.max == 0.25


def test_build_exporters_defaults_to_jsonl_on_stdout() -> None:
    es = build_exporters(Config(), environ={})
    assert [e.name for e in es.exporters] == ["jsonl"]
    es.shutdown()


def test_build_exporters_with_a_collector_drops_stdout_but_keeps_a_file(tmp_path: Path) -> None:
    cfg = Config()
    es = build_exporters(cfg, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert [e.name for e in es.exporters] == ["otlp-grpc"]
    es.shutdown(0.5)
    cfg.export.jsonl_path = str(tmp_path / "s.jsonl")
    cfg.export.otlp_endpoint = "http://127.0.0.1:1"
    cfg.export.otlp_protocol = "http/protobuf"
    cfg.export.prometheus_port = _free_port()
    es = build_exporters(cfg, environ={})
    assert [e.name for e in es.exporters] == ["otlp-http", "prometheus", "jsonl"]
    es.shutdown(0.5)


def test_build_exporters_names_the_bad_key() -> None:
    cfg = Config()
    cfg.export.batch_size = 0
    with pytest.raises(ConfigError, match="export.batch_size"):
        build_exporters(cfg, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"})


class _Broken:
    name = "broken"

    def export(self, spans: object) -> None:
        raise RuntimeError("bug")

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        raise RuntimeError("bug")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        raise RuntimeError("bug")

    def stats(self) -> object:
        raise RuntimeError("bug")


def test_exporter_set_never_raises_into_the_pipeline() -> None:
    out = io.StringIO()
    good = JsonlExporter(stream=out, batch_delay_s=0.01)
    es = ExporterSet([_Broken(), good])
    es.export_span(make_span(0))
    assert es.errors == 1
    assert es.force_flush(2) is False
    assert [s.exporter for s in es.exporter_stats()] == ["jsonl"]
    es.shutdown()
    assert json.loads(out.getvalue())["span_id"] == make_span(0).span_id


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
