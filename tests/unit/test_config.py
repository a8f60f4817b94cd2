from __future__ import annotations

from pathlib import Path

import pytest
from sits_trace.agent.config import ConfigError, load


def test_defaults_are_valid() -> None:
    cfg = load(env={})
    assert cfg.trace.capture_bytes == 4096
    assert cfg.export.jsonl_path == "-"


def test_file_then_env_then_cli(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[trace]\nport = 8080\ncapture_bytes = 1024\n[export]\notlp_endpoint = "http://c:4317"\n')
    cfg = load(f, env={"SITS_TRACE_PORT": "9090", "SITS_TRACE_PIDS": "12,13"},
               overrides={"trace.capture_bytes": 2048})
    assert cfg.trace.port == 9090  # environment beats the file
    assert cfg.trace.pids == [12, 13]
    assert cfg.trace.capture_bytes == 2048  # the command line beats both
    assert cfg.export.otlp_endpoint == "http://c:4317"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[trace]\ncapture_bytes = 1000\n", "trace.capture_bytes: 1000 is not a power of two"),
        ("[trace]\nport = 70000\n", "trace.port: 70000 is outside"),
        ("[trace]\nportt = 1\n", "unknown key trace.portt"),
        ("[nope]\nx = 1\n", "unknown section [nope]"),
        ("[export]\notlp_protocol = 'udp'\n", "export.otlp_protocol: 'udp' is not one of"),
        ("[trace]\nport = 'eighty'\n", "trace.port: 'eighty' is not a valid int"),
        ("[trace\n", "not valid TOML"),
        ("[export]\notlp_endpoint = 'collector:4317'\n", "needs a scheme"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(f, env={})
    assert needle in str(e.value)


def test_bad_environment_value() -> None:
    with pytest.raises(ConfigError, match="trace.tls: 'maybe' is not a valid bool"):
        load(env={"SITS_TRACE_TLS": "maybe"})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file /nonexistent.toml"):
        load("/nonexistent.toml", env={})


def test_signals_can_be_turned_off(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[signals]\ntcp = false\nfeatures_keep_s = 600\n")
    cfg = load(f, env={"SITS_SIGNALS_SCHED": "off"})
    assert (cfg.signals.tcp, cfg.signals.sched, cfg.signals.cuda) == (False, False, True)
    assert cfg.signals.features_keep_s == 600
    with pytest.raises(ConfigError, match="unknown key signals.tpc"):
        load(env={"SITS_SIGNALS_TPC": "0"})
    with pytest.raises(ConfigError, match="signals.features_keep_s: 5 is outside"):
        load(env={"SITS_SIGNALS_FEATURES_KEEP_S": "5"})
    with pytest.raises(ConfigError, match=r"unknown section \[validate\]"):
        load(overrides={"validate.x": 1}, env={})
