"""CPU actuator: throttle a culprit process through the cpu cgroup controller, reversibly.

For cpu_starvation, pcie_contention (a process that issues bulk copies slows when its CPU is
capped) and gpu_compute_contention (likewise for its launches), the culprit named by the RCA
moves, with its descendants, into a fresh cgroup beside its own, `sits-trace-throttle-<pid>`,
capped at `cpu_fraction` of one CPU and weighted `weight` (100 = the default share). Bounded:
at most `max_actions` at once, never pid 1, the agent, a kernel thread or a protected pid
(the served processes), never below 5% of a CPU. Reversible: `revert` moves every process
still alive back where it came from and removes the cgroup; what was done is also written to
a state file, so an agent that died is undone by the next one's `revert_stale()`.

cgroup v2 (`cpu.max`, `cpu.weight`) and v1 (`cpu.cfs_quota_us`, `cpu.shares`) are both
handled: which one is found by reading mountinfo, not by kernel version.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

PREFIX = "sits-trace-throttle-"
PERIOD_US = 100_000


class ActuatorError(RuntimeError):
    """An action cannot be planned or applied; the message says why."""


@dataclass(frozen=True)
class CpuHierarchy:
    """Where the cpu controller is mounted and in which cgroup version."""

    mount: Path
    version: Literal[1, 2]


def find_cpu_hierarchy(proc_root: Path = Path("/proc")) -> CpuHierarchy | None:
    try:
        text = (proc_root / "self" / "mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        fstype, _src, opts = (post.split() + ["", "", ""])[:3]
        mnt = Path(pre.split()[4])
        if fstype == "cgroup" and "cpu" in opts.split(","):
            return CpuHierarchy(mnt, 1)
        if fstype == "cgroup2" and "cpu" in _read(mnt / "cgroup.controllers").split():
            return CpuHierarchy(mnt, 2)
    return None


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


@dataclass
class CpuAction:
    """One throttle: who, why, where it was, where it is, what was written."""

    cause: str
    pid: int
    name: str
    cgroup: str  # ours, relative to the mount ("/a/sits-trace-throttle-123")
    origin: dict[int, str] = field(default_factory=dict)  # pid -> its cgroup before
    cpu_fraction: float = 0.25
    weight: int = 10
    applied: bool = False
    started_unix: float = 0.0
    low_since: float | None = None  # monotonic; the culprit's demand under half its cap since
    last_demand_ns: int | None = None  # schedstat run + wait ns at the last check
    last_check: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": "cpu_throttle", "cause": self.cause, "pid": self.pid, "name": self.name,
                "cgroup": self.cgroup, "cpu_fraction": self.cpu_fraction, "weight": self.weight,
                "applied": self.applied, "pids": sorted(self.origin),
                "started_unix": self.started_unix}


class CgroupCpuActuator:
    def __init__(self, hierarchy: CpuHierarchy, *, proc_root: Path = Path("/proc"),
                 cpu_fraction: float = 0.25, weight: int = 10, max_actions: int = 4,
                 protected: set[int] | None = None, state_path: Path | None = None,
                 wall: Callable[[], float] = time.time,
                 remove_dir: Callable[[Path], None] = Path.rmdir) -> None:
        self.h = hierarchy
        self._remove_dir = remove_dir
        self.proc = proc_root
        self.cpu_fraction = max(0.05, cpu_fraction)
        self.weight = min(100, max(1, weight))
        self.max_actions = max_actions
        self.protected: set[int] = set(protected or ()) | {1, os.getpid()}
        self.state_path = state_path
        self._wall = wall
        self.active: dict[int, CpuAction] = {}

    # -- planning --------------------------------------------------------------------------

    def plan(self, cause: str, pid: int, name: str = "") -> CpuAction:
        """What would be done to `pid`; ActuatorError when it must not or cannot be."""
        if pid in self.protected:
            raise ActuatorError(f"pid {pid} is protected (pid 1, the agent or a served process)")
        if pid in self.active:
            raise ActuatorError(f"pid {pid} is already throttled")
        if len(self.active) >= self.max_actions:
            raise ActuatorError(f"already {len(self.active)} actions (control.max_actions)")
        stat = _read(self.proc / str(pid) / "stat")
        if not stat:
            raise ActuatorError(f"pid {pid} does not exist")
        if _is_kernel_thread(stat):
            raise ActuatorError(f"pid {pid} is a kernel thread")
        comm = name or stat[stat.find("(") + 1:stat.rfind(")")]
        home = self.cgroup_of(pid)
        parent = home.rsplit("/", 1)[0] if home not in ("", "/") else ""
        return CpuAction(cause=cause, pid=pid, name=comm, cgroup=f"{parent}/{PREFIX}{pid}",
                         cpu_fraction=self.cpu_fraction, weight=self.weight)

    def cgroup_of(self, pid: int) -> str:
        for line in _read(self.proc / str(pid) / "cgroup").splitlines():
            hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
            if (self.h.version == 2 and hid == "0") or \
                    (self.h.version == 1 and "cpu" in ctrls.split(",")):
                return path
        return "/"

    # -- doing and undoing -----------------------------------------------------------------

    def apply(self, action: CpuAction) -> CpuAction:
        """Create the cgroup, write its limits, move the culprit and its descendants in."""
        d = self._dir(action.cgroup)
        try:
            if self.h.version == 2:
                self._enable_cpu(d.parent)
            d.mkdir(exist_ok=True)
            self._write_limits(d, action)
            for pid in [action.pid, *self._descendants(action.pid)]:
                home = self.cgroup_of(pid)
                if self._move(pid, d):
                    action.origin[pid] = home
        except OSError as e:
            self._undo(action)
            raise ActuatorError(f"cannot throttle pid {action.pid} in {d}: "
                                f"{e.strerror or e}") from None
        if action.pid not in action.origin:
            self._undo(action)
            raise ActuatorError(f"pid {action.pid} exited before it could be moved")
        action.applied = True
        action.started_unix = self._wall()
        self.active[action.pid] = action
        self._save()
        return action

    def revert(self, pid: int) -> CpuAction | None:
        action = self.active.pop(pid, None)
        if action is not None:
            self._undo(action)
            action.applied = False
            self._save()
        return action

    def revert_all(self) -> list[CpuAction]:
        return [a for a in (self.revert(p) for p in list(self.active)) if a is not None]

    def revert_stale(self) -> int:
        """Undo what a previous agent left (from the state file); how many were undone."""
        if self.state_path is None:
            return 0
        try:
            saved = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return 0
        n = 0
        for raw in saved if isinstance(saved, list) else []:
            try:
                origin = {int(k): str(v) for k, v in raw.pop("origin").items()}
                self._undo(CpuAction(**raw, origin=origin))
                n += 1
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
        self._save()
        return n

    # -- is the cause still there? ---------------------------------------------------------

    def demand_cpus(self, action: CpuAction, now: float) -> float | None:
        """CPUs the throttled processes wanted since the last call: time on a CPU plus time
        runnable and waiting for one (schedstat), so a culprit held back by its cap or its
        weight still shows its full demand. None on the first call."""
        ns = self._demand_ns(self._dir(action.cgroup))
        prev, prev_t = action.last_demand_ns, action.last_check
        action.last_demand_ns, action.last_check = ns, now
        if prev is None or prev_t is None or now <= prev_t:
            return None
        return max(0, ns - prev) / 1e9 / (now - prev_t)

    def alive(self, action: CpuAction) -> bool:
        procs = _read(self._dir(action.cgroup) / "cgroup.procs").split()
        return bool(procs)

    # -- cgroup files ----------------------------------------------------------------------

    def _dir(self, cgroup: str) -> Path:
        return self.h.mount / cgroup.lstrip("/")

    def _enable_cpu(self, parent: Path) -> None:
        if "cpu" not in _read(parent / "cgroup.subtree_control").split():
            (parent / "cgroup.subtree_control").write_text("+cpu")

    def _write_limits(self, d: Path, a: CpuAction) -> None:
        quota = int(a.cpu_fraction * PERIOD_US)
        if self.h.version == 2:
            (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            (d / "cpu.weight").write_text(str(a.weight))
        else:
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
            (d / "cpu.shares").write_text(str(max(2, a.weight * 1024 // 100)))

    def _demand_ns(self, d: Path) -> int:
        total = 0
        for pid in _read(d / "cgroup.procs").split():
            try:
                tasks = list((self.proc / pid / "task").iterdir())
            except OSError:
                continue
            for task in tasks:
                fields = _read(task / "schedstat").split()
                if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
                    total += int(fields[0]) + int(fields[1])
        return total

    def _move(self, pid: int, d: Path) -> bool:
        try:
            (d / "cgroup.procs").write_text(str(pid))
            return True
        except OSError as e:
            if e.errno == errno.ESRCH:
                return False  # exited meanwhile
            raise

    def _undo(self, a: CpuAction) -> None:
        d = self._dir(a.cgroup)
        if not d.exists():
            return
        for pid_s in _read(d / "cgroup.procs").split():
            pid = int(pid_s)
            self._move_back(pid, a.origin.get(pid, a.origin.get(a.pid, "/")))
        for _ in range(50):  # a process killed a moment ago may still be leaving
            try:
                self._remove_dir(d)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)

    def _move_back(self, pid: int, home: str) -> None:
        for target in (home, "/"):  # the home cgroup may have gone meanwhile
            try:
                self._move(pid, self._dir(target))
                return
            except OSError:
                continue

    def _descendants(self, pid: int) -> list[int]:
        return descendants(self.proc, pid)

    def _save(self) -> None:
        if self.state_path is None:
            return
        rows = []
        for a in self.active.values():
            row = asdict(a)
            row["origin"] = {str(k): v for k, v in a.origin.items()}
            rows.append(row)
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(self.state_path)
        except OSError:
            pass  # the state file helps a crashed agent's successor; never fatal


def descendants(proc_root: Path, pid: int) -> list[int]:
    """Every process below `pid` (by the parent pid in /proc/<pid>/stat), nearest first."""
    parent: dict[int, int] = {}
    for d in proc_root.iterdir():
        if d.name.isdigit():
            stat = _read(d / "stat")
            if stat:
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], {pid}
    while frontier:
        kids = {c for c, p in parent.items() if p in frontier and c not in out}
        out.extend(sorted(kids))
        frontier = kids
    return out


def _is_kernel_thread(stat: str) -> bool:
    """PF_KTHREAD (0x00200000) in the flags field of /proc/<pid>/stat."""
    try:
        flags = int(stat.rsplit(")", 1)[1].split()[6])
    except (IndexError, ValueError):
        return False
    return bool(flags & 0x00200000)
