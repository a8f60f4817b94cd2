"""Node signals on /metrics: a feature row (NVML answers recorded on an H200, TCP and run-queue
maps shaped like tcp.c's and sched.c's) through the Prometheus collector, as Prometheus parses
the scrape."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("pandas")
pytest.importorskip("pynvml")

from sits_trace.agent.capture.bpfmaps import DictMaps, u32
from sits_trace.agent.capture.wire import RunqHistKeyC, RunqProcC, TcpTotal, TwKeyC
from sits_trace.agent.model import AgentStats, MetricSample
from sits_trace.agent.signals.node import NodeSignals
from sits_trace.agent.signals.nvml import NvmlSampler
from sits_trace.agent.signals.sched import SchedSignals
from sits_trace.agent.signals.tcp import TcpSignals
from sits_trace.analyzers.features import FeatureFrame
from sits_trace.exporters import ExporterSet
from sits_trace.exporters.node_metrics import counter_samples, metric_samples
from sits_trace.exporters.prometheus import PrometheusExporter

from .test_nvml_replay import META, ReplayClock

SERVER_PID = 4242


def _totals(**kw: int) -> list[int]:
    return [kw.get(t.name.lower(), 0) for t in TcpTotal]


def _tw(port: int, side: int) -> bytes:
    return bytes(TwKeyC(port=port, side=side))


class Node:
    """TcpSignals and SchedSignals over dict maps, on a clock the test moves."""

    def __init__(self, proc_root: str) -> None:
        self.now = [10_000_000_000]
        self.maps = DictMaps(percpu={"tcp_totals": _totals(retransmits=5, resets_out=1)})
        clock = lambda: self.now[0]
        self.signals = NodeSignals(TcpSignals(self.maps, monotonic_ns=clock),
                                   SchedSignals(self.maps, proc_root=proc_root,
                                                monotonic_ns=clock))

    def second(self) -> None:
        """What the kernel counted over the next 2 s: 8 retransmits, 3 RSTs out, 4 client
        TIME_WAITs towards port 8000, the server waiting 0.3 s on the run queue in 60 waits."""
        self.now[0] += 2_000_000_000
        self.maps.percpu["tcp_totals"] = _totals(retransmits=13, resets_out=4,
                                                 time_wait_entries=4)
        self.maps.update("tcp_tw_ports", _tw(8000, 1), (4).to_bytes(8, "little"))
        self.maps.update("runq_procs", u32(SERVER_PID),
                         bytes(RunqProcC(delay_ns=300_000_000, count=60)))
        self.maps.update("runq_hist", bytes(RunqHistKeyC(tgid=SERVER_PID, slot=12)),
                         (60).to_bytes(8, "little"))


@pytest.fixture(scope="module")
def frame_and_node(tmp_path_factory: pytest.TempPathFactory) -> tuple[FeatureFrame, Node]:
    proc = tmp_path_factory.mktemp("proc")
    (proc / str(SERVER_PID)).mkdir()  # the server is alive
    node = Node(str(proc))
    nv = ReplayClock()
    s = NvmlSampler(nv, clock_offset_ns=nv.clock_offset_ns, monotonic_ns=nv.now_ns)
    f = FeatureFrame(sampler=s, providers=node.signals.providers(), monotonic_ns=nv.now_ns,
                     clock_offset_ns=nv.clock_offset_ns)
    for i in range(META["passes"]):
        s.sample_once()
        if i == META["passes"] - 11:
            f.tick()  # the row before: tcp and runq counters as they were
            node.second()
    f.tick()
    return f, node


def scrape(exp: PrometheusExporter) -> dict[str, Any]:
    text = generate_latest(exp.registry).decode()
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def one(fams: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    hits = [s.value for s in fams[family].samples if s.name == (sample or family)
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, labels, fams[family].samples)
    return float(hits[0])


class FakeAgent:
    def __init__(self, frame: FeatureFrame, node: NodeSignals) -> None:
        self.frame, self.node = frame, node

    def stats(self) -> AgentStats:
        return AgentStats()

    def metric_samples(self) -> list[MetricSample]:
        return [*metric_samples(self.frame.latest(), self.frame.devices),
                *counter_samples(self.node)]


def test_feature_row_and_counters_on_metrics(frame_and_node: tuple[FeatureFrame, Node]) -> None:
    frame, node = frame_and_node
    row = frame.latest()
    exp = PrometheusExporter()
    exporters = ExporterSet([exp])
    exporters.attach_agent(FakeAgent(frame, node.signals))  # what `sits-trace run` does
    fams = scrape(exp)

    # GPU: DCGM names, units and labels, gauges
    sm = fams["DCGM_FI_PROF_SM_ACTIVE"]
    assert sm.type == "gauge"
    assert one(fams, "DCGM_FI_PROF_SM_ACTIVE", gpu="0", modelName="NVIDIA H200") == \
        pytest.approx(row[("sm_active_pct", "gpu0")] / 100)
    assert one(fams, "DCGM_FI_PROF_PCIE_RX_BYTES", gpu="0") == \
        pytest.approx(row[("pcie_rx_bytes_per_s", "gpu0")])
    assert one(fams, "DCGM_FI_DEV_FB_USED", gpu="0") == \
        pytest.approx(row[("memory_used_bytes", "gpu0")] / 2**20)
    assert one(fams, "DCGM_FI_DEV_POWER_USAGE", gpu="0") == pytest.approx(row[("power_w", "gpu0")])
    uuid = sm.samples[0].labels["UUID"]
    assert uuid.startswith("GPU-")

    # TCP: per-second rates of the last row, cumulative counters read at scrape time
    assert one(fams, "sits_tcp_retransmits_per_s") == pytest.approx(8 / 2)
    assert one(fams, "sits_tcp_resets_out_per_s") == pytest.approx(3 / 2)
    assert fams["sits_tcp_retransmits"].type == "counter"
    assert one(fams, "sits_tcp_retransmits", "sits_tcp_retransmits_total") == 13
    assert one(fams, "sits_tcp_resets_out", "sits_tcp_resets_out_total") == 4
    assert one(fams, "sits_tcp_time_wait_sockets", side="peer", port="8000") == 4

    # run queue of the traced server: rate, mean wait, counters
    pid = str(SERVER_PID)
    assert one(fams, "sits_cpu_runq_delay_s_per_s", pid=pid) == pytest.approx(0.3 / 2)
    assert one(fams, "sits_cpu_runq_mean_wait_us", pid=pid) == pytest.approx(5000)
    assert one(fams, "sits_cpu_runq_delay_seconds", "sits_cpu_runq_delay_seconds_total",
               pid=pid) == pytest.approx(0.3)
    assert one(fams, "sits_cpu_runq_waits", "sits_cpu_runq_waits_total", pid=pid) == 60

    # every sample of the row made it, under one name each
    names = {m.name for m in metric_samples(row, frame.devices)}
    assert names <= set(fams)


def test_frame_columns_name_ports_and_processes(
        frame_and_node: tuple[FeatureFrame, Node]) -> None:
    frame, _ = frame_and_node
    df = frame.frame()
    assert df[("tcp_time_wait_sockets", "peer_port8000")].iloc[-1] == 4
    assert df[("cpu_runq_waits_per_s", f"pid{SERVER_PID}")].iloc[-1] == pytest.approx(30)
    assert {"gpu0", "node"} <= set(df.columns.get_level_values(1))


def test_bad_or_broken_node_samples_do_not_spoil_the_scrape() -> None:
    exp = PrometheusExporter()
    exp.attach_agent(AgentStats, lambda: [MetricSample("sits_ok_per_s", {}, 1.0),
                                          MetricSample("not a name", {}, 2.0)])
    fams = scrape(exp)
    assert one(fams, "sits_ok_per_s") == 1.0
    assert not any(" " in n for n in fams)

    def broken() -> list[MetricSample]:
        raise RuntimeError("frame gone")

    exp.attach_agent(AgentStats, broken)
    assert "http_server_request_duration_seconds" in scrape(exp)


def test_an_exited_process_leaves_the_frame_once_idle(tmp_path: Any) -> None:
    node = Node(str(tmp_path))  # no /proc/<pid>: the process exited
    f = FeatureFrame(providers=node.signals.providers())
    node.second()
    assert ("cpu_runq_waits_per_s", f"pid{SERVER_PID}") in f.tick()  # waited this interval
    node.now[0] += 1_000_000_000
    assert not any(ent == f"pid{SERVER_PID}" for _, ent in f.tick())


def test_a_connections_tcp_stats_are_read_once_until_an_event_or_a_second_passes() -> None:
    """TcpSignals reads a connection's tcp_conns entry once and keeps it across batches of
    records until a TCP event record arrives (the counters only move with one) or the
    entry is stats_max_age_ns old (srtt); then it reads it again."""
    from sits_trace.agent.capture.events import Kind
    from sits_trace.agent.capture.wire import TcpConnC, TcpEventC, TcpEventType, TcpPeerKeyC
    from sits_trace.agent.model import ConnInfo, Exchange, RequestHead, ResponseHead, Role, Span
    from sits_trace.agent.signals.tcp import TcpTuple, addr16

    t = TcpTuple("10.0.0.1", 8080, "10.0.0.9", 51000)
    pk = TcpPeerKeyC()
    pk.raddr[:] = addr16("10.0.0.9")
    pk.rport, pk.lport = 51000, 8080

    def entry(retransmits: int, srtt_us: int) -> bytes:
        c = TcpConnC(retransmits=retransmits, srtt_us=srtt_us, active=1)
        return bytes(c)

    maps = DictMaps({"tcp_conns": {t.key(): entry(0, 80)},
                     "tcp_peers": {bytes(pk): addr16("10.0.0.1")}})
    lookups: list[str] = []
    real = maps.lookup

    def counted(name: str, key: bytes) -> bytes | None:
        lookups.append(name)
        return real(name, key)

    maps.lookup = counted  # type: ignore[method-assign]
    now = [0]
    sig = TcpSignals(maps, monotonic_ns=lambda: now[0])
    info = ConnInfo(conn_id=9, pid=1, fd=3, role=Role.SERVER, peer_address="10.0.0.9",
                    peer_port=51000, local_address="10.0.0.1", local_port=8080)

    def attrs() -> tuple[object, object]:
        ex = Exchange(info, RequestHead("GET", "/", "1.1", [], 100, 100),
                      ResponseHead(200, "1.1", [], 200, 300))
        span = Span("0" * 32, "0" * 16, None, "GET /", "SERVER", 0, 0)
        sig.annotate(ex, span)
        return span.attributes["sits.tcp.srtt_us"], span.attributes["sits.tcp.conn.retransmits"]

    sig.new_batch()
    assert attrs() == (80, 0)
    maps.maps["tcp_conns"][t.key()] = entry(2, 90)
    assert attrs() == (80, 0)  # same batch: read once
    now[0] += 500_000_000
    sig.new_batch()
    assert attrs() == (80, 0) and lookups.count("tcp_conns") == 1  # kept: no event, 0.5 s
    ev = TcpEventC(kind=int(Kind.TCP_EVENT), ts_ns=150, type=int(TcpEventType.RETRANS))
    ev.key = type(ev.key).from_buffer_copy(t.key())
    sig.on_record(bytes(ev))  # a retransmit: the counters moved, the entry is read again
    assert attrs() == (90, 2) and lookups.count("tcp_conns") == 2
    maps.maps["tcp_conns"][t.key()] = entry(2, 95)
    now[0] += 1_000_000_000
    sig.new_batch()
    assert attrs() == (95, 2) and lookups.count("tcp_conns") == 3  # a second old: read again
