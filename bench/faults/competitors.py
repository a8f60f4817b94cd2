"""Real resource competitors (stress-ng) placed so that they bite, each with its culprit label.

CPU: with autogroup on, a busy process in another session only takes its own autogroup's
share, so it barely slows the victim. The competitor must share the victim's scheduling
group. `start_cpu_competitor` picks the first placement that does:
  cgroup       the victim is in a non-root cpu cgroup: the competitor joins that cgroup;
  session      the victim is in the root cpu cgroup and in our autogroup (or autogroup is
               off): a plain child of ours lands in the same group;
  cgroup-move  otherwise: a fresh cpu cgroup takes the victim (and its descendants) and the
               competitor; `stop()` moves them back and removes it.
Memory: `start_memory_competitor` holds and keeps rewriting a fraction of MemAvailable,
bounded so that at least `reserve_bytes` stay available.
Every stress-ng gets a `--timeout`, so nothing outlives a crashed harness by much.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

GiB = 1 << 30
Placement = Literal["cgroup", "session", "cgroup-move", "host"]


class CompetitorError(RuntimeError):
    """A competitor cannot be started as asked; the message says why."""


@dataclass
class Competitor:
    """A running competitor: its pid and name are the culprit label."""

    kind: str
    popen: subprocess.Popen[bytes]
    name: str
    placement: Placement
    detail: dict[str, object] = field(default_factory=dict)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def culprit(self, proc_root: Path = Path("/proc")) -> dict[str, object]:
        return {"pid": self.pid, "name": self.name, "pids": [self.pid, *children(self.pid, proc_root)]}

    def stop(self) -> None:
        """Stop it (its whole process group) and undo any cgroup move. Idempotent."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(5)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        while self._undo:
            self._undo.pop()()


# -- /proc and cgroup helpers ------------------------------------------------------------


def schedstat(pid: int, proc_root: Path = Path("/proc")) -> tuple[int, int, int]:
    """(on-CPU ns, run-queue wait ns, timeslices) summed over the threads of `pid`."""
    run = wait = slices = 0
    for task in (proc_root / str(pid) / "task").iterdir():
        try:
            a, b, c = (int(x) for x in (task / "schedstat").read_text().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        run, wait, slices = run + a, wait + b, slices + c
    return run, wait, slices


def children(pid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """All descendants of `pid`, found by walking the ppid of every process."""
    parent: dict[int, int] = {}
    for d in proc_root.iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier]
        out.extend(kids)
        frontier = kids
    return out


def mem_available(proc_root: Path = Path("/proc")) -> int:
    for line in (proc_root / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise CompetitorError("no MemAvailable in /proc/meminfo")


def cpu_hierarchy(proc_root: Path = Path("/proc")) -> tuple[Path, Literal[1, 2]] | None:
    """Mount point of the hierarchy that has the cpu controller, and its cgroup version."""
    return hierarchy("cpu", proc_root)


def hierarchy(controller: str, proc_root: Path = Path("/proc")
              ) -> tuple[Path, Literal[1, 2]] | None:
    """Mount point of the hierarchy that has `controller`, and its cgroup version."""
    for line in (proc_root / "self" / "mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype, _src, opts = (post.split() + ["", "", ""])[:3]
        mnt = Path(pre.split()[4])
        if fstype == "cgroup" and controller in opts.split(","):
            return mnt, 1
        if fstype == "cgroup2" and controller in _read(mnt / "cgroup.controllers").split():
            return mnt, 2
    return None


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def cpu_cgroup_of(pid: int, version: int, proc_root: Path = Path("/proc")) -> str:
    """The victim's path in the cpu hierarchy ('/' is the root)."""
    return cgroup_of(pid, version, "cpu", proc_root)


def cgroup_of(pid: int | str, version: int, controller: str,
              proc_root: Path = Path("/proc")) -> str:
    """A process's path in the hierarchy of `controller` ('/' is the root)."""
    for line in (proc_root / str(pid) / "cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if (version == 2 and hid == "0") or (version == 1 and controller in ctrls.split(",")):
            return path
    return "/"


def autogroup_of(pid: int | str, proc_root: Path = Path("/proc")) -> str:
    return _read(proc_root / str(pid) / "autogroup").split(" nice")[0].strip()


def autogroup_enabled(proc_root: Path = Path("/proc")) -> bool:
    return _read(proc_root / "sys/kernel/sched_autogroup_enabled").strip() == "1"


def _join_cgroup(cg_dir: Path) -> Callable[[], None]:
    procs = cg_dir / "cgroup.procs"

    def join() -> None:  # in the child, before exec: its workers are forked inside
        procs.write_text(str(os.getpid()))

    return join


# -- CPU ---------------------------------------------------------------------------------


def _stress_argv(args: list[str], timeout_s: float) -> list[str]:
    exe = shutil.which("stress-ng")
    if exe is None:
        raise CompetitorError("stress-ng is not installed (apt-get install stress-ng)")
    return [exe, *args, "--timeout", f"{max(1, int(timeout_s + 0.999))}s", "-q"]


def choose_placement(victim: int, proc_root: Path = Path("/proc")
                     ) -> tuple[Placement, Path | None]:
    """How to share the victim's scheduling group (see the module doc), and the cgroup dir."""
    hier = cpu_hierarchy(proc_root)
    if hier is not None:
        mnt, ver = hier
        path = cpu_cgroup_of(victim, ver, proc_root)
        if path != "/":
            return "cgroup", mnt / path.lstrip("/")
    if not autogroup_enabled(proc_root) or autogroup_of(victim, proc_root) == autogroup_of(
            "self", proc_root):
        return "session", None
    if hier is None:
        raise CompetitorError(
            "victim is in another autogroup and no cpu cgroup hierarchy is mounted: "
            "start the victim from this process's session")
    return "cgroup-move", hier[0]


def start_cpu_competitor(victim_pid: int, intensity: float = 1.0, duration_s: float = 60.0,
                         placement: Placement | None = None,
                         proc_root: Path = Path("/proc")) -> Competitor:
    """stress-ng CPU hogs sharing `victim_pid`'s scheduling group.

    intensity: busy workers per online CPU (1.0 on 2 CPUs: 2 workers at 100%).
    duration_s: stress-ng's own timeout, a safety net; call `stop()` to end earlier."""
    if not os.path.isdir(proc_root / str(victim_pid)):
        raise CompetitorError(f"no process {victim_pid}")
    workers = max(1, round(intensity * (os.cpu_count() or 1)))
    chosen, cg = choose_placement(victim_pid, proc_root) if placement is None else (
        placement, None)
    argv = _stress_argv(["--cpu", str(workers), "--cpu-load", "100"], duration_s)
    undo: list[Callable[[], None]] = []
    if chosen == "cgroup-move":
        cg = _move_into_new_cgroup(victim_pid, cg, undo, proc_root)
    preexec = _join_cgroup(cg) if cg is not None else None
    # a new process group for clean killing, but the same session: setsid would make a
    # new autogroup and the competitor would stop competing
    p = subprocess.Popen(argv, preexec_fn=preexec, process_group=0,  # noqa: PLW1509 (no threads fork here; 3.11 has no cgroup= for Popen)
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    comp = Competitor("cpu_starvation", p, "stress-ng", chosen,
                      {"workers": workers, "cgroup": str(cg) if cg else None,
                       "victim_pid": victim_pid}, undo)
    _wait_children(p.pid, proc_root)
    return comp


def _move_into_new_cgroup(victim: int, hier_root: Path | None, undo: list[Callable[[], None]],
                          proc_root: Path) -> Path:
    assert hier_root is not None
    ver = 2 if (hier_root / "cgroup.controllers").exists() else 1
    cg = hier_root / f"sits-fault-{os.getpid()}-{secrets.token_hex(3)}"
    cg.mkdir()
    undo.append(lambda: _rmdir_when_empty(cg))
    for pid in [victim, *children(victim, proc_root)]:
        home = hier_root / cpu_cgroup_of(pid, ver, proc_root).lstrip("/")
        try:
            (cg / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            continue
        undo.append(functools.partial(_move_back, pid, home))
    return cg


def _move_back(pid: int, home: Path) -> None:
    try:
        (home / "cgroup.procs").write_text(str(pid))
    except (ProcessLookupError, OSError):
        pass  # it exited meanwhile


def _rmdir_when_empty(cg: Path) -> None:
    for _ in range(50):
        try:
            cg.rmdir()
            return
        except OSError:
            time.sleep(0.05)  # the last task is still leaving


def _wait_children(pid: int, proc_root: Path, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not children(pid, proc_root):
        time.sleep(0.02)


# -- memory ------------------------------------------------------------------------------


def memory_bytes(fraction: float, available: int, reserve_bytes: int = 4 * GiB,
                 cap_bytes: int = 16 * GiB) -> int:
    """How much to take: `fraction` of available, never more than leaves `reserve_bytes`."""
    if not 0 < fraction <= 0.9:
        raise CompetitorError("memory intensity is a fraction of MemAvailable in (0, 0.9]")
    want = min(int(fraction * available), cap_bytes, available - reserve_bytes)
    if want < 64 << 20:
        raise CompetitorError(
            f"only {available >> 20} MiB available: not enough to press safely")
    return want


def start_memory_competitor(intensity: float = 0.25, duration_s: float = 60.0,
                            reserve_bytes: int = 4 * GiB,
                            proc_root: Path = Path("/proc")) -> Competitor:
    """stress-ng --vm holding and rewriting `intensity` x MemAvailable (bounded)."""
    size = memory_bytes(intensity, mem_available(proc_root), reserve_bytes)
    argv = _stress_argv(["--vm", "1", "--vm-bytes", f"{size}b", "--vm-keep"], duration_s)
    p = subprocess.Popen(argv, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    comp = Competitor("host_memory_pressure", p, "stress-ng", "host", {"bytes": size})
    _wait_children(p.pid, proc_root)
    return comp


# -- memory, inside the victim's memory cgroup --------------------------------------------
#
# A node with free memory and no swap does not slow a server down when another process
# takes memory: nothing of the server's is reclaimed. What does slow it is the limit of the
# memory cgroup it runs in (a pod's, a container's) being reached: the kernel then reclaims
# the cgroup's page cache first, and a server whose working set is file-backed (mmap'd model
# weights, as llama.cpp and safetensors loaders do) faults it back in, stalling on the disk.
# `MemoryCgroup` is that cgroup; `start_memory_squeeze` starts a competitor inside it that
# holds memory (stress-ng --vm, written once, then kept) and lowers the limit so that the
# competitor fits only by pushing `squeeze_bytes` of the cgroup's page cache out.


class MemoryCgroup:
    """A fresh memory cgroup beside this process's own (so under any limit it has), no limit
    until `limit` is called. Start the victim in it with `preexec_fn=cg.join` (its page cache
    is charged to the cgroup that first faults it in)."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        hier = hierarchy("memory", proc_root)
        if hier is None:
            raise CompetitorError("no cgroup hierarchy with the memory controller is mounted")
        mnt, self.version = hier
        parent = mnt / cgroup_of("self", self.version, "memory", proc_root).lstrip("/")
        self.path = parent / f"sits-mem-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            self.path.mkdir()
        except OSError as e:
            raise CompetitorError(f"cannot create a memory cgroup under {parent}: {e}") from e
        self._limit_file = self.path / ("memory.max" if self.version == 2
                                        else "memory.limit_in_bytes")
        self._usage_file = self.path / ("memory.current" if self.version == 2
                                        else "memory.usage_in_bytes")

    def join(self) -> None:
        """preexec_fn: the child (and what it forks) starts in this cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        return int(self._usage_file.read_text())

    def limit(self, nbytes: int | None) -> None:
        """Set the limit (None: lift it)."""
        if nbytes is None:
            self._limit_file.write_text("max" if self.version == 2 else "-1")
        else:
            self._limit_file.write_text(str(int(nbytes)))

    def remove(self) -> None:
        """Lift the limit, move what is left to the parent, remove the cgroup."""
        if not self.path.exists():
            return
        self.limit(None)
        for pid in _read(self.path / "cgroup.procs").split():
            _move_back(int(pid), self.path.parent)
        _rmdir_when_empty(self.path)


def start_memory_squeeze(cg: MemoryCgroup, squeeze_bytes: int, hog_bytes: int = 512 << 20,
                         duration_s: float = 60.0, proc_root: Path = Path("/proc")
                         ) -> Competitor:
    """A competitor in `cg` that holds `hog_bytes`; once it does, the cgroup's limit is set
    `squeeze_bytes` under what the cgroup then holds: the kernel reclaims that much, and with
    no swap the competitor's memory cannot go, so it is the victim's page cache (which the
    victim faults back in as it uses it, pushing out the rest). Undone by `stop()`: the
    competitor killed, then the limit lifted."""
    if hog_bytes < 64 << 20 or squeeze_bytes <= 0:
        raise CompetitorError("the squeeze needs hog_bytes >= 64 MiB and squeeze_bytes > 0")
    before = cg.usage()
    # --vm-hang 0: the worker writes its memory once, then holds it (a leak, not a CPU hog);
    # --oomable: a worker the OOM killer takes is not restarted
    argv = _stress_argv(["--vm", "1", "--vm-bytes", f"{hog_bytes}b", "--vm-hang", "0",
                         "--vm-keep", "--oomable"], duration_s)
    p = subprocess.Popen(argv, preexec_fn=cg.join, start_new_session=True,  # noqa: PLW1509 (no threads fork here)
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    comp = Competitor("host_memory_pressure", p, "stress-ng", "cgroup",
                      {"bytes": hog_bytes, "squeeze_bytes": squeeze_bytes,
                       "cgroup": str(cg.path), "usage_before": before},
                      [lambda: cg.limit(None)])
    _wait_children(p.pid, proc_root)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and cg.usage() < before + hog_bytes * 0.95:
        time.sleep(0.05)
    limit = cg.usage() - squeeze_bytes
    try:
        cg.limit(limit)  # reclaims down to it before it returns
    except OSError as e:  # EBUSY: not that much to reclaim
        comp.stop()
        raise CompetitorError(f"cannot squeeze {squeeze_bytes >> 20} MiB out of the cgroup "
                              f"({cg.usage() >> 20} MiB): {e}") from e
    comp.detail["limit"] = limit
    return comp
