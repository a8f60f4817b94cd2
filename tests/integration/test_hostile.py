"""Hostile traffic against nginx, `sits-trace trace` at default settings (issue 10).

Each case runs one attack from bench/hostile.py against a real nginx with a fresh agent,
then sends valid requests one every 100 ms from the attack's end on. Checked for every case:
- tracing recovers within 2 s of the attack's end (every later probe traced within 2 s);
- every probe not traced is counted (exchanges_shed or capture_lost);
- no span blames a client (malformed_request) for the agent's own loss.
Plus the case's own accounting (churn: spans + shed == requests nginx logged; pipelined:
spans + requests_uncaptured == requests sent; upload: the request after a 100 MB body on the
same connection is traced). SITS_HOSTILE_SCALE shortens the attacks (default 0.3, the bounded
form CI runs; 1.0 is the full form issue 10 describes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.hostile import Nginx, Result, run_scenario

pytestmark = [pytest.mark.bpf, pytest.mark.hostile]

SCALE = float(os.environ.get("SITS_HOSTILE_SCALE", "0.3"))


@pytest.fixture()
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    n = Nginx(tmp_path)
    yield n
    n.stop()


def check_common(r: Result, client_fault_ok: bool = False) -> None:
    print(r.line())
    p = r.probe
    assert p.recovered_s <= 2.0, r.line()
    untraced = p.sent - p.traced
    assert untraced <= r.stats["exchanges_shed"] + r.stats["capture_lost"], r.line()
    if not client_fault_ok:
        assert r.blamed == 0, r.line()


def test_slowloris(nginx: Nginx) -> None:
    r = run_scenario("slowloris", nginx, SCALE)
    check_common(r)
    if SCALE >= 0.7:  # more than 64 one-byte reads per connection: capture stopped, counted
        assert r.stats["dribbles"] > 0, r.line()


def test_churn_with_time_wait(nginx: Nginx) -> None:
    r = run_scenario("churn", nginx, SCALE)
    check_common(r)
    logged = nginx.logged("churn-") + nginx.logged("probe-")
    traced = len(r.traced("churn-")) + len(r.traced("probe-"))
    if r.stats["lost_in_kernel"] == 0:
        assert traced + r.stats["exchanges_shed"] == logged, r.line()
    else:
        assert traced + r.stats["exchanges_shed"] + r.stats["capture_lost"] >= logged, r.line()


@pytest.mark.parametrize("scenario", ["upload", "upload-tls"])
def test_huge_upload_then_request_on_the_same_connection(nginx: Nginx, scenario: str,
                                                        tmp_path: Path) -> None:
    r = run_scenario(scenario, nginx, SCALE, record=tmp_path / "records.bin")
    check_common(r)
    # the request after the upload is traced, unless the agent was shedding load then (one
    # exchange in 2^shift captured, each skipped one counted: CI's machine, loaded by another
    # job, shed 11 exchanges around this upload once, the request among them). A failure
    # shows the connection's records (one CI run: not traced, parser_malformed=1, nothing
    # lost or shed; not reproduced in 60 runs since)
    assert len(r.traced(f"{scenario}-after")) == 1 or r.stats["exchanges_shed"] > 0, (
        r.line() + "\n" + r.records_of(f"x-request-id: {scenario}-big".encode()))
    # past its first 64 KiB the body's reads send their last 512 bytes, not 4 KiB each: the
    # ring does not overflow (before: 30 MiB of payload into a 16 MiB ring, 2489 records lost
    # in a clean-clone CI run and the next request among them; 10590 at 100 MiB)
    assert r.stats["lost_in_kernel"] == 0, r.line()
    # and they are folded into a record per second or so, sent when the response begins
    # (nginx discards the body 4 KiB a read, over TLS 4 KiB an SSL_read: 7,680 reads of a
    # 30 MiB upload, a record each before; the probes after the attack add about 60)
    assert r.stats["records"] < 600, r.line()
    big = r.traced(f"{scenario}-big")
    assert all(s["attributes"].get("error.type") in (None, "capture_gap") for s in big), big


def test_pipelined_burst_in_one_write(nginx: Nginx) -> None:
    r = run_scenario("pipelined", nginx, SCALE)
    check_common(r)
    sent = nginx.logged("pipe-")
    traced = len(r.traced("pipe-"))
    assert sent >= 400 and traced < sent  # past 4 KB of one read: not captured
    assert abs(traced + r.stats["requests_uncaptured"] - sent) <= 0.02 * sent, r.line()


def test_junk_prefixes(nginx: Nginx) -> None:
    # junk is the client's own doing: malformed_request may be said of it, never of probes
    r = run_scenario("junk", nginx, SCALE)
    check_common(r, client_fault_ok=True)
    assert not [s for s in r.traced("probe-") if "error.type" in s["attributes"]]


def test_thousand_headers(nginx: Nginx) -> None:
    r = run_scenario("headers", nginx, SCALE)
    check_common(r)
    # x-request-id is the 101st header: kept although only 64 headers are
    assert len(r.traced("hdrs-")) == nginx.logged("hdrs-") > 0, r.line()


def test_resets(nginx: Nginx) -> None:
    r = run_scenario("resets", nginx, SCALE)
    check_common(r)
