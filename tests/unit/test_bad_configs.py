"""Every bad configuration ends in one line that names the key and the fix, exit 2, no
traceback (issue 10): `sits-trace run --config FILE` in a subprocess, as a user would run it.
No root needed: each file is refused before any probe loads.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SITS = str(Path(sys.executable).parent / "sits-trace")

# (case, file bytes, words the one line must hold: the key, and a hint of the fix)
CASES: list[tuple[str, bytes, tuple[str, ...]]] = [
    ("non-utf8", b"[trace]\nport = 1\n# \xff\xfe\n", ("not UTF-8", "save it as UTF-8")),
    ("not-toml", b"[trace\nport = 1\n", ("not valid TOML",)),
    ("section-not-table", b"trace = 3\n", ("trace", "[section]")),
    ("unknown-section", b"[tracing]\nport = 1\n", ("[tracing]", "allowed")),
    ("unknown-key", b"[trace]\nfoo = 1\n", ("trace.foo", "allowed")),
    ("wrong-type-int", b'[trace]\npoll_ms = "fast"\n', ("trace.poll_ms", "int")),
    ("wrong-type-bool", b'[trace]\ntls = "maybe"\n', ("trace.tls", "bool")),
    ("wrong-type-list", b"[trace]\nssl_libraries = 5\n", ("trace.ssl_libraries", "list")),
    ("float-for-int", b"[signals]\nfeatures_keep_s = 1e9\n", ("signals.features_keep_s", "int")),
    ("negative", b"[trace]\npoll_ms = -5\n", ("trace.poll_ms", "1..1000")),
    ("zero", b"[export]\nqueue_size = 0\n", ("export.queue_size", "1..")),
    ("huge", b"[export]\nbatch_size = 100000000\n", ("export.batch_size", "1..")),
    ("nan", b"[trace]\nidle_timeout_s = nan\n", ("trace.idle_timeout_s", "0.1..86400")),
    ("negative-budget", b"[trace]\ncpu_budget = -1\n", ("trace.cpu_budget", "0..")),
    ("not-power-of-two", b"[trace]\ncapture_bytes = 1000\n", ("trace.capture_bytes", "power")),
    ("bad-port", b"[trace]\nport = 70000\n", ("trace.port", "0..65535")),
    ("bad-protocol", b'[export]\notlp_protocol = "udp"\n', ("export.otlp_protocol", "grpc")),
    ("endpoint-no-scheme", b'[export]\notlp_endpoint = "localhost:4317"\n',
     ("export.otlp_endpoint", "http://")),
    ("endpoint-bad-ipv6", b'[export]\notlp_endpoint = "http://[::1:4317"\n',
     ("export.otlp_endpoint", "http://[::1]:4317")),
    ("endpoint-bad-port", b'[export]\notlp_endpoint = "http://h:99999"\n',
     ("export.otlp_endpoint", "e.g.")),
    ("endpoint-ftp", b'[export]\notlp_endpoint = "ftp://h:4317"\n',
     ("export.otlp_endpoint", "http://")),
    ("jsonl-no-dir", b'[export]\njsonl_path = "/nonexistent/dir/x.jsonl"\n',
     ("export.jsonl_path", "does not exist")),
    ("jsonl-is-dir", b'[export]\njsonl_path = "/tmp"\n', ("export.jsonl_path", "directory")),
    ("prometheus-unresolvable", (b'[export]\nprometheus_port = 9\n'
     b'prometheus_address = "no.such.host.invalid"\n'), ("export.prometheus_address", "127.0.0.1")),
    ("prometheus-bad-port", b"[export]\nprometheus_port = -1\n", ("export.prometheus_port",)),
]


@pytest.fixture()
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def run_with(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SITS, "run", "--config", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)


def check_one_line(r: subprocess.CompletedProcess[str], words: tuple[str, ...]) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize(("case", "text", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_config(case: str, text: bytes, words: tuple[str, ...], tmp_path: Path) -> None:
    f = tmp_path / f"{case}.toml"
    f.write_bytes(text)
    check_one_line(run_with(f), words)


def test_prometheus_port_in_use(busy_port: int, tmp_path: Path) -> None:
    f = tmp_path / "busy.toml"
    f.write_text(f'[export]\njsonl_path = ""\nprometheus_port = {busy_port}\n')
    check_one_line(run_with(f), ("export.prometheus_port", "in use", "0 to turn"))


def test_missing_file(tmp_path: Path) -> None:
    check_one_line(run_with(tmp_path / "nope.toml"), ("nope.toml",))
