"""The control loop alone, without tracing: `python -m sits_trace.analyzers.control`.

It serves the control API and follows the RCA's verdicts from a JSON-lines file (or acts on
none); the benchmark and the tests run it this way. SIGTERM or SIGINT stop it, and every
action it took is undone first. Inside the agent the same loop is built from `[control]`.

Examples:
    python -m sits_trace.analyzers.control --mode act --verdicts /run/sits-trace/verdicts.jsonl
    python -m sits_trace.analyzers.control -c sits-trace.toml --duration 60
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from sits_trace.agent.config import ConfigError, load

from .agent_hook import AgentControl


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sits_trace.analyzers.control",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", type=Path, help="TOML config file ([control] section)")
    p.add_argument("--mode", choices=("observe", "advise", "act"))
    p.add_argument("--socket", help="control socket path ('' disables the API)")
    p.add_argument("--group", help="group allowed on the socket")
    p.add_argument("--verdicts", help="JSON-lines file of RCA verdicts to follow")
    p.add_argument("--state", help="where applied actions are remembered for undo")
    p.add_argument("--clear-after", type=float, help="seconds a cause is gone before undo")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", stream=sys.stderr)
    overrides = {"control.mode": a.mode, "control.socket_path": a.socket,
                 "control.socket_group": a.group, "control.verdicts_path": a.verdicts,
                 "control.state_path": a.state, "control.clear_after_s": a.clear_after}
    try:
        cfg = load(a.config, overrides=overrides)
    except ConfigError as e:
        print(f"sits-trace control: {e}", file=sys.stderr)
        return 2
    control = AgentControl.build(cfg.control)
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    control.start()
    print(f"sits-trace control: {cfg.control.mode} mode; ready", file=sys.stderr, flush=True)
    deadline = time.monotonic() + a.duration if a.duration else None
    while not stop.wait(0.2):
        if deadline is not None and time.monotonic() >= deadline:
            break
    control.stop()
    print("sits-trace control: stopped; actions undone", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
