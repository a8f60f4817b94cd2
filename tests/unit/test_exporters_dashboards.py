"""The Grafana dashboards: generated, datasource by variable, stable uids, sane layout.

tests/integration/test_export_e2e.py (test_every_dashboard_query_returns_data) runs every
expression against a real Prometheus; this checks what needs no server.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

DIR = Path(__file__).resolve().parents[2] / "dashboards"
FILES = sorted(DIR.glob("*.json"))


def _build() -> Any:
    spec = importlib.util.spec_from_file_location("dash_build", DIR / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_json_is_what_build_py_writes() -> None:
    build = _build()
    assert sorted(build.DASHBOARDS) == [f.name for f in FILES]
    for f in FILES:
        assert f.read_text() == build.render(build.DASHBOARDS[f.name]), \
            f"{f.name} is stale: run python dashboards/build.py"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_dashboard_shape(path: Path) -> None:
    d = json.loads(path.read_text())
    assert d["uid"] == path.stem and len(d["uid"]) <= 40
    names = [v["name"] for v in d["templating"]["list"]]
    assert names[0] == "datasource"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert panels
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var.startswith("__") or var in names, f"{var} is not a variable"
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])


def test_trace_links_use_the_trace_backend_variable() -> None:
    d = json.loads((DIR / "sits-request-drilldown.json").read_text())
    links = [lk["url"] for p in d["panels"] if p["type"] != "row"
             for lk in p["fieldConfig"]["defaults"]["links"]]
    assert links and all(u.startswith("${trace_backend_url}/") for u in links)
    assert any(t.get("exemplar") for p in d["panels"] if p["type"] != "row" for t in p["targets"])


def _emitted_names() -> set[str]:
    """Every metric name the agent can put on /metrics for node signals, from the code that
    makes them (analyzers/features.py for the frame's rows, exporters/node_metrics.py for the
    counters of signals/cuda and signals/node)."""
    from sits_trace.agent.capture.bpfmaps import DictMaps, u32
    from sits_trace.agent.capture.wire import RunqProcC
    from sits_trace.agent.signals.cuda import CudaTotals
    from sits_trace.agent.signals.node import NodeSignals, tcp_features
    from sits_trace.agent.signals.sched import SchedSignals
    from sits_trace.agent.signals.tcp import TcpSample, TcpSignals
    from sits_trace.analyzers.features import FeatureFrame
    from sits_trace.exporters.node_metrics import (
        DCGM_NAMES,
        counter_samples,
        cuda_counter_samples,
        metric_samples,
    )

    maps = DictMaps({"runq_procs": {u32(1): bytes(RunqProcC(delay_ns=1, count=1))}})
    node = NodeSignals(TcpSignals(maps), SchedSignals(maps))
    names = {n for n, _ in DCGM_NAMES.values()}
    names |= {m.name for m in counter_samples(node)}
    names |= {m.name for m in cuda_counter_samples({1: CudaTotals()})}
    tw = TcpSample(1.0, {}, {("local", 80): 2}, [])
    row = FeatureFrame(providers={"tcp": lambda: tcp_features(tw)}).tick()
    names |= {m.name for m in metric_samples(row)}
    return names


def test_node_rows_sit_in_the_slo_overview_and_query_emitted_names() -> None:
    d = json.loads((DIR / "sits-slo-overview.json").read_text())
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows[0].startswith("Traffic")
    for want in ("GPU", "PCIe", "CUDA", "CPU run queue", "TCP"):
        assert any(r.startswith(want) for r in rows), (want, rows)
    exprs = [t["expr"] for p in d["panels"] if p["type"] != "row" for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(DCGM_FI_\w+|sits_(?:tcp|cpu|cuda)_\w+)", e)}
    assert len(used) >= 20
    missing = used - _emitted_names()
    assert not missing, f"dashboard queries metrics the agent never emits: {sorted(missing)}"
