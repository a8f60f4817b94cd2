"""The Kubernetes DaemonSet and the Grafana provisioning files say what docs/export.md says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def daemonsets() -> list[dict[str, Any]]:
    docs = list(yaml.safe_load_all((ROOT / "docs/kubernetes/daemonset.yaml").read_text()))
    return [d for d in docs if d["kind"] == "DaemonSet"]


@pytest.mark.parametrize("ds", daemonsets(), ids=lambda d: d["metadata"]["name"])
def test_daemonset_can_trace_a_node(ds: dict[str, Any]) -> None:
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert spec["hostPID"] is True and c["securityContext"]["privileged"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys/kernel/debug", "/sys/kernel/tracing", "/lib/modules", "/usr/src"} <= mounts
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    by_mount = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path in ("/sys/kernel/debug", "/sys/kernel/tracing", "/lib/modules", "/usr/src"):
        assert host[by_mount[path]] == path
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(".svc.cluster.local:4317")
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == c["ports"][0]["containerPort"]


def test_gpu_nodes_get_exactly_one_agent() -> None:
    general, gpu = daemonsets()
    assert gpu["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    terms = general["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0] == {
        "key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]}
    assert any(t.get("key") == "nvidia.com/gpu" for t in gpu["spec"]["template"]["spec"]["tolerations"])


def test_grafana_provisioning_files_parse() -> None:
    dash = yaml.safe_load((ROOT / "dashboards/provisioning/dashboards.yaml").read_text())
    assert dash["providers"][0]["type"] == "file"
    ds = yaml.safe_load((ROOT / "dashboards/provisioning/datasources.example.yaml").read_text())
    prom = next(d for d in ds["datasources"] if d["type"] == "prometheus")
    assert prom["jsonData"]["exemplarTraceIdDestinations"][0]["name"] == "trace_id"
