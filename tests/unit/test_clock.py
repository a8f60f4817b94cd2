from __future__ import annotations

from collections.abc import Iterator

from sits_trace.agent.clock import realtime_offset_ns


def test_offset_from_the_tightest_bracket() -> None:
    # brackets (monotonic before, after) of widths 10, 2, 6: the 2-wide one is used
    mono: Iterator[int] = iter([100, 110, 200, 202, 300, 306])
    wall: Iterator[int] = iter([5_000, 6_000, 7_000])
    off = realtime_offset_ns(lambda: next(mono), lambda: next(wall), tries=3)
    assert off == 6_000 - 201


def test_real_clocks_agree_within_a_millisecond() -> None:
    import time

    off = realtime_offset_ns()
    assert abs(time.time_ns() - (time.monotonic_ns() + off)) < 1_000_000
