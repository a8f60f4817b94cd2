"""Every key documented from the code; `config check` origins; `config show --defaults`."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from sits_trace.agent import configdoc
from sits_trace.agent.cli import app
from sits_trace.agent.config import Config, ConfigError
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]


def test_docs_configuration_md_is_generated_from_the_code() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == configdoc.markdown(), \
        "docs/configuration.md is stale: run .venv/bin/python -m sits_trace.agent.configdoc"


def test_every_key_has_a_description() -> None:
    undocumented = [k.key for k in configdoc.all_keys() if not k.doc]
    assert undocumented == []


def test_defaults_toml_loads_back_to_the_defaults(tmp_path: Path) -> None:
    text = configdoc.defaults_toml()
    data = tomllib.loads(text)
    assert set(data) == {"trace", "export", "signals", "api", "control", "rca"}
    f = tmp_path / "c.toml"
    f.write_text(text)
    from sits_trace.agent.config import load

    assert load(f, env={}) == Config()
    assert "# only these processes and their children" in text


def test_origins(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[trace]\nport = 8000\npoll_ms = 50\n[api]\nsocket = \"\"\n")
    rows = {r.key: r for r in configdoc.effective(
        f, env={"SITS_TRACE_POLL_MS": "30", "SITS_EXPORT_JSONL_PATH": ""},
        overrides={"trace.port": 9000, "trace.pids": None})}
    assert (rows["trace.port"].value, rows["trace.port"].origin) == (9000, "flag")
    assert (rows["trace.poll_ms"].value, rows["trace.poll_ms"].origin) == \
        (30, "environment SITS_TRACE_POLL_MS")
    assert (rows["api.socket"].value, rows["api.socket"].origin) == ("", f"file {f}")
    assert rows["export.jsonl_path"].origin == "environment SITS_EXPORT_JSONL_PATH"
    assert (rows["trace.tls"].value, rows["trace.tls"].origin) == (True, "default")
    with pytest.raises(ConfigError):
        configdoc.effective(f, env={"SITS_TRACE_PORT": "70000"})


def test_config_check_command(tmp_path: Path) -> None:
    runner = CliRunner()
    good = tmp_path / "good.toml"
    good.write_text("[export]\nprometheus_port = 9464\n")
    res = runner.invoke(app, ["config", "check", "-c", str(good)], env={})
    assert res.exit_code == 0
    line = next(x for x in res.stdout.splitlines() if x.startswith("export.prometheus_port"))
    assert line.split() == ["export.prometheus_port", "9464", "file", str(good)]
    bad = tmp_path / "bad.toml"
    bad.write_text('[export]\notlp_protocol = "udp"\n')
    res = runner.invoke(app, ["config", "check", "-c", str(bad)])
    assert res.exit_code == 2
    assert res.stderr.strip() == ("sits-trace: export.otlp_protocol: 'udp' is not one of "
                                  "'grpc', 'http/protobuf'")
    bad.write_text("[trace]\nprot = 1\n")
    res = runner.invoke(app, ["config", "check", "-c", str(bad)])
    assert res.exit_code == 2 and "trace.prot" in res.stderr and "port" in res.stderr
    assert "Traceback" not in res.output


def test_config_show_defaults_command() -> None:
    res = CliRunner().invoke(app, ["config", "show", "--defaults"])
    assert res.exit_code == 0 and res.stdout == configdoc.defaults_toml()
