"""AgentStats: the stats file's format, read back the way doctor, `stats` and the exporters do."""

from __future__ import annotations

import json

from sits_trace.agent.daemon import format_stats_lines
from sits_trace.agent.model import AgentStats

FILE = {"tracer": {"records": 12, "spans": 3, "capture_shift": 2, "exchanges_shed": 5,
                   "parser": {"resyncs": 1, "malformed": 4, "internal_errors": 1}},
        "kernel_seen": {"data": 10}, "kernel_lost": {"data": 2, "conn_open": 1},
        "probes": [], "uprobe_libraries": ["/usr/lib/libssl.so.3"], "time_unix": 1.5}


def test_round_trip_keeps_the_file_format() -> None:
    st = AgentStats.from_json(json.loads(json.dumps(FILE)))
    assert st.to_json() == FILE  # absent parts (node_signals, features) stay absent
    assert list(st.to_json()) == list(FILE)


def test_typed_reads() -> None:
    st = AgentStats.from_json(FILE)
    assert (st.count("spans"), st.count("conns_active"), st.lost_total) == (3, 0, 3)
    assert (st.parser_count("resyncs"), st.parser_count("gaps")) == (1, 0)
    empty = AgentStats()
    assert (empty.count("spans"), empty.parser_count("resyncs"), empty.lost_total) == (0, 0, 0)
    assert empty.to_json() == {"time_unix": 0.0}


def test_summary_line() -> None:
    line, untraced = format_stats_lines(AgentStats.from_json(FILE))
    assert line == ("records=12 spans=3 decode_errors=0 lost_in_kernel=3 exchanges_shed=5 "
                    "capture_shift=2 parser_resyncs=1 parser_malformed=4 "
                    "parser_internal_errors=1 drain_abandoned_bytes=0")
    # the second line: what could not be traced, by cause (issue 10)
    assert untraced.startswith("capture_lost=0 requests_uncaptured=0 ")
    assert "conns_active=0 dribbles=0" in untraced
