"""Load shedding: keep the agent inside a CPU budget by capturing fewer exchanges.

At a load the agent cannot follow, the alternative is worse: the ring fills, records
are dropped in the middle of exchanges, and the agent still takes a whole core from
the server it traces. Instead the kernel captures one exchange in 2^shift
(`capture_shift`, bpf/events.h), decided at each exchange's first byte so a
connection is only ever cut between exchanges; what it skips it counts per process
(`shed`). Each captured span carries `sampling.probability`, so span-derived rates
re-weight to the true rate, and the kernel's count of skipped exchanges is exported.

The shedder looks once per `interval_s` at the agent's own CPU time (all threads:
parsing, span building, exporters) and at records lost in the kernel:
- over the budget: up by ceil(log2(demand / budget)) at once (the agent's cost is about
  proportional to the exchanges it captures), so a sudden flood is met within one
  interval rather than one halving per interval. Demand is the CPU it used, scaled by
  how much faster records arrived than it read them (a saturated reader shows 1 core
  however large the flood); records lost: at least one more;
- under 40% of the budget: shift - 1 (twice as many: still under 80% of the budget).
It raises the shift only for an interval in which the agent read at least `min_bytes` from
the ring: CPU spent while few records arrive (start-up, an exporter retrying, the GPU
sampler) is not the exchanges', and capturing fewer of them would not give it back.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SHIFT = 16  # one exchange in 65536


@dataclass(slots=True)
class SheddingState:
    shift: int = 0
    cpu_cores: float = 0.0  # the agent's CPU use over the last interval
    raised: int = 0  # times the shift went up
    lowered: int = 0


class LoadShedder:
    def __init__(self, set_shift: Callable[[int], None], *, cpu_budget: float,
                 lost: Callable[[], int] = lambda: 0,
                 ring: Callable[[], tuple[int, int]] = lambda: (0, 0), interval_s: float = 1.0,
                 min_bytes: int = 64 * 1024,
                 cpu_time: Callable[[], float] = time.process_time,
                 now: Callable[[], float] = time.monotonic) -> None:
        """`cpu_budget` in cores (0.5: half a core); 0 never sheds."""
        self._set = set_shift
        self.budget = cpu_budget
        self._lost = lost
        self._ring = ring  # (bytes read so far, bytes waiting), from the ring reader
        self._min_bytes = min_bytes
        self._interval = interval_s
        self._cpu = cpu_time
        self._now = now
        self.state = SheddingState()
        self._t0 = now()
        self._c0 = cpu_time()
        self._lost0 = lost()
        self._read0, self._wait0 = ring()

    def tick(self) -> None:
        """Call often (every ring read); acts once per interval."""
        t = self._now()
        dt = t - self._t0
        if dt < self._interval:
            return
        c = self._cpu()
        lost = self._lost()
        read, waiting = self._ring()
        cores = (c - self._c0) / dt
        new_loss = lost > self._lost0
        # records arrived = read + growth of the backlog; the reader kept up with read/arrived
        got = read - self._read0
        arrived = got + max(0, waiting - self._wait0)
        demand = cores * (arrived / got if got > 0 and arrived > got else 1.0)
        self._t0, self._c0, self._lost0 = t, c, lost
        self._read0, self._wait0 = read, waiting
        st = self.state
        st.cpu_cores = cores
        if self.budget <= 0:
            return
        shift = st.shift
        busy = arrived >= self._min_bytes
        if ((demand > self.budget and busy) or new_loss) and shift < MAX_SHIFT:
            up = math.ceil(math.log2(demand / self.budget)) if demand > self.budget else 0
            shift = min(MAX_SHIFT, shift + max(up, 1) + (1 if new_loss and up else 0))
            st.raised += 1
        elif cores < 0.4 * self.budget and shift > 0:
            shift -= 1
            st.lowered += 1
        if shift != st.shift:
            st.shift = shift
            self._set(shift)
