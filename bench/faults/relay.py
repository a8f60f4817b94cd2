"""A user-space link between two TUN devices: one-way delay, jitter and seeded loss.

This kernel has no netem qdisc, so impairment happens here: the relay reads IP packets
from one TUN device and writes them to the other after `delay_ms` (+ uniform jitter in
[-jitter_ms, +jitter_ms], never reordering within a direction) or drops them with
probability `loss`. Both directions get the same parameters, so a TCP connection
through the relay sees RTT = base + 2 * delay and real retransmissions.

The relay runs as its own process (this file, run by path, standard library only) and
takes its two TUN file descriptors and a control socket as inherited descriptors.
Control protocol, one JSON object a line on the control socket, one reply line each:
  {"op": "set", "delay_ms": 50, "jitter_ms": 0, "loss": 0.05}  -> {"ok": true, "applied_ns": ...}
  {"op": "stats"}                                              -> {"ok": true, "a_to_b": {...}, ...}
  {"op": "stop"}                                               -> {"ok": true}, then exit
Cost: one Python loop, about 10 us a packet: fine for request traffic, not for line rate.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import select
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

MAX_PACKET = 65536
QUEUE_LIMIT = 10000  # packets waiting per direction, as netem's default limit of 1000 x 10


@dataclass
class LinkParams:
    """Impairment applied to each direction."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def validate(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError("loss must be in [0, 1)")


@dataclass
class DirStats:
    forwarded: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0
    dropped_write: int = 0
    bytes: int = 0


@dataclass
class Direction:
    """Packets read from `src`, waiting for their time to be written to `dst`."""

    src: int
    dst: int
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)
    last_due: float = 0.0
    stats: DirStats = field(default_factory=DirStats)


class Link:
    """The forwarding state: decide each packet's fate and release it on time."""

    def __init__(self, params: LinkParams, seed: int, clock: Callable[[], float]) -> None:
        self.params = params
        self._rng = random.Random(seed)
        self._clock = clock

    def admit(self, d: Direction, packet: bytes) -> None:
        p = self.params
        if p.loss > 0 and self._rng.random() < p.loss:
            d.stats.dropped_loss += 1
            return
        if len(d.queue) >= QUEUE_LIMIT:
            d.stats.dropped_queue += 1
            return
        jitter = self._rng.uniform(-p.jitter_ms, p.jitter_ms) if p.jitter_ms > 0 else 0.0
        due = self._clock() + max(0.0, p.delay_ms + jitter) / 1000.0
        d.last_due = max(due, d.last_due)  # FIFO: jitter never reorders a direction
        d.queue.append((d.last_due, packet))

    def due(self, d: Direction) -> list[bytes]:
        now, out = self._clock(), []
        while d.queue and d.queue[0][0] <= now:
            out.append(d.queue.popleft()[1])
        return out

    def next_due(self, dirs: list[Direction]) -> float | None:
        heads = [d.queue[0][0] for d in dirs if d.queue]
        return min(heads) if heads else None


def _read_all(d: Direction, link: Link) -> None:
    while True:
        try:
            packet = os.read(d.src, MAX_PACKET)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EINTR):
                return
            raise
        if not packet:
            return
        link.admit(d, packet)


def _flush(d: Direction, link: Link) -> None:
    for packet in link.due(d):
        try:
            os.write(d.dst, packet)
        except OSError:  # device down or its queue full: the packet is lost, as on a wire
            d.stats.dropped_write += 1
            continue
        d.stats.forwarded += 1
        d.stats.bytes += len(packet)


class _Control:
    """Line-oriented JSON commands on an inherited socket descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""

    def commands(self) -> list[dict[str, object]] | None:
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None  # the owner went away: stop
        self._buf += chunk
        lines = self._buf.split(b"\n")
        self._buf = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]

    def reply(self, obj: dict[str, object]) -> None:
        os.write(self.fd, json.dumps(obj).encode() + b"\n")


def _handle(cmd: dict[str, object], link: Link, dirs: list[Direction]) -> dict[str, object]:
    op = cmd.get("op")
    if op == "set":
        p = LinkParams(
            delay_ms=float(cmd.get("delay_ms", link.params.delay_ms)),  # type: ignore[arg-type]
            jitter_ms=float(cmd.get("jitter_ms", link.params.jitter_ms)),  # type: ignore[arg-type]
            loss=float(cmd.get("loss", link.params.loss)),  # type: ignore[arg-type]
        )
        try:
            p.validate()
        except ValueError as e:
            return {"ok": False, "error": str(e)}
        link.params = p
        return {"ok": True, "applied_ns": time.time_ns(), "params": asdict(p)}
    if op == "stats":
        return {"ok": True, "params": asdict(link.params),
                "a_to_b": asdict(dirs[0].stats), "b_to_a": asdict(dirs[1].stats)}
    if op == "stop":
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}"}


def serve(fd_a: int, fd_b: int, ctl_fd: int, params: LinkParams, seed: int) -> None:
    """Forward between the two TUN descriptors until told to stop or the owner leaves."""
    for fd in (fd_a, fd_b):
        os.set_blocking(fd, False)
    link = Link(params, seed, time.monotonic)
    dirs = [Direction(fd_a, fd_b), Direction(fd_b, fd_a)]
    ctl = _Control(ctl_fd)
    poller = select.poll()
    for fd in (fd_a, fd_b, ctl_fd):
        poller.register(fd, select.POLLIN)
    while True:
        nxt = link.next_due(dirs)
        timeout_ms = None if nxt is None else max(0.0, (nxt - time.monotonic()) * 1000.0)
        for fd, _ev in poller.poll(timeout_ms):
            if fd == ctl_fd:
                cmds = ctl.commands()
                if cmds is None:
                    return
                for cmd in cmds:
                    ctl.reply(_handle(cmd, link, dirs))
                    if cmd.get("op") == "stop":
                        return
            else:
                _read_all(dirs[0] if fd == fd_a else dirs[1], link)
        for d in dirs:
            _flush(d, link)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--fd-a", type=int, required=True)
    ap.add_argument("--fd-b", type=int, required=True)
    ap.add_argument("--ctl-fd", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    params = LinkParams(a.delay_ms, a.jitter_ms, a.loss)
    try:
        params.validate()
    except ValueError as e:
        print(f"relay: {e}", file=sys.stderr)
        return 2
    serve(a.fd_a, a.fd_b, a.ctl_fd, params, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
