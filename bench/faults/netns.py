"""Client and server network namespaces joined by an impairable link (pyroute2, no `ip`).

    client netns            relay process (root netns)          server netns (or root)
    sfXXXXXXc 10.77.0.1/30 <-- TUN fd -- delay/jitter/loss -- TUN fd --> sfXXXXXXs 10.77.0.2/30

The kernels' own TCP stacks talk across the link, so delay shows up as RTT and loss as
retransmissions. Where the kernel has netem (probed by trying, once), a veth pair with a
netem qdisc on each end replaces the TUN relay; the API is the same.

Every name carries the creating pid and a random tag, so parallel runs do not collide,
and `cleanup_stale()` removes what a killed run (dead pid) left behind. `Topology` is a
context manager whose `close()` is idempotent and runs on exceptions too.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

NS_PREFIX = "sitsf-"
NETNS_DIR = Path("/var/run/netns")
RELAY_SCRIPT = Path(__file__).resolve().with_name("relay.py")
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
TXQLEN = 4000
Side = Literal["client", "server"]


class TopologyError(RuntimeError):
    """Setting up or driving the namespaces failed; the message says why."""


@dataclass(frozen=True)
class LinkState:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0


# -- namespaces -------------------------------------------------------------------------


def _ns_path(name: str) -> Path:
    return NETNS_DIR / name


@contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """Run the body with the calling thread in netns `name` (None: stay where it is)."""
    if name is None:
        yield
        return
    netns.pushns(name)
    try:
        yield
    finally:
        netns.popns()


PR_SET_PDEATHSIG = 1


def _enter_netns_fd(fd: int) -> Callable[[], None]:
    def enter() -> None:  # runs in the child between fork and exec
        netns.setns(fd, flags=0)
        # SIGTERM when the forking thread dies, so a SIGKILLed harness leaves no servers
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return enter


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_ours() -> list[str]:
    """Namespaces this module created (any run) that still exist."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(NS_PREFIX))


def cleanup_stale() -> list[str]:
    """Remove namespaces left by runs whose creating process is gone; return their names."""
    removed = []
    for name in list_ours():
        parts = name.split("-")
        if len(parts) >= 2 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _remove_netns(name)
            removed.append(name)
    return removed


def _remove_netns(name: str) -> None:
    if _ns_path(name).exists():
        netns.remove(name)


# -- TUN --------------------------------------------------------------------------------


def open_tun(ifname: str, ns: str | None) -> int:
    """Create a TUN device (L3, no packet info) named `ifname` inside `ns`; return its fd."""
    with in_netns(ns):
        fd = os.open("/dev/net/tun", os.O_RDWR)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
    return fd


def _configure_if(ns: str | None, ifname: str, addr: str, prefixlen: int) -> None:
    with IPRoute(netns=ns) if ns else IPRoute() as ipr:
        (idx,) = ipr.link_lookup(ifname=ifname)
        ipr.addr("add", index=idx, address=addr, prefixlen=prefixlen)
        # a longer queue than the default 500: the relay drains in bursts
        ipr.link("set", index=idx, mtu=1500, txqlen=TXQLEN, state="up")
        if ns:
            (lo,) = ipr.link_lookup(ifname="lo")
            ipr.link("set", index=lo, state="up")


def _root_subnets() -> list[ipaddress.IPv4Network]:
    with IPRoute() as ipr:
        nets = []
        for r in ipr.get_routes(family=socket.AF_INET):
            dst, plen = r.get("dst"), int(r["dst_len"])
            if dst and plen > 0:
                nets.append(ipaddress.IPv4Network(f"{dst}/{plen}", strict=False))
        return nets


def pick_subnet(in_root: bool, used: Callable[[], list[ipaddress.IPv4Network]] = _root_subnets
                ) -> ipaddress.IPv4Network:
    """A private /30. Inside two new namespaces any is safe; in the root one, a free one."""
    if not in_root:
        return ipaddress.IPv4Network("10.77.0.0/30")
    taken = used()
    for _ in range(64):
        third, fourth = secrets.randbelow(256), 4 * secrets.randbelow(64)
        cand = ipaddress.IPv4Network(f"10.231.{third}.{fourth}/30")
        if not any(cand.overlaps(t) for t in taken):
            return cand
    raise TopologyError("no free 10.231.x.y/30 in the root namespace")


# -- netem probe ------------------------------------------------------------------------


_NETEM: bool | None = None


def netem_available() -> bool:
    """Whether the kernel takes a netem qdisc: tried once on a veth in a scratch netns."""
    global _NETEM
    if _NETEM is None:
        _NETEM = _probe_netem()
    return _NETEM


def _probe_netem() -> bool:
    name = f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    netns.create(name)
    try:
        with IPRoute(netns=name) as ipr:
            ipr.link("add", ifname="pa", kind="veth", peer="pb")
            (idx,) = ipr.link_lookup(ifname="pa")
            try:
                ipr.tc("add", "netem", index=idx, handle="1:", delay=1000)
            except NetlinkError:
                return False
            return True
    finally:
        _remove_netns(name)


# -- the topology -----------------------------------------------------------------------


@dataclass
class _Proc:
    popen: subprocess.Popen[bytes]
    group: bool


@dataclass
class Topology:
    """Client netns <-> impairable link <-> server netns (or the root netns).

    Use as `with Topology() as topo:`; `topo.set_link(delay_ms=50)` changes the link at
    run time; `topo.popen("server", [...])` runs a command in a namespace (killed on close).
    """

    server_in_root: bool = False
    seed: int = 0
    backend: Literal["auto", "tun-relay", "netem"] = "auto"
    tag: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(3)}")
    client_ns: str = ""
    server_ns: str | None = None
    client_ip: str = ""
    server_ip: str = ""
    link: LinkState = field(default_factory=LinkState)
    _procs: list[_Proc] = field(default_factory=list)
    _relay: subprocess.Popen[bytes] | None = None
    _ctl: socket.socket | None = None
    _ctl_file: Any = None
    _made_ns: list[str] = field(default_factory=list)
    _closed: bool = False
    _veth: tuple[int, int] | None = None

    # setup

    def __enter__(self) -> Self:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def ifnames(self) -> tuple[str, str]:
        short = self.tag.split("-")[-1]
        return f"sf{short}c", f"sf{short}s"

    def _setup(self) -> None:
        if os.geteuid() != 0:
            raise TopologyError("network namespaces need root: run as root")
        cleanup_stale()
        if self.backend == "auto":
            self.backend = "netem" if netem_available() else "tun-relay"
        net = pick_subnet(self.server_in_root)
        hosts = list(net.hosts())
        self.client_ip, self.server_ip = str(hosts[0]), str(hosts[1])
        self.client_ns = self._new_ns("c")
        self.server_ns = None if self.server_in_root else self._new_ns("s")
        if self.backend == "netem":
            self._setup_veth(net.prefixlen)
        else:
            self._setup_tun(net.prefixlen)

    def _new_ns(self, role: str) -> str:
        name = f"{NS_PREFIX}{self.tag}-{role}"
        netns.create(name)
        self._made_ns.append(name)
        return name

    def _setup_tun(self, prefixlen: int) -> None:
        cif, sif = self.ifnames
        fa = open_tun(cif, self.client_ns)
        try:
            fb = open_tun(sif, self.server_ns)
            try:
                _configure_if(self.client_ns, cif, self.client_ip, prefixlen)
                _configure_if(self.server_ns, sif, self.server_ip, prefixlen)
                self._start_relay(fa, fb)
            finally:
                os.close(fb)
        finally:
            os.close(fa)  # the relay holds the devices from here on
        self.set_link()

    def _start_relay(self, fa: int, fb: int) -> None:
        mine, theirs = socket.socketpair()
        self._ctl, self._ctl_file = mine, mine.makefile("rwb", buffering=0)
        self._relay = subprocess.Popen(
            [sys.executable, str(RELAY_SCRIPT), "--fd-a", str(fa), "--fd-b", str(fb),
             "--ctl-fd", str(theirs.fileno()), "--seed", str(self.seed)],
            pass_fds=(fa, fb, theirs.fileno()), start_new_session=True,
        )
        theirs.close()

    def _setup_veth(self, prefixlen: int) -> None:
        cif, sif = self.ifnames
        with IPRoute() as ipr:
            ipr.link("add", ifname=cif, kind="veth", peer=sif)
            (ci,) = ipr.link_lookup(ifname=cif)
            ipr.link("set", index=ci, net_ns_fd=self.client_ns)
            if self.server_ns:
                (si,) = ipr.link_lookup(ifname=sif)
                ipr.link("set", index=si, net_ns_fd=self.server_ns)
        _configure_if(self.client_ns, cif, self.client_ip, prefixlen)
        _configure_if(self.server_ns, sif, self.server_ip, prefixlen)
        self.set_link()

    # run time

    def set_link(self, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0) -> int:
        """Impose one-way delay/jitter (ms) and loss (0..1) on both directions.

        Returns the unix time (ns) at which the new parameters took effect."""
        if not (delay_ms >= 0 and jitter_ms >= 0 and 0 <= loss < 1):
            raise TopologyError("delay_ms and jitter_ms must be >= 0 and loss in [0, 1)")
        if self.backend == "netem":
            applied = self._set_netem(delay_ms, jitter_ms, loss)
        else:
            reply = self._command({"op": "set", "delay_ms": delay_ms, "jitter_ms": jitter_ms,
                                   "loss": loss})
            applied = int(reply["applied_ns"])
        self.link = LinkState(delay_ms, jitter_ms, loss)
        return applied

    def _set_netem(self, delay_ms: float, jitter_ms: float, loss: float) -> int:
        for ns, ifname in zip((self.client_ns, self.server_ns), self.ifnames, strict=True):
            with IPRoute(netns=ns) if ns else IPRoute() as ipr:
                (idx,) = ipr.link_lookup(ifname=ifname)
                try:
                    ipr.tc("replace", "netem", index=idx, handle="1:",
                           delay=int(delay_ms * 1000), jitter=int(jitter_ms * 1000),
                           loss=loss * 100.0)
                except NetlinkError as e:
                    raise TopologyError(f"netem on {ifname} failed ({e}): this kernel may "
                                        "lack CONFIG_NET_SCH_NETEM; use backend='tun-relay'"
                                        ) from None
        return time.time_ns()

    def stats(self) -> dict[str, Any]:
        """Relay counters (forwarded/dropped per direction); {} on the netem backend."""
        return {} if self.backend == "netem" else self._command({"op": "stats"})

    def _command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self._ctl_file is None or self._relay is None or self._relay.poll() is not None:
            raise TopologyError("the relay is not running")
        self._ctl_file.write(json.dumps(cmd).encode() + b"\n")
        line = self._ctl_file.readline()
        if not line:
            raise TopologyError("the relay closed its control socket")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise TopologyError(f"relay refused {cmd}: {reply.get('error')}")
        return reply

    def ns_of(self, side: Side) -> str | None:
        return self.client_ns if side == "client" else self.server_ns

    def ip_of(self, side: Side) -> str:
        return self.client_ip if side == "client" else self.server_ip

    def popen(self, side: Side, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        """Start `argv` inside `side`'s netns; it is killed (its process group) on close.

        In a netns it also gets SIGTERM if the calling thread dies: call from a thread
        that outlives it (the main thread)."""
        ns = self.ns_of(side)
        kw.setdefault("start_new_session", "process_group" not in kw)
        group = bool(kw["start_new_session"]) or kw.get("process_group") == 0
        if ns is None:
            p: subprocess.Popen[bytes] = subprocess.Popen(list(argv), **kw)
        else:
            fd = os.open(_ns_path(ns), os.O_RDONLY)
            try:
                # setns between fork and exec: 3.11 has no os.setns, and `ip netns exec` is out
                p = subprocess.Popen(list(argv), preexec_fn=_enter_netns_fd(fd), **kw)  # noqa: PLW1509
            finally:
                os.close(fd)
        self._procs.append(_Proc(p, group))
        return p

    def socket(self, side: Side, kind: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket created inside `side`'s netns (usable from any thread afterwards)."""
        with in_netns(self.ns_of(side)):
            return socket.socket(socket.AF_INET, kind)

    def snmp(self, side: Side) -> dict[str, int]:
        """That netns's TCP counters: `Tcp:` of /proc/net/snmp and `TcpExt:` of netstat."""
        with in_netns(self.ns_of(side)):
            out = parse_proc_net(Path("/proc/thread-self/net/snmp").read_text(), "Tcp")
            out.update(parse_proc_net(Path("/proc/thread-self/net/netstat").read_text(),
                                       "TcpExt"))
        return out

    # teardown

    def close(self) -> None:
        """Kill what was started here, stop the relay, remove the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for step in (self._kill_procs, self._stop_relay, self._remove_links, self._remove_ns):
            try:
                step()
            except Exception as e:  # noqa: BLE001 (keep tearing down; report at the end)
                errors.append(f"{step.__name__}: {e}")
        if errors:
            raise TopologyError("teardown incomplete: " + "; ".join(errors))

    def _kill_procs(self) -> None:
        for pr in reversed(self._procs):
            _terminate(pr.popen, pr.group)
        self._procs.clear()

    def _stop_relay(self) -> None:
        if self._relay is not None:
            if self._relay.poll() is None and self._ctl_file is not None:
                try:
                    self._ctl_file.write(b'{"op": "stop"}\n')
                except OSError:
                    pass
            _terminate(self._relay, True, grace=2.0)
        if self._ctl_file is not None:
            self._ctl_file.close()
        if self._ctl is not None:
            self._ctl.close()
        self._relay, self._ctl, self._ctl_file = None, None, None

    def _remove_links(self) -> None:
        """Only the root-netns end can outlive the namespaces (veth backend, server in root)."""
        if not self.server_in_root:
            return
        with IPRoute() as ipr:
            for ifname in self.ifnames:
                for idx in ipr.link_lookup(ifname=ifname):
                    ipr.link("del", index=idx)

    def _remove_ns(self) -> None:
        for name in self._made_ns:
            _remove_netns(name)
        self._made_ns.clear()


def _terminate(p: subprocess.Popen[bytes], group: bool, grace: float = 3.0) -> None:
    if p.poll() is not None:
        return
    sig_target = p.pid
    try:
        if group:
            os.killpg(sig_target, signal.SIGTERM)
        else:
            p.terminate()
    except ProcessLookupError:
        return
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(sig_target, signal.SIGKILL) if group else p.kill()
        except ProcessLookupError:
            pass
        p.wait(5)


def parse_proc_net(text: str, prefix: str) -> dict[str, int]:
    """The header/value line pair of /proc/net/snmp-style text whose tag is `prefix:`."""
    lines = [ln.split() for ln in text.splitlines() if ln.startswith(prefix + ":")]
    if len(lines) < 2:
        return {}
    return {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:], strict=True)}


def leftovers(tag: str) -> list[str]:
    """What of run `tag` still exists: its namespaces and any root-netns link of it."""
    found = [n for n in list_ours() if tag in n]
    short = tag.split("-")[-1]
    with IPRoute() as ipr:
        for link in ipr.get_links():
            name = link.get("ifname") or ""
            if name.startswith(f"sf{short}"):
                found.append(name)
    return found
