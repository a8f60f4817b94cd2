"""The shedder holds what is queued in the ring to what its budget drains (issue 11), on a
scripted clock, CPU meter and ring."""

from __future__ import annotations

from sits_trace.agent.capture.shedding import LoadShedder


class Rig:
    def __init__(self, budget: float = 0.1) -> None:
        self.t = 0.0
        self.cpu = 0.0
        self.read = 0
        self.waiting = 0
        self.shifts: list[int] = []
        self.s = LoadShedder(self.shifts.append, cpu_budget=budget, cpu_time=lambda: self.cpu,
                             now=lambda: self.t, ring=lambda: (self.read, self.waiting),
                             grace=0)

    def step(self, dt: float, cores: float, read: int, waiting: int) -> None:
        self.t += dt
        self.cpu += dt * cores
        self.read += read
        self.waiting = waiting
        self.s.tick()


def test_a_flood_that_queues_is_met_before_the_interval_ends() -> None:
    r = Rig()
    assert r.s.queue_limit() == 800_000  # 8 MB per CPU-second x 0.1 core x 1 s
    r.step(0.05, 1.0, 2_000_000, 5_000_000)  # too early for a check
    assert r.shifts == []
    r.step(0.06, 1.0, 2_000_000, 16_000_000)  # 20x what 1 s of budget drains: 5 halvings
    assert r.shifts == [5] and r.s.state.queue_raised == 1


def test_the_drain_after_a_queue_raise_does_not_raise_again() -> None:
    r = Rig()
    r.step(0.11, 1.0, 2_000_000, 16_000_000)
    assert r.shifts == [5]
    # the next seconds: a full core draining the 16 MB backlog while 1/32 of the flood arrives
    for _ in range(20):
        r.step(0.1, 1.0, 850_000, max(0, r.waiting - 800_000))
    assert r.s.state.shift == 5, r.shifts


def test_a_backlog_the_budget_drains_in_time_is_left_alone() -> None:
    r = Rig()
    for _ in range(9):
        r.step(0.1, 0.05, 50_000, 90_000)
    r.step(0.05, 0.05, 0, 435_000)  # 200 stream summaries of 2 KiB at once
    r.step(0.1, 0.05, 435_000, 0)
    assert r.shifts == []


def test_the_limit_follows_the_drain_rate_learnt_and_zero_budget_never_sheds() -> None:
    r = Rig()
    r.step(1.0, 0.5, 10_000_000, 0)  # 20 MB per CPU-second measured on a busy interval
    assert r.s.state.drain_bytes_per_cpu_s == 20_000_000
    assert r.s.queue_limit() == 2_000_000
    idle = Rig()  # 0.05 core of mostly fixed cost reading 100 KB: not a measure of the drain
    idle.step(1.0, 0.05, 100_000, 0)
    assert idle.s.state.drain_bytes_per_cpu_s == 8_000_000
    z = Rig(budget=0.0)
    z.step(0.2, 1.0, 1_000_000, 16_000_000)
    assert z.shifts == []
