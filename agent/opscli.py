"""The operator commands: `top`, `config check|show`, `install-service`, `uninstall-service`.

Registered onto the main typer app by agent/cli.py. Errors a user can cause end in one line on
stderr and exit 2 (bad config) or 1 (cannot run here).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from .config import ConfigError
from .config import load as load_config

config_app = typer.Typer(no_args_is_help=True, help="Check or print the configuration.")


def _fail(msg: str, code: int = 2) -> NoReturn:
    typer.echo(f"sits-trace: {msg}", err=True)
    raise typer.Exit(code)


@config_app.command("check")
def config_check(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="[{key, value, origin}] as JSON")] = False,
) -> None:
    """Validate the configuration and print every key's effective value and its origin
    (default, file, environment or flag). A bad key or value: one line, exit 2."""
    from .configdoc import effective, render_effective

    try:
        rows = effective(config)
    except ConfigError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps([{"key": r.key, "value": r.value, "origin": r.origin} for r in rows],
                              indent=1))
    else:
        typer.echo(render_effective(rows), nl=False)
        typer.echo("sits-trace: config ok", err=True)


@config_app.command("show")
def config_show(
    defaults: Annotated[bool, typer.Option("--defaults", help="the defaults, every key commented")] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
) -> None:
    """Print a complete TOML configuration: the defaults (--defaults) or the effective one."""
    from .configdoc import defaults_toml, effective, toml_value

    if defaults:
        typer.echo(defaults_toml(), nl=False)
        return
    try:
        rows = effective(config)
    except ConfigError as exc:
        _fail(str(exc))
    section = ""
    for r in rows:
        sec, _, name = r.key.partition(".")
        if sec != section:
            typer.echo(f"{'' if not section else chr(10)}[{sec}]")
            section = sec
        typer.echo(f"{name} = {toml_value(r.value)}  # {r.origin}")


def top(
    once: Annotated[bool, typer.Option("--once", help="print one frame as plain text and exit")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="with --once: the frame's data as one JSON object")] = False,
    interval: Annotated[float, typer.Option("--interval", "-i", help="seconds between refreshes")] = 1.0,
    filter_text: Annotated[str, typer.Option("--filter", "-f", help="pid:N port:N route:S service:S or text")] = "",
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
    socket: Annotated[str | None, typer.Option("--socket", help="the daemon's API socket ([api] socket)")] = None,
    local: Annotated[bool, typer.Option("--local", help="never ask a daemon: trace in this process")] = False,
    wait: Annotated[float, typer.Option("--wait", help="with --once and no daemon: trace this long first")] = 2.0,
    pid: Annotated[list[int] | None, typer.Option("--pid", "-p", help="in-process agent: only this process (repeatable)")] = None,
    port: Annotated[int | None, typer.Option("--port", help="in-process agent: only this server port")] = None,
) -> None:
    """A live view of the node: routes (rate, errors, P50/P95/P99, TTFT), GPUs, run queue,
    TCP retransmits, verdicts and actions; Enter shows a route's slowest recent requests.

    Reads the daemon's API socket; with no daemon running it traces by itself (root needed).

    Examples:

      sits-trace top

      sits-trace top --once --json | jq '.routes[0]'
    """
    import time

    from sits_trace.agent.capture.probes import ProbeError

    from .top import Filter, LocalSource, make_app, open_source, render_text

    if as_json and not once:
        _fail("--json needs --once (the live view is for a terminal)")
    try:
        cfg = load_config(config, overrides={"api.socket": socket, "trace.pids": pid or None,
                                             "trace.port": port, "export.jsonl_path": ""})
    except ConfigError as exc:
        _fail(str(exc))
    try:
        source = open_source("" if local else cfg.api.socket, lambda: LocalSource(cfg))
    except ProbeError as exc:
        _fail(f"no daemon answers on {cfg.api.socket} and tracing here failed: {exc}", 1)
    try:
        if once:
            if source.name != "daemon":
                time.sleep(wait)
            snap = source.snapshot()
            if as_json:
                sys.stdout.write(json.dumps(snap, default=str) + "\n")
            else:
                sys.stdout.write(render_text(snap, Filter(filter_text)))
            return
        make_app(source, interval, filter_text).run()
    finally:
        source.close()


def install_service(
    root: Annotated[Path, typer.Option("--root", help="install under this root (images, tests)")] = Path("/"),
    enable: Annotated[bool, typer.Option("--enable/--no-enable", help="systemctl enable --now when systemd runs")] = True,
    act: Annotated[bool, typer.Option("--act", help="also the drop-in control.mode act needs (root, CAP_SYS_NICE, CAP_DAC_OVERRIDE)")] = False,
) -> None:
    """Install the systemd unit, /etc/sits-trace/config.toml (kept if present) and reload systemd."""
    from .service import ServiceError, install

    try:
        for line in install(root, executable=_executable(), enable=enable, act=act):
            typer.echo(f"sits-trace: {line}", err=True)
    except ServiceError as exc:
        _fail(str(exc), 1)


def uninstall_service(
    root: Annotated[Path, typer.Option("--root", help="the root it was installed under")] = Path("/"),
    purge: Annotated[bool, typer.Option("--purge", help="also remove /etc/sits-trace")] = False,
) -> None:
    """Stop and remove the systemd unit (and, with --purge, /etc/sits-trace)."""
    from .service import ServiceError, uninstall

    try:
        for line in uninstall(root, purge=purge):
            typer.echo(f"sits-trace: {line}", err=True)
    except ServiceError as exc:
        _fail(str(exc), 1)


def _executable() -> Path:
    """This installation's `sits-trace` script (beside the running python)."""
    return Path(os.path.dirname(sys.executable)) / "sits-trace"


def register(app: Any) -> None:
    app.command()(top)
    app.add_typer(config_app, name="config")
    app.command("install-service")(install_service)
    app.command("uninstall-service")(uninstall_service)
