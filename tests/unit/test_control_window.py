"""Batch-window controllers: the published rule, AIMD and ours, step by step."""

from __future__ import annotations

import pytest
from sits_trace.analyzers.control.window import (
    Aimd,
    BatchLatencyModel,
    Bounds,
    IntervalStats,
    PublishedRule,
    StaticWindow,
    VerdictWindow,
    make_controller,
)


def stats(p95: float | None, done: int = 100, batch: float | None = None,
          queue: float | None = None, arrivals: int | None = None) -> IntervalStats:
    return IntervalStats(duration_s=1.0, completed=done, p95_ms=p95, batch_size=batch,
                         queue_depth=queue, arrivals=arrivals)


def test_static_never_moves() -> None:
    c = StaticWindow(5)
    assert [c.step(stats(p), None) for p in (1, 1e6, None)] == [5, 5, 5]


def test_rule_shrinks_20pct_above_1_2x_target() -> None:
    c = PublishedRule(target_ms=100, window_ms=100, alpha=1.0)
    assert c.step(stats(121), None) == pytest.approx(80)
    assert c.step(stats(121), None) == pytest.approx(64)


def test_rule_holds_between_thresholds_and_without_throughput_rise() -> None:
    c = PublishedRule(target_ms=100, window_ms=100, alpha=1.0)
    assert c.step(stats(110), None) == 100  # between 0.7x and 1.2x
    assert c.step(stats(50, done=100), None) == 100  # low, but throughput flat
    assert c.step(stats(50, done=105), None) == 100  # rose only 5%


def test_rule_grows_15pct_when_low_and_throughput_rose() -> None:
    c = PublishedRule(target_ms=100, window_ms=100, alpha=1.0)
    c.step(stats(50, done=100), None)
    assert c.step(stats(50, done=120), None) == pytest.approx(115)


def test_rule_smooths_and_respects_bounds() -> None:
    c = PublishedRule(target_ms=100, window_ms=12, alpha=0.3)
    c.step(stats(100), None)
    assert c.step(stats(150), None) == 12  # raw 150 > 120, but the EWMA is 115
    assert c.step(stats(150), None) == 10  # EWMA 125.5: shrink 20%, clipped at 10
    assert c.step(stats(1000), None) == 10
    hi = PublishedRule(target_ms=1000, window_ms=490, alpha=1.0)
    hi.step(stats(10, done=10), None)
    assert hi.step(stats(10, done=100), None) == 500


def test_aimd_adds_then_cuts() -> None:
    c = Aimd(target_ms=100, window_ms=20, step_ms=5)
    assert c.step(stats(50), None) == 25
    assert c.step(stats(50), None) == 30
    assert c.step(stats(150), None) == pytest.approx(27)


def test_model_learns_slope_and_forgets() -> None:
    m = BatchLatencyModel(min_points=4)
    assert m.coef() is None
    for size in (1, 2, 4, 8, 1, 2, 4, 8):
        m.add(size, 10 + 3 * size)
    a, b = m.coef() or (0, 0)
    assert a == pytest.approx(10, abs=1e-6) and b == pytest.approx(3, abs=1e-6)
    m.reset()
    assert m.coef() is None


def test_model_needs_spread_in_batch_size() -> None:
    m = BatchLatencyModel(min_points=2)
    for _ in range(10):
        m.add(4, 50)
    assert m.coef() is None


def test_ours_never_grows_for_network_or_cpu_causes() -> None:
    for cause in ("network_delay", "network_loss", "cpu_starvation", "gpu_throttling"):
        c = VerdictWindow(target_ms=100, window_ms=50)
        # a backlog that would otherwise make it grow
        w = c.step(stats(150, batch=4, queue=20), cause)
        assert w <= 50, cause


def test_ours_grows_under_backlog_when_the_rule_shrinks() -> None:
    backlog = stats(300, batch=8, queue=40, arrivals=150, done=100)
    ours = VerdictWindow(target_ms=100, window_ms=20)
    rule = PublishedRule(target_ms=100, window_ms=20)
    assert ours.step(backlog, "server_queueing") > 20
    assert rule.step(backlog, "server_queueing") < 20


def test_ours_shrinks_queueing_only_when_the_wait_is_the_bottleneck() -> None:
    c = VerdictWindow(target_ms=100, window_ms=200)
    # p95 over target, queue within one batch: the batcher's wait is what costs
    assert c.step(stats(220, batch=4, queue=2), "server_queueing") < 200


def test_ours_uses_the_learnt_model_under_light_load() -> None:
    c = VerdictWindow(target_ms=400, window_ms=10, budget=0.5)
    # latency beyond the window = 20 + 5 * batch; 100 req/s
    for w, size in ((10, 1), (20, 2), (40, 4), (60, 6), (80, 8), (100, 10)):
        c.window_ms = w
        c.step(stats(w + 20 + 5 * size, batch=size, queue=0, arrivals=100), None)
    c.window_ms = 50
    nxt = c.step(stats(50 + 20 + 25, batch=5, queue=0, arrivals=100), None)
    # largest w with w + 20 + 5*(0.1 w) <= 200 is 120; one step moves at most 1.5x
    assert nxt == pytest.approx(75, rel=0.02)
    assert "model" in c.last_reason


def test_idle_interval_keeps_the_window() -> None:
    for c in (PublishedRule(100, 30), Aimd(100, 30), VerdictWindow(100, 30)):
        assert c.step(stats(None, done=0), None) == 30


def test_make_controller_names() -> None:
    b = Bounds()
    assert isinstance(make_controller("rule", 100, 20, b), PublishedRule)
    assert isinstance(make_controller("verdict", 100, 20, b), VerdictWindow)
    with pytest.raises(ValueError, match="unknown controller"):
        make_controller("pid", 100, 20, b)


def test_ours_learns_that_waiting_does_not_pay_and_goes_to_the_floor() -> None:
    # continuous batching: the batch size follows the load, not the window
    c = VerdictWindow(target_ms=500, window_ms=100, bounds=Bounds(2, 500))
    for _ in range(30):
        c.step(stats(150, batch=6, queue=0, arrivals=100), None)
    assert c.batching_pays() is False
    assert c.window_ms == 2
    # a backlog does not make it grow again: larger windows were seen to buy nothing
    c.step(stats(900, batch=6, queue=30, arrivals=150), "server_queueing")
    assert c.window_ms == 2 and "does not make larger batches" in c.last_reason


def test_ours_grows_when_waiting_does_make_larger_batches() -> None:
    c = VerdictWindow(target_ms=500, window_ms=40, bounds=Bounds(2, 500))
    for w in (40, 30, 20, 10, 20, 30, 40):  # batches grow with the window: 1 per 5 ms
        c.window_ms = w
        c.step(stats(w + 50, batch=w / 5, queue=0, arrivals=200), None)
    assert c.batching_pays() is True
    c.window_ms = 40
    assert c.step(stats(900, batch=8, queue=30, arrivals=300), "server_queueing") == 60


def test_ours_spends_the_headroom_before_it_knows() -> None:
    # it cannot tell yet whether waiting pays: the window takes what the latency budget
    # (0.7 x the target) leaves beyond the server's own 40 ms, at most 1.5x per interval
    c = VerdictWindow(target_ms=500, window_ms=100)
    assert c.batching_pays() is None
    assert c.step(stats(140, batch=4, queue=0), None) == pytest.approx(150)
    assert "headroom" in c.last_reason
    assert c.step(stats(190, batch=4, queue=0), None) == pytest.approx(225)
    assert c.step(stats(265, batch=4, queue=0), None) == pytest.approx(310)
    assert c.step(stats(350, batch=4, queue=0), None) == pytest.approx(310)
    # the server's latency rises with the window unchanged: queueing, which a shorter
    # window does not cure; it holds
    assert c.step(stats(440, batch=4, queue=0), None) == pytest.approx(310)
    assert "not the window's" in c.last_reason
    # a window that alone is past the budget comes down to it
    c = VerdictWindow(target_ms=500, window_ms=400)
    assert c.step(stats(410, batch=1, queue=0), None) == pytest.approx(350)


def test_ours_cannot_tell_whether_waiting_pays_from_a_light_load_and_grows_on_a_backlog() -> None:
    # 4 requests/s: windows of tens of ms expect a fraction of an arrival each, whatever the
    # batcher; a window batcher's batches stay at ~1 here, which says nothing about a heavier
    # load. The window takes the headroom (0.7 x the 100 ms target, less the server's 10 ms)
    c = VerdictWindow(target_ms=100, window_ms=20, bounds=Bounds(2, 500))
    for _ in range(20):
        c.step(stats(c.window_ms + 10, done=4, batch=1.0, queue=0, arrivals=4), None)
    assert c.window_ms == pytest.approx(60) and c.batching_pays() is None
    # the load steps up and the window batcher falls behind: grow, but never past 0.8 x the
    # target (the first request of each batch would miss it)
    # (batches of 1 + what a window gathers at 25 requests/s)
    assert c.step(stats(400, done=8, batch=2.5, queue=6, arrivals=25), None) == 80
    assert "capacity is short" in c.last_reason and "capped at 80 ms" in c.last_reason
    assert c.step(stats(500, done=8, batch=3.0, queue=90, arrivals=25), None) == 80


def test_ours_grows_when_the_load_rises_past_what_the_window_keeps_up_with() -> None:
    # a window batcher just past capacity: few requests wait for their first call (no backlog
    # by queue depth), but each waits its turn behind the running batches. A shorter window
    # would mean more, smaller batches: ours grows; the rule shrinks
    ours = VerdictWindow(target_ms=100, window_ms=30, bounds=Bounds(2, 500))
    rule = PublishedRule(target_ms=100, window_ms=30)
    for c in (ours, rule):
        for _ in range(5):  # the server adds 60 ms at this load: no headroom to spend
            c.step(stats(90, done=8, batch=1.2, queue=0, arrivals=8), None)
    hot = stats(300, done=20, batch=1.7, queue=1, arrivals=22)
    assert ours.step(hot, None) == 45 and "the load rose" in ours.last_reason
    assert rule.step(hot, None) < 30
    # the same P95 at the load the window was set for: most of the excess is not the
    # window's, and a shorter window would take back little of it: hold
    c = VerdictWindow(target_ms=100, window_ms=30, bounds=Bounds(2, 500))
    for _ in range(5):
        c.step(stats(90, done=20, batch=1.7, queue=0, arrivals=20), None)
    for _ in range(3):
        assert c.step(stats(180, done=20, batch=1.7, queue=0, arrivals=20), None) == 30
    assert "more than the window could take back" in c.last_reason
    # over the target by less than half the window: the window is the bottleneck
    c = VerdictWindow(target_ms=100, window_ms=90, bounds=Bounds(2, 500))
    assert c.step(stats(130, done=20, batch=3, queue=1, arrivals=22), None) == pytest.approx(63)
    assert "wait-bound" in c.last_reason


def test_ours_stops_growing_while_the_backlog_it_grew_for_drains() -> None:
    c = VerdictWindow(target_ms=100, window_ms=10, bounds=Bounds(2, 500))
    # a window batcher at 25 requests/s: batches of 1 + what 10 ms gathers
    assert c.step(stats(400, batch=1.2, queue=20, arrivals=25), None) == 20  # deep: twice
    assert c.step(stats(600, batch=1.5, queue=12, arrivals=25), None) == 20  # draining: hold
    assert "no longer growing" in c.last_reason
    assert c.step(stats(600, batch=1.5, queue=14, arrivals=25), None) == 40  # growing again


def test_ours_does_not_shrink_back_to_a_window_that_fell_behind() -> None:
    c = VerdictWindow(target_ms=100, window_ms=50, bounds=Bounds(2, 500))
    for w in (50, 40, 30, 20, 10, 20, 30, 40, 50):  # a window batcher: batch = 1 + rate x window
        c.window_ms = w
        c.step(stats(60, done=20, batch=1 + 20 * w / 1000, queue=0, arrivals=20), None)
    assert c.batching_pays() is True
    c.window_ms = 40
    c.step(stats(400, done=20, batch=1.8, queue=30, arrivals=25), None)  # behind at 40 ms
    w = c.window_ms
    assert w > 40
    # caught up, but the first request of each batch waits the window: P95 over the target.
    # A wait-bound shrink would fall behind again: it stops at 1.2 x the window that did
    reasons = []
    for _ in range(5):
        c.step(stats(c.window_ms + 30, done=25, batch=1 + 25 * c.window_ms / 1000, queue=0,
                     arrivals=25), None)
        reasons.append(c.last_reason)
    assert c.window_ms == pytest.approx(48)
    assert any("held above 40 ms" in r for r in reasons)
    # the load falls away: the memory goes, and the window that makes requests miss shrinks
    for _ in range(8):
        c.step(stats(c.window_ms * 2 + 20, done=5, batch=1.2, queue=0, arrivals=5), None)
    assert c.window_ms < 40


def test_ours_sees_at_once_that_batches_are_not_made_by_the_window() -> None:
    # continuous batching at 7 requests/s and a 2 ms window: batches of 12 running sequences,
    # where a window gathers 1.01 requests; no spread in the window is needed to see it
    c = VerdictWindow(target_ms=100, window_ms=2, bounds=Bounds(2, 500))
    for _ in range(3):
        c.step(stats(60, done=7, batch=12, queue=0, arrivals=7), None)
    assert c.batching_pays() is False
    c.step(stats(300, done=7, batch=12, queue=30, arrivals=9), "server_queueing")
    assert c.window_ms == 2 and "does not make larger batches" in c.last_reason
    # a window batcher at the same load gathers what the window holds: it cannot tell yet
    w = VerdictWindow(target_ms=100, window_ms=2, bounds=Bounds(2, 500))
    for _ in range(3):
        w.step(stats(60, done=7, batch=1.0, queue=0, arrivals=7), None)
    assert w.batching_pays() is None


@pytest.mark.parametrize("ttl", [240, 0])
def test_ours_remembers_that_waiting_does_not_pay_once_the_window_stops_varying(ttl: int) -> None:
    # continuous batching at 7 requests/s with two sequences running: batches of 2 are no more
    # than a window gathers, so only the fit can tell. The headroom makes the window vary,
    # the fit sees batches that do not grow, the window goes to its floor; there its spread
    # fades from the fit, and without the fit's last answer it would spend the headroom again
    c = VerdictWindow(target_ms=250, window_ms=30, bounds=Bounds(2, 500), verdict_ttl=ttl)
    windows = []
    for _ in range(150):
        c.step(stats(c.window_ms + 20, done=7, batch=2, queue=0, arrivals=7), None)
        windows.append(c.window_ms)
    assert max(windows[:20]) > 100  # the headroom was spent before it could tell
    if ttl:
        assert c.batching_pays() is False and max(windows[60:]) == 2
    else:
        assert max(windows[60:]) > 50  # what the memory prevents: probing again
