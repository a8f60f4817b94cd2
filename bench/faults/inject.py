"""Labelled fault injection: apply and remove real faults on a schedule, write the labels.

A `Fault(kind, start_s, duration_s, intensity, culprit)` says what to do and when (seconds
from the run's start). Intensity by kind:
  network_delay          one-way delay in ms, both directions (RTT grows by 2x)
  network_loss           drop probability in [0, 1), both directions
  cpu_starvation         stress-ng busy workers per CPU, in the victim's scheduling group
  host_memory_pressure   fraction of MemAvailable held and rewritten (bounded)
  slow_dependency        extra ms the downstream dependency waits per request
  request_mix_shift, server_queueing: the caller's workload knobs (pass a handler)
The labels JSON holds, per fault: cause, culprit ({pid,name,pids} | {peer,link} | null),
start_ns/end_ns (unix ns at which the fault really took effect and was removed), intensity,
params, seed.

CLI (root):
  bench/faults/inject.py --server-cmd "python3 -m http.server 8080" \\
      --client-cmd "wrk -d40s http://{server_ip}:8080/" \\
      --fault network_delay:ms=50 --at 10 --for 20 --duration 40 --labels out.json
  bench/faults/inject.py --measure        # RTT, retransmissions and throughput of the link
The server runs in the server netns (--server-in-root: in the root netns), the client
command in the client netns; {server_ip}, {client_ip} and {dep_url} are substituted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

if __package__ in (None, ""):  # run by path: make `bench.faults` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import itertools

from bench.faults.competitors import (
    Competitor,
    CompetitorError,
    start_cpu_competitor,
    start_memory_competitor,
)
from bench.faults.netns import Topology, TopologyError
from bench.faults.slowdep import SlowDependency

FaultKind = Literal["network_delay", "network_loss", "cpu_starvation", "host_memory_pressure",
                    "slow_dependency", "request_mix_shift", "server_queueing"]
KINDS: tuple[str, ...] = FaultKind.__args__  # type: ignore[attr-defined]
# the key=value a CLI --fault spec uses for the intensity
INTENSITY_KEY = {"network_delay": "ms", "network_loss": "p", "cpu_starvation": "per_cpu",
                 "host_memory_pressure": "fraction", "slow_dependency": "ms",
                 "request_mix_shift": "level", "server_queueing": "level"}


class FaultError(ValueError):
    """A fault or schedule is malformed; the message names what and why."""


@dataclass(frozen=True)
class Fault:
    kind: str
    start_s: float
    duration_s: float
    intensity: float
    culprit: dict[str, Any] | None = None  # filled in by the handler when None
    params: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise FaultError(f"unknown fault kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.start_s < 0 or self.duration_s <= 0:
            raise FaultError(f"{self.kind}: start must be >= 0 and duration > 0")

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass
class Label:
    cause: str
    culprit: dict[str, Any] | None
    start_ns: int
    end_ns: int | None
    intensity: float
    params: dict[str, float]
    seed: int


class Handler(Protocol):
    """Applies one kind of fault; `apply` returns the culprit label (or None)."""

    def apply(self, fault: Fault) -> dict[str, Any] | None: ...

    def remove(self, fault: Fault) -> None: ...


# -- handlers ----------------------------------------------------------------------------


class NetworkHandler:
    """network_delay / network_loss on the topology's link; both may be active at once."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.delay_ms = self.jitter_ms = self.loss = 0.0

    def apply(self, fault: Fault) -> dict[str, Any] | None:
        if fault.kind == "network_delay":
            self.delay_ms = fault.intensity
            self.jitter_ms = fault.params.get("jitter_ms", 0.0)
        else:
            self.loss = fault.intensity
        self._push()
        t = self.topo
        return {"peer": t.client_ip, "link": f"{t.client_ip}<->{t.server_ip}"}

    def remove(self, fault: Fault) -> None:
        if fault.kind == "network_delay":
            self.delay_ms = self.jitter_ms = 0.0
        else:
            self.loss = 0.0
        self._push()

    def _push(self) -> None:
        self.topo.set_link(self.delay_ms, self.jitter_ms, self.loss)


class CompetitorHandler:
    """cpu_starvation (sharing `victim_pid`'s scheduling group) or host_memory_pressure."""

    def __init__(self, victim_pid: int | None) -> None:
        self.victim_pid = victim_pid
        self.running: dict[str, Competitor] = {}

    def apply(self, fault: Fault) -> dict[str, Any] | None:
        slack = fault.duration_s + 30.0  # stress-ng's own timeout, a safety net
        if fault.kind == "cpu_starvation":
            if self.victim_pid is None:
                raise FaultError("cpu_starvation needs a victim pid")
            comp = start_cpu_competitor(self.victim_pid, fault.intensity, slack)
        else:
            comp = start_memory_competitor(fault.intensity, slack)
        self.running[fault.kind] = comp
        return comp.culprit() | {"placement": comp.placement, **comp.detail}

    def remove(self, fault: Fault) -> None:
        comp = self.running.pop(fault.kind, None)
        if comp is not None:
            comp.stop()

    def close(self) -> None:
        for comp in self.running.values():
            comp.stop()
        self.running.clear()


class SlowDependencyHandler:
    def __init__(self, dep: SlowDependency) -> None:
        self.dep = dep
        self.base_ms = dep.delay_ms

    def apply(self, fault: Fault) -> dict[str, Any] | None:
        self.dep.set_delay(self.base_ms + fault.intensity)
        return {"peer": f"{self.dep.host}:{self.dep.port}", "pid": self.dep.proc.pid,
                "name": "slowdep"}

    def remove(self, fault: Fault) -> None:
        self.dep.set_delay(self.base_ms)


# -- the runner --------------------------------------------------------------------------


def check_schedule(faults: Sequence[Fault]) -> None:
    """Each fault valid; two faults of one kind never overlap (they share one knob)."""
    for f in faults:
        f.validate()
    by_kind = sorted(faults, key=lambda f: (f.kind, f.start_s))
    for a, b in itertools.pairwise(by_kind):
        if a.kind == b.kind and b.start_s < a.end_s:
            raise FaultError(f"two {a.kind} faults overlap ({a.start_s}s and {b.start_s}s)")


class FaultRunner:
    """Applies and removes the schedule on time; `labels` records what really happened."""

    def __init__(self, faults: Sequence[Fault], handlers: dict[str, Handler], seed: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 wall_ns: Callable[[], int] = time.time_ns,
                 log: Callable[[str], None] = lambda s: None) -> None:
        check_schedule(faults)
        missing = {f.kind for f in faults} - set(handlers)
        if missing:
            raise FaultError(f"no handler for {', '.join(sorted(missing))} in this run")
        self.faults, self.handlers, self.seed = list(faults), handlers, seed
        self._clock, self._sleep, self._wall, self._log = clock, sleep, wall_ns, log
        self.labels: list[Label] = []
        self._active: dict[int, Label] = {}

    def _events(self) -> list[tuple[float, int, int]]:
        """(time, 0 = remove / 1 = apply, fault index): removals first at equal times."""
        ev = [(f.start_s, 1, i) for i, f in enumerate(self.faults)]
        ev += [(f.end_s, 0, i) for i, f in enumerate(self.faults)]
        return sorted(ev)

    def run(self, total_s: float | None = None) -> list[Label]:
        t0 = self._clock()
        try:
            for at, apply, i in self._events():
                self._sleep_until(t0 + at)
                (self._apply if apply else self._remove)(i, self._clock() - t0)
            if total_s is not None:
                self._sleep_until(t0 + total_s)
        finally:
            for i in list(self._active):
                self._remove(i, self._clock() - t0)
        return self.labels

    def _sleep_until(self, t: float) -> None:
        while (left := t - self._clock()) > 0:
            self._sleep(min(left, 0.5))

    def _apply(self, i: int, t: float) -> None:
        f = self.faults[i]
        culprit = self.handlers[f.kind].apply(f)
        label = Label(f.kind, f.culprit if f.culprit is not None else culprit, self._wall(),
                      None, f.intensity, dict(f.params), self.seed)
        self._active[i] = label
        self.labels.append(label)
        self._log(f"t={t:7.2f}s apply  {f.kind} intensity={f.intensity:g} culprit={label.culprit}")

    def _remove(self, i: int, t: float) -> None:
        label = self._active.pop(i, None)
        if label is None:
            return
        self.handlers[self.faults[i].kind].remove(self.faults[i])
        label.end_ns = self._wall()
        self._log(f"t={t:7.2f}s remove {label.cause}")


def write_labels(path: Path, labels: Sequence[Label], meta: dict[str, Any]) -> None:
    doc = {**meta, "faults": [asdict(lb) for lb in labels]}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def parse_fault(spec: str, at: float, dur: float) -> Fault:
    """`kind:key=value,...` -> Fault; the kind's intensity key (e.g. ms, p) is required."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise FaultError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")
    params: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        try:
            params[key] = float(val) if eq else float("nan")
        except ValueError:
            raise FaultError(f"{spec}: {key} must be a number") from None
    key = INTENSITY_KEY[kind]
    if key not in params:
        raise FaultError(f"{spec}: give the intensity as {kind}:{key}=<number>")
    intensity = params.pop(key)
    fault = Fault(kind, at, dur, intensity, None, params)
    fault.validate()
    return fault


# -- CLI ---------------------------------------------------------------------------------


def _ns_http_get(topo: Topology, side: Literal["client", "server"], host: str, port: int,
                 path: str) -> bytes:
    with topo.socket(side) as s:
        s.settimeout(5)
        s.connect((host, port))
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2]


def _wait_listen(topo: Topology, side: Literal["client", "server"], port: int,
                 timeout: float = 15.0) -> None:
    host = topo.ip_of(side)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with topo.socket("client") as s:
            s.settimeout(1)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise TopologyError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def _subst(cmd: str, topo: Topology, dep_url: str) -> list[str]:
    return shlex.split(cmd.format(server_ip=topo.server_ip, client_ip=topo.client_ip,
                                  dep_url=dep_url))


def _run_cli(a: argparse.Namespace, faults: list[Fault]) -> int:
    log = print
    with Topology(server_in_root=a.server_in_root, seed=a.seed) as topo:
        log(f"netns: client {topo.client_ns} {topo.client_ip}, server "
            f"{topo.server_ns or '(root)'} {topo.server_ip}, link {topo.backend}")
        handlers: dict[str, Handler] = {}
        net = NetworkHandler(topo)
        handlers["network_delay"] = handlers["network_loss"] = net
        dep, dep_url = None, ""
        if a.dep_port:
            def fetch(url: str) -> bytes:
                rest = url.split(f":{a.dep_port}", 1)[1]
                return _ns_http_get(topo, "server", "127.0.0.1", a.dep_port, rest)
            dep = SlowDependency(a.dep_port, spawn=lambda argv: topo.popen("server", argv),
                                 fetch=fetch)
            dep_url = dep.url
            handlers["slow_dependency"] = SlowDependencyHandler(dep)
            log(f"slow dependency: {dep_url} (pid {dep.proc.pid}) in the server netns")
        # the server shares our session, so a CPU competitor of ours shares its autogroup
        server = topo.popen("server", _subst(a.server_cmd, topo, dep_url),
                            start_new_session=False, process_group=0)
        log(f"server: pid {server.pid}: {shlex.join(server.args)}")  # type: ignore[arg-type]
        comps = CompetitorHandler(a.victim_pid or server.pid)
        handlers["cpu_starvation"] = handlers["host_memory_pressure"] = comps
        if a.port:
            _wait_listen(topo, "server", a.port)
        if a.client_cmd:
            client = topo.popen("client", _subst(a.client_cmd, topo, dep_url))
            log(f"client: pid {client.pid}: {a.client_cmd}")
        runner = FaultRunner(faults, handlers, a.seed, log=log)
        total = max([a.duration, *(f.end_s for f in faults)])
        try:
            labels = runner.run(total)
        finally:
            comps.close()
            if dep is not None:
                dep.close()
            write_labels(Path(a.labels), runner.labels, {
                "seed": a.seed, "server_pid": server.pid, "server_cmd": a.server_cmd,
                "client_ip": topo.client_ip, "server_ip": topo.server_ip,
                "link_backend": topo.backend})
        if server.poll() is not None:
            log(f"warning: the server exited early (status {server.returncode})")
    log(f"labels: {a.labels} ({len(labels)} faults); namespaces removed")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Run a server behind an impairable link and inject labelled faults.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--server-cmd", help="the server's command line (runs in the server netns)")
    ap.add_argument("--client-cmd", help="a load generator (runs in the client netns)")
    ap.add_argument("--port", type=int, help="wait until the server listens on this port")
    ap.add_argument("--fault", action="append", default=[], help="kind:key=value,...")
    ap.add_argument("--at", action="append", type=float, default=[], help="start (s), per --fault")
    ap.add_argument("--for", dest="for_", action="append", type=float, default=[],
                    help="duration (s), per --fault")
    ap.add_argument("--duration", type=float, default=0.0, help="total run time (s)")
    ap.add_argument("--labels", default="labels.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-in-root", action="store_true")
    ap.add_argument("--victim-pid", type=int, help="cpu_starvation victim (default: the server)")
    ap.add_argument("--dep-port", type=int, help="start the slow dependency on 127.0.0.1:PORT")
    ap.add_argument("--measure", action="store_true", help="measure the link and exit")
    return ap


def _faults_from_args(a: argparse.Namespace) -> list[Fault]:
    if not (len(a.fault) == len(a.at) == len(a.for_)):
        raise FaultError("give one --at and one --for per --fault")
    faults = [parse_fault(s, at, d) for s, at, d in zip(a.fault, a.at, a.for_, strict=True)]
    check_schedule(faults)
    return faults


def _on_sigterm(main_pid: int) -> Callable[[int, object], None]:
    def handler(signum: int, frame: object) -> None:
        if os.getpid() != main_pid:  # a forked (not exec'd) pyroute2 helper: die as usual
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt  # unwinds through the runner and Topology: faults off

    return handler


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm(os.getpid()))
    try:
        if a.measure:
            from bench.faults.measure import main as measure_main
            return measure_main(seed=a.seed)
        if not a.server_cmd:
            raise FaultError("--server-cmd is required (or --measure)")
        return _run_cli(a, _faults_from_args(a))
    except (FaultError, TopologyError, CompetitorError, OSError, subprocess.SubprocessError) as e:
        print(f"inject: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("inject: interrupted; faults removed, namespaces torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
