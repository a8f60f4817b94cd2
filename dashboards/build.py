"""Writes the Grafana dashboards in this folder from the panel lists below.

Run `python dashboards/build.py` after editing; tests/unit/test_exporters_dashboards.py
fails when a committed JSON differs from what this writes. Each dashboard is a
list of rows; the SLO overview ends with the node rows (GPU, PCIe, CUDA, run queue, TCP).
The datasource is the `${datasource}` variable; uids are stable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
SRV = "http_server_request_duration_seconds"
CLI = "http_client_request_duration_seconds"
SEL = 'service_name=~"$service", http_route=~"$route"'
W = "$__rate_interval"


def rate(metric: str, sel: str = SEL, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{sel}}}[{W}]))"


def quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, {rate(metric + '_bucket', SEL, 'le, ' + by)})"


def error_ratio(metric: str, by: str) -> str:
    errors = rate(metric + "_count", SEL + ', http_response_status_code=~"5.."', by)
    total = rate(metric + "_count", SEL, by)
    return f"({errors} or {total} * 0) / {total}"  # 0, not absent, when nothing failed


def target(expr: str, legend: str = "", ref: str = "A", **kw: Any) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, **kw}


def panel(title: str, targets: list[dict[str, Any]], *, kind: str = "timeseries", unit: str = "",
          w: int = 8, h: int = 8, desc: str = "", links: list[dict[str, Any]] | None = None,
          **options: Any) -> dict[str, Any]:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    p: dict[str, Any] = {
        "type": kind, "title": title, "description": desc, "datasource": DS, "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "links": links or []}, "overrides": []},
        "options": options, "gridPos": {"w": w, "h": h},
    }
    return p


def row(title: str, *panels: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    return title, list(panels)


def query_var(name: str, query: str, label: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
            "current": {"text": "All", "value": "$__all"}}


VARIABLES = [
    {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
     "current": {}, "hide": 0},
    query_var("service", f"label_values({SRV}_count, service_name)", "Service"),
    query_var("route", f'label_values({SRV}_count{{service_name=~"$service"}}, http_route)',
              "Route"),
    {"name": "trace_backend_url", "label": "Trace backend (Jaeger or Grafana Explore URL)",
     "type": "textbox", "query": "http://localhost:16686",
     "current": {"text": "http://localhost:16686", "value": "http://localhost:16686"}},
]

JAEGER_SEARCH = ("${trace_backend_url}/search?service=${__data.fields.service_name}"
                 "&limit=20&lookback=1h&minDuration=${__value.raw}s")


def slo_overview() -> list[tuple[str, list[dict[str, Any]]]]:
    return [
        row("Traffic (server spans)",
            panel("Request rate by route", [target(rate(SRV + "_count", SEL, "http_route"),
                                                   "{{http_route}}")], unit="reqps"),
            panel("Error rate (5xx share) by route",
                  [target(error_ratio(SRV, "http_route"), "{{http_route}}")], unit="percentunit"),
            panel("Requests by status", [target(rate(SRV + "_count", SEL,
                                                     "http_response_status_code"),
                                                "{{http_response_status_code}}")], unit="reqps")),
        row("Latency (server spans)",
            *[panel(f"P{int(q * 100)} latency by route",
                    [target(quantile(q, SRV, "http_route"), "{{http_route}}")], unit="s")
              for q in (0.5, 0.95, 0.99)]),
        genai_row(),
        rca_row(),
        row("Routes",
            panel("Routes: rate, errors, P99 (click P99 for slow traces)", [
                target(rate(SRV + "_count", SEL, "service_name, http_route"), format="table",
                       instant=True),
                target(error_ratio(SRV, "service_name, http_route"), format="table",
                       instant=True),
                target(quantile(0.99, SRV, "service_name, http_route"), format="table",
                       instant=True),
            ], kind="table", w=24, h=9,
                  links=[{"title": "Traces slower than this", "url": JAEGER_SEARCH,
                          "targetBlank": True}])),
        row("Outgoing calls (client spans)",
            panel("Client request rate by route",
                  [target(rate(CLI + "_count", SEL, "service_name, http_route"),
                          "{{service_name}} {{http_route}}")], unit="reqps", w=12),
            panel("Client P99 latency by route",
                  [target(quantile(0.99, CLI, "service_name, http_route"),
                          "{{service_name}} {{http_route}}")], unit="s", w=12)),
    ]


def genai_row() -> tuple[str, list[dict[str, Any]]]:
    """Model serving on this node (OpenAI-compatible routes, SSE): the SLOs of an inference
    server are written in time to first token and time per output token (exporters/_genai.py)."""
    sel = 'service_name=~"$service"'
    by = "le, service_name, gen_ai_request_model"

    def q(metric: str, pct: float) -> str:
        return (f"histogram_quantile({pct}, sum by ({by}) (rate({metric}_bucket{{{sel}}}"
                f"[{W}])))")

    ttft, tpot = "gen_ai_server_time_to_first_token_seconds", \
        "gen_ai_server_time_per_output_token_seconds"
    legend = "{{service_name}} {{gen_ai_request_model}}"
    return row("LLM serving (time to first token, time per output token)",
               panel("P95 time to first token by model", [target(q(ttft, 0.95), legend)],
                     unit="s", w=12, desc="First streamed event after the request began."),
               panel("P95 time per output token by model", [target(q(tpot, 0.95), legend)],
                     unit="s", w=12,
                     desc="Mean gap between streamed events (writes) after the first."))


def rca_row() -> tuple[str, list[dict[str, Any]]]:
    """Beside the latency panels: why (docs/rca.md; `[rca] enabled = true` in `sits-trace run`)."""
    sel = 'service=~"$service"'
    return row("Root cause (sits-trace rca)",
               panel("Top cause now (score, ms per request it explains)", [
                   target(f"sits_rca_top_cause_score{{{sel}}}", format="table", instant=True),
                   target(f"sits_rca_explained_ms{{{sel}}}", format="table", instant=True),
               ], kind="table", w=12,
                   desc="The top-ranked cause of each service's latest verdict (fresh for two "
                        "windows)."),
               panel("Verdicts by top cause", [
                   target(f"sum by (service, cause) (increase(sits_rca_verdicts_total{{{sel}}}"
                          f"[{W}]))", "{{service}} {{cause}}")], kind="timeseries", w=12,
                   desc="SLO breaches or degradations, by the cause ranked first."))


# Node signals (analyzers/features.py, exporters/node_metrics.py names: DCGM's for GPU state, sits_* for the rest). They sit in
# the SLO overview so a P99 jump shows beside what the GPU, PCIe link, CUDA calls, run queue and
# TCP stack did at the same time. GPU and CUDA panels are empty on a node without them.
GPU_LEGEND = "gpu{{gpu}}"
PID_LEGEND = "pid {{pid}}"


def node_rows() -> list[tuple[str, list[dict[str, Any]]]]:
    return [
        row("GPU (NVML, DCGM field names)",
            panel("GPU utilisation", [target("DCGM_FI_DEV_GPU_UTIL", GPU_LEGEND)],
                  unit="percent", w=6),
            panel("SM active / occupancy / tensor active", [
                target("DCGM_FI_PROF_SM_ACTIVE", "sm active " + GPU_LEGEND),
                target("DCGM_FI_PROF_SM_OCCUPANCY", "sm occupancy " + GPU_LEGEND),
                target("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor " + GPU_LEGEND)],
                  unit="percentunit", w=6),
            panel("GPU memory used", [target("DCGM_FI_DEV_FB_USED", GPU_LEGEND)],
                  unit="mbytes", w=6),
            panel("Power", [target("DCGM_FI_DEV_POWER_USAGE", GPU_LEGEND)], unit="watt", w=6)),
        row("PCIe and clocks",
            panel("PCIe TX / RX", [
                target("DCGM_FI_PROF_PCIE_TX_BYTES", "tx " + GPU_LEGEND),
                target("DCGM_FI_PROF_PCIE_RX_BYTES", "rx " + GPU_LEGEND)], unit="Bps", w=6,
                  desc="Whole GPU (GPM): other processes' copies show here as contention"),
            panel("PCIe replays", [target(
                f"increase(DCGM_FI_DEV_PCIE_REPLAY_COUNTER[{W}])", GPU_LEGEND)], unit="short",
                  w=6),
            panel("SM / memory clocks", [
                target("DCGM_FI_DEV_SM_CLOCK", "sm " + GPU_LEGEND),
                target("DCGM_FI_DEV_MEM_CLOCK", "memory " + GPU_LEGEND)], unit="short", w=6,
                  desc="MHz"),
            panel("Clock event reasons (bitmask)", [
                target("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", GPU_LEGEND)], unit="short", w=6,
                  desc="nvmlClocksEventReasons: 0x4 SW power cap, 0x20 SW thermal, ...")),
        row("CUDA driver calls (traced processes)",
            panel("Host to device / device to host copies", [target(
                f"sum by (pid, direction) (rate(sits_cuda_copy_bytes_total"
                f'{{direction=~"h2d|d2h"}}[{W}]))', "{{direction}} " + PID_LEGEND)],
                  unit="Bps"),
            panel("Kernel launches", [target(
                f"sum by (pid) (rate(sits_cuda_kernel_launches_total[{W}]))", PID_LEGEND)],
                  unit="ops"),
            panel("Time in cu*Synchronize", [target(
                f"sum by (pid) (rate(sits_cuda_sync_wait_seconds_total[{W}]))", PID_LEGEND)],
                  unit="percentunit", desc="Seconds waited per second")),
        row("CPU run queue (processes with traced connections)",
            panel("Run-queue delay", [target(
                f"sum by (pid) (rate(sits_cpu_runq_delay_seconds_total[{W}]))", PID_LEGEND)],
                  unit="s", w=12,
                  desc="Seconds the process's threads waited for a CPU, per second"),
            panel("Mean run-queue wait", [target(
                f"sum by (pid) (rate(sits_cpu_runq_delay_seconds_total[{W}]))"
                f" / sum by (pid) (rate(sits_cpu_runq_waits_total[{W}]))", PID_LEGEND)],
                  unit="s", w=12)),
        row("TCP (node)",
            panel("Retransmits", [
                target(f"rate(sits_tcp_retransmits_total[{W}])", "retransmits"),
                target(f"rate(sits_tcp_synack_retransmits_total[{W}])", "SYN-ACK retransmits"),
                target(f"rate(sits_tcp_retransmit_failures_total[{W}])", "failed")],
                  unit="pps"),
            panel("Resets", [
                target(f"rate(sits_tcp_resets_out_total[{W}])", "sent"),
                target(f"rate(sits_tcp_resets_in_total[{W}])", "received")], unit="pps"),
            panel("TIME_WAIT sockets by port (top 10)", [target(
                "topk(10, sum by (side, port) (sits_tcp_time_wait_sockets))",
                "{{side}} port {{port}}")], unit="short",
                  desc="local: this host's port; peer: the remote port of the connection")),
    ]


def drilldown() -> list[tuple[str, list[dict[str, Any]]]]:
    return [
        row("Latency of the selected routes (dots are exemplars: click one for its trace)",
            panel("P50 / P95 / P99", [target(quantile(q, SRV, "http_route"),
                                             f"p{int(q * 100)} {{{{http_route}}}}", exemplar=True)
                                      for q in (0.5, 0.95, 0.99)], unit="s", w=16, h=10),
            panel("Latency distribution", [target(rate(SRV + "_bucket", SEL, "le"), "{{le}}",
                                                  format="heatmap")],
                  kind="heatmap", w=8, h=10)),
        row("Slowest routes",
            panel("Slowest routes by P99 (click for traces in the trace backend)",
                  [target(f"topk(20, {quantile(0.99, SRV, 'service_name, http_route')})",
                          format="table", instant=True)],
                  kind="table", w=12, h=10,
                  links=[{"title": "Open traces slower than this P99", "url": JAEGER_SEARCH,
                          "targetBlank": True}]),
            panel("Status codes of the selected routes",
                  [target(rate(SRV + "_count", SEL, "http_route, http_response_status_code"),
                          "{{http_route}} {{http_response_status_code}}")],
                  unit="reqps", w=12, h=10)),
    ]


def agent_health() -> list[tuple[str, list[dict[str, Any]]]]:
    return [
        row("Kernel events",
            panel("BPF events seen by kind", [target(
                f"sum by (kind) (rate(sits_bpf_events_total[{W}]))", "{{kind}}")], unit="ops"),
            panel("BPF events lost by kind", [target(
                f"sum by (kind) (rate(sits_bpf_events_lost_total[{W}]))", "{{kind}}")],
                  unit="ops", desc="Ring buffer full: raise trace.ringbuf_mib"),
            panel("Parser resyncs and decode errors", [
                target(f"rate(sits_parser_resyncs_total[{W}])", "resyncs"),
                target(f"rate(sits_decode_errors_total[{W}])", "decode errors")], unit="ops")),
        row("Export",
            panel("Spans exported by exporter", [target(
                f"sum by (exporter) (rate(sits_spans_exported_total[{W}]))", "{{exporter}}")],
                  unit="ops"),
            panel("Spans dropped by exporter and reason", [target(
                f"sum by (exporter, reason) (rate(sits_spans_dropped_total[{W}]))",
                "{{exporter}} {{reason}}")], unit="ops"),
            panel("Export queue depth (share of capacity)", [target(
                "sits_export_queue_spans / sits_export_queue_capacity_spans", "{{exporter}}")],
                  unit="percentunit")),
        row("Agent process",
            panel("Agent CPU (cores)", [target(f"rate(sits_agent_cpu_seconds_total[{W}])",
                                               "cpu")], unit="short"),
            panel("Load shedding: exchanges shed / capture shift", [
                target(f"rate(sits_exchanges_shed_total[{W}])", "shed/s"),
                target("sits_capture_shift", "shift (1 in 2^n captured)")],
                  unit="short", desc="Over trace.cpu_budget the kernel captures one exchange "
                  "in 2^n; request rates stay true (spans are re-weighted)"),
            panel("Agent resident memory", [target("sits_agent_resident_memory_bytes", "rss")],
                  unit="bytes"),
            panel("Connections followed / probes failed", [
                target("sits_connections_active", "active connections"),
                target("sum(sits_probe_failed) or vector(0)", "failed probes")], unit="short")),
    ]


def layout(rows: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Rows stacked top to bottom, panels left to right in each; ids in order."""
    out: list[dict[str, Any]] = []
    y, pid = 0, 1
    for title, panels in rows:
        out.append({"type": "row", "title": title, "id": pid, "collapsed": False,
                    "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y, x, tallest = pid + 1, y + 1, 0, 0
        for p in panels:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y, tallest = 0, y + tallest, 0
            p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
            p["id"] = pid
            pid, x, tallest = pid + 1, x + w, max(tallest, h)
            out.append(p)
        y += tallest
    return out


def dashboard(uid: str, title: str, rows: list[tuple[str, list[dict[str, Any]]]],
              variables: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "tags": ["sits-trace"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "templating": {"list": variables},
        "links": [{"title": "sits-trace", "type": "dashboards", "tags": ["sits-trace"],
                   "asDropdown": True}],
        "annotations": {"list": []}, "panels": layout(rows),
    }


DASHBOARDS = {
    "sits-slo-overview.json": dashboard("sits-slo-overview", "sits-trace / SLO overview",
                                        slo_overview() + node_rows(), VARIABLES),
    "sits-request-drilldown.json": dashboard("sits-request-drilldown",
                                             "sits-trace / Request drill-down", drilldown(),
                                             VARIABLES),
    "sits-agent-health.json": dashboard("sits-agent-health", "sits-trace / Agent health",
                                        agent_health(), VARIABLES[:1]),
}


def render(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=False) + "\n"


def main() -> int:
    for name, d in DASHBOARDS.items():
        (HERE / name).write_text(render(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
