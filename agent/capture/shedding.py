"""Load shedding: keep the agent inside a CPU budget by capturing fewer exchanges.

At a load the agent cannot follow, the alternative is worse: the ring fills, records
are dropped in the middle of exchanges, and the agent still takes a whole core from
the server it traces. Instead the kernel captures one exchange in 2^shift
(`capture_shift`, bpf/events.h), decided at each exchange's first byte so a
connection is only ever cut between exchanges; what it skips it counts per process
(`shed`). Each captured span carries `sampling.probability`, so span-derived rates
re-weight to the true rate, and the kernel's count of skipped exchanges is exported.

The shedder looks once per `interval_s` at the agent's own CPU time (all threads:
parsing, span building, exporters), at records lost in the kernel and at the exchanges
offered (captured + skipped, bpf/events.h `exchange_seq`):
- the agent's fixed cost (timers, the GPU sampler, an idle exporter) is learnt from quiet
  intervals (< `min_bytes` read from the ring) and taken off: only the exchange-driven cost
  `excess = demand - base` counts against the budget (an idle agent's 0.05 core must not
  keep a 0.1-core budget "full");
- over the budget: up by ceil(log2(excess / budget)) at once (the agent's cost is about
  proportional to the exchanges it captures), so a sudden flood is met within one
  interval rather than one halving per interval. Demand is the CPU it used, scaled by
  how much faster records arrived than it read them (a saturated reader shows 1 core
  however large the flood); records lost: at least one more;
- under 40% of the budget: down by as many halvings as keep it under 80% of the budget
  (all the way to 0 when the exchanges stopped), so tracing is back within an interval
  or two of an attack ending;
- a node offered fewer than `min_exchanges_per_s` exchanges is never sampled (a handful of
  requests or SSE streams a second is cheap to trace whatever their bytes cost).
It raises the shift only for an interval in which the agent read at least `min_bytes` from
the ring: CPU spent while few records arrive (start-up, an exporter retrying, the GPU
sampler) is not the exchanges', and capturing fewer of them would not give it back. Nor for
its CPU in the first `grace` intervals (2): the agent's start-up work (first decodes, lazy
imports, exporters connecting) lands there, and under traffic that never pauses the shift it
raised could not come down (no quiet interval to learn the fixed cost from: 200 SSE streams
at 0.05 core shed 901 streams in one round of three, before). Lost records and the queue
raise the shift from the start.

What is queued is controlled too, between intervals: every `queue_check_s` the backlog
waiting in the ring is held against what the budget drains in `queue_s`: bytes the agent
reads per CPU-second of exchange-driven work (learnt from busy intervals, never below the
default) times the budget, 0.8 MB at 0.1 core by default, so 200 SSE summaries landing
together are no flood. A backlog over that, and still growing, raises the shift at once
by ceil(log2(backlog / allowed)), so the ring does not hold seconds of exchanges captured
before the shift rose (16 MiB of them, drained at a full core, was the 7x overshoot of
issue 11). The interval that follows a queue raise
and those after it while the backlog still shrinks, count as demand only what arrived
meanwhile, not the drain; then the interval rule settles the shift.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SHIFT = 16  # one exchange in 65536


@dataclass(slots=True)
class SheddingState:
    shift: int = 0
    cpu_cores: float = 0.0  # the agent's CPU use over the last interval
    base_cores: float = -1.0  # its learnt fixed cost (-1: no quiet interval yet)
    exchanges_per_s: float = 0.0  # offered over the last interval (captured + skipped)
    raised: int = 0  # times the shift went up
    lowered: int = 0
    queue_raised: int = 0  # of the raises, those made because the ring's backlog grew
    drain_bytes_per_cpu_s: float = 0.0  # learnt: ring bytes the agent reads per CPU-second


class LoadShedder:
    def __init__(self, set_shift: Callable[[int], None], *, cpu_budget: float,
                 lost: Callable[[], int] = lambda: 0,
                 ring: Callable[[], tuple[int, int]] = lambda: (0, 0), interval_s: float = 1.0,
                 min_bytes: int = 64 * 1024,
                 exchanges: Callable[[], int] | None = None,
                 min_exchanges_per_s: float = 50.0,
                 cpu_time: Callable[[], float] = time.process_time,
                 now: Callable[[], float] = time.monotonic,
                 queue_s: float = 1.0, queue_check_s: float = 0.1,
                 default_drain_bytes_per_cpu_s: float = 8e6,
                 grace: int = 2) -> None:
        """`cpu_budget` in cores (0.5: half a core); 0 never sheds. `exchanges`: the
        kernel's count of exchanges offered so far (None: unknown, no rate floor)."""
        self._set = set_shift
        self.budget = cpu_budget
        self._lost = lost
        self._ring = ring  # (bytes read so far, bytes waiting), from the ring reader
        self._min_bytes = min_bytes
        self._exchanges = exchanges
        self._min_rate = min_exchanges_per_s
        self._interval = interval_s
        self._cpu = cpu_time
        self._now = now
        self.state = SheddingState()
        self._t0 = now()
        self._grace = grace  # intervals left whose CPU does not raise the shift
        self._c0 = cpu_time()
        self._lost0 = lost()
        self._read0, self._wait0 = ring()
        self._ex0 = exchanges() if exchanges is not None else 0
        self._queue_s = queue_s
        self._queue_check = queue_check_s
        self._q_t = self._t0
        self._draining = False  # a queue raise happened in this interval
        self._q_wait = 0  # backlog at the last queue check
        self._default_drain = default_drain_bytes_per_cpu_s
        self.state.drain_bytes_per_cpu_s = default_drain_bytes_per_cpu_s

    def queue_limit(self) -> float:
        """Backlog bytes the budget drains in queue_s (never below min_bytes)."""
        return max(float(self._min_bytes),
                   self.state.drain_bytes_per_cpu_s * self.budget * self._queue_s)

    def _check_queue(self, t: float) -> None:
        if t - self._q_t < self._queue_check or self.budget <= 0:
            return
        self._q_t = t
        st = self.state
        waiting = self._ring()[1]
        limit = self.queue_limit()
        grew = waiting > self._q_wait
        self._q_wait = waiting
        # a backlog over the limit that shrinks is one queued before the last raise draining
        if waiting <= limit or not grew or st.shift >= MAX_SHIFT:
            return
        st.shift = min(MAX_SHIFT, st.shift + max(1, math.ceil(math.log2(waiting / limit))))
        st.raised += 1
        st.queue_raised += 1
        self._set(st.shift)
        # the next interval is measured from here, as a drain of what was queued before
        self._t0, self._c0, self._lost0 = t, self._cpu(), self._lost()
        self._read0, self._wait0 = self._ring()
        self._ex0 = self._exchanges() if self._exchanges is not None else 0
        self._draining = True

    def tick(self) -> None:
        """Call often (every ring read); acts once per interval, and on the backlog once
        per queue_check_s."""
        t = self._now()
        dt = t - self._t0
        if dt < self._interval:
            self._check_queue(t)
            return
        self._q_t = t
        c = self._cpu()
        lost = self._lost()
        read, waiting = self._ring()
        ex = self._exchanges() if self._exchanges is not None else 0
        cores = (c - self._c0) / dt
        new_loss = lost > self._lost0
        # records arrived = read + growth of the backlog; the reader kept up with read/arrived
        got = read - self._read0
        arrived = got + max(0, waiting - self._wait0)
        demand = cores * (arrived / got if got > 0 and arrived > got else 1.0)
        if self._draining and got > 0:
            # after a queue raise the reader spent the interval on the backlog captured
            # before it: only what arrived meanwhile is the new shift's cost
            demand = cores * max(0, got + waiting - self._wait0) / got
            # still draining while the backlog shrinks (a 16 MiB ring takes seconds)
            self._draining = 0 < waiting < self._wait0
        rate = (ex - self._ex0) / dt if self._exchanges is not None else math.inf
        self._t0, self._c0, self._lost0, self._ex0 = t, c, lost, ex
        self._read0, self._wait0 = read, waiting
        st = self.state
        st.cpu_cores = cores
        st.exchanges_per_s = rate if rate != math.inf else 0.0
        busy = arrived >= self._min_bytes
        if not busy:
            self._learn_base(cores)
        else:
            self._learn_drain(got, cores - max(st.base_cores, 0.0), dt)
        if self.budget <= 0:
            return
        start_up = self._grace > 0
        self._grace -= 1
        self._decide(max(0.0, demand - max(st.base_cores, 0.0)), busy and not start_up,
                     new_loss, rate)

    def _learn_drain(self, got: int, driven: float, dt: float) -> None:
        """Bytes read per CPU-second of exchange-driven work, from intervals where that work
        is a fair share of the budget (an agent mostly idle would measure its fixed costs);
        never below the default, so a burst the agent reads easily is not a flood."""
        if got > 0 and driven > 0.25 * self.budget:
            self.state.drain_bytes_per_cpu_s = max(self._default_drain, got / (driven * dt))

    def _learn_base(self, cores: float) -> None:
        """The fixed cost: falls at once to a lower quiet reading, rises slowly, and never
        counts for more than half the budget (a busy exporter is not free)."""
        st = self.state
        base = cores if st.base_cores < 0 else min(cores, 0.7 * st.base_cores + 0.3 * cores)
        st.base_cores = min(base, 0.5 * self.budget) if self.budget > 0 else base

    def _decide(self, excess: float, busy: bool, new_loss: bool, rate: float) -> None:
        st = self.state
        shift = st.shift
        if rate < self._min_rate:
            shift = 0  # a handful of exchanges a second: never sampled
        elif ((excess > self.budget and busy) or new_loss) and shift < MAX_SHIFT:
            up = math.ceil(math.log2(excess / self.budget)) if excess > self.budget else 0
            shift = min(MAX_SHIFT, shift + max(up, 1) + (1 if new_loss and up else 0))
        elif excess < 0.4 * self.budget and shift > 0:
            # each halving of the shift doubles the exchange-driven cost: as many as fit
            room = 0.8 * self.budget / excess if excess > 0 else math.inf
            down = shift if room == math.inf else max(1, int(math.log2(room)))
            shift = max(0, shift - down)
        if shift > st.shift:
            st.raised += 1
        elif shift < st.shift:
            st.lowered += 1
        if shift != st.shift:
            st.shift = shift
            self._set(shift)
