"""sits-trace command line (typer): trace, run, doctor, stats, rca, record.

Errors a user can cause end in one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from sits_trace.agent.capture.probes import ProbeError
from sits_trace.agent.config import ConfigError
from sits_trace.agent.config import load as load_config
from sits_trace.agent.model import Span

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="eBPF request tracing for GPU inference nodes: every HTTP/HTTPS request as a span.",
)


def _fail(msg: str, code: int = 2) -> NoReturn:
    typer.echo(f"sits-trace: {msg}", err=True)
    raise typer.Exit(code)


def _started(agent: Any) -> threading.Event:
    """Start `agent` (one line and exit 2 when its probes cannot load); the event Ctrl-C or
    SIGTERM sets."""
    stop = threading.Event()
    _install_stop(stop)
    try:
        agent.start()
    except ProbeError as exc:
        _fail(str(exc))
    return stop


def _install_stop(stop: threading.Event, reload: threading.Event | None = None) -> None:
    """SIGINT/SIGTERM stop (drain and flush); a second one ends at once. SIGHUP reloads
    where `reload` is given (`run`), else stops."""

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():  # stopping already takes too long for whoever sends it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop.set()

    def hup(_signum: int, _frame: Any) -> None:
        assert reload is not None
        reload.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, hup if reload is not None else handler)


class _TablePrinter:
    """A readable line per span, flushed as it comes."""

    HEADER = f"{'START':<12} {'KIND':<6} {'PID':>7} {'COMM':<12} {'METHOD':<7} {'STATUS':>6} " \
             f"{'DUR_MS':>9} {'TTFB_MS':>8}  PATH  REQUEST-ID"

    def __init__(self) -> None:
        typer.echo(self.HEADER)

    def __call__(self, s: Span) -> None:
        a = s.attributes
        import datetime  # noqa: PLC0415

        start = datetime.datetime.fromtimestamp(s.start_time_unix_nano / 1e9).strftime("%H:%M:%S.%f")[:12]
        dur = (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6
        status = a.get("http.response.status_code", "-")
        tls = "+tls" if a.get("tls") else ""
        ttfb = a.get("sits.ttfb_ms", "")
        ttfb_s = f"{ttfb:8.3f}" if isinstance(ttfb, float) else f"{'-':>8}"
        typer.echo(
            f"{start:<12} {s.kind[:6]:<6} {a.get('process.pid', 0):>7} "
            f"{str(a.get('process.executable.name', ''))[:12]:<12} "
            f"{a.get('http.request.method', '')!s:<7} {status!s:>6} {dur:9.3f} {ttfb_s}  "
            f"{a.get('url.path', '')}{tls}  {a.get('http.request.header.x-request-id', '')}"
        )
        sys.stdout.flush()


class _JsonPrinter:
    """`trace --json`: a span's line is held until the tracer's poll that made it is done
    (`Tracer.poll_observers`), then a poll's lines go out in one write: a write and a flush
    per span were a syscall per span. Lines are out within a poll (`trace.poll_ms`)."""

    MAX_HELD = 256

    def __init__(self) -> None:
        self._held: list[bytes] = []
        self.closed = False
        self.on_closed: Any = None  # called once when stdout's reader went away (`| head`)

    def __call__(self, s: Span) -> None:
        self._held.append(s.json_bytes())
        if len(self._held) >= self.MAX_HELD:
            self.flush()

    def many(self, spans: list[Span]) -> None:
        """A tracer's batch (agent/sinks.py): its lines, written out every MAX_HELD."""
        held = self._held
        for s in spans:
            held.append(s.json_bytes())
            if len(held) >= self.MAX_HELD:
                self.flush()
                held = self._held

    def flush(self) -> None:
        if not self._held:
            return
        data, self._held = b"".join(self._held), []
        if self.closed:
            return
        try:
            out = getattr(sys.stdout, "buffer", None)
            if out is None:  # a text-only stream (a test's capture)
                sys.stdout.write(data.decode())
                sys.stdout.flush()
                return
            sys.stdout.flush()  # anything written as text first
            out.write(data)
            out.flush()
        except BrokenPipeError:
            # the reader is gone (`trace --json | head -3`): stop as it would have stopped
            # us, quietly; stdout to /dev/null so the interpreter's last flush finds no pipe
            self.closed = True
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):  # a stdout with no descriptor
                pass
            if self.on_closed is not None:
                self.on_closed()


@app.command()
def trace(
    pid: Annotated[list[int] | None, typer.Option("--pid", "-p", help="trace only this process and its children (repeatable)")] = None,
    port: Annotated[int | None, typer.Option("--port", help="only spans whose server port is this")] = None,
    duration: Annotated[float | None, typer.Option("--duration", "-d", help="stop after this many seconds")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per span on stdout, nothing else")] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
    record: Annotated[Path | None, typer.Option("--record", help="also save raw ring-buffer records to this file (fixtures). It holds the raw "
                                                                              "bytes, secrets included: created 0600, keep it private")] = None,
    replay: Annotated[Path | None, typer.Option("--replay", help="decode a recording instead of the kernel (no root needed)")] = None,
    cpu_budget: Annotated[float | None, typer.Option("--cpu-budget", help="cores the agent may use before the kernel samples exchanges (0: capture all)")] = None,
) -> None:
    """Print every completed HTTP/HTTPS span.

    Examples:

      sits-trace trace --json                 # all processes, JSON lines

      sits-trace trace -p $(pgrep -o nginx) --port 443 -d 30
    """
    try:
        cfg = load_config(config, overrides={"trace.pids": pid or None, "trace.port": port,
                                             "trace.cpu_budget": cpu_budget})
    except ConfigError as exc:
        _fail(str(exc))
    printer = _JsonPrinter() if as_json else None
    sink = printer or _TablePrinter()
    if replay is not None:
        _replay(replay, sink, cfg.trace.port or None, cfg.trace.redact_query_keys,
                printer.flush if printer else None)
        return
    from sits_trace.agent.capture.loader import (  # noqa: PLC0415
        EventSource,
        Recorder,
        RingSource,
        TeeSource,
    )
    from sits_trace.agent.daemon import Agent, format_stats_lines  # noqa: PLC0415

    def source(ring: RingSource) -> EventSource:
        return TeeSource(ring, Recorder(record)) if record else ring

    agent = Agent(cfg, sink, wrap_source=source)
    stop = _started(agent)
    if printer is not None and agent.tracer is not None:
        printer.on_closed = stop.set
        agent.tracer.poll_observers.append(printer.flush)
    typer.echo("sits-trace: tracing; Ctrl-C to stop", err=True)
    agent.run(stop, duration)
    if agent.tracer is not None:
        agent.tracer.source.close()  # closes the --record file
    for line in format_stats_lines(agent.stats()):
        typer.echo(f"sits-trace: {line}", err=True)


def _replay(path: Path, sink: Any, port: int | None, redact_keys: list[str],
            flush: Any = None) -> None:
    from sits_trace.agent.capture.loader import RecordedSource  # noqa: PLC0415
    from sits_trace.agent.tracing.pipeline import Tracer  # noqa: PLC0415
    from sits_trace.agent.tracing.redact import QueryRedactor  # noqa: PLC0415
    from sits_trace.agent.tracing.spans import SpanBuilder  # noqa: PLC0415

    try:
        src = RecordedSource(path)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    builder = SpanBuilder(clock_offset_ns=0, redactor=QueryRedactor(redact_keys))
    tracer = Tracer(src, sink, builder, port=port,
                    monotonic_ns=lambda: 0)
    if flush is not None:
        tracer.poll_observers.append(flush)
    while not src.exhausted:
        tracer.poll(0)
    tracer.close_all()


@app.command()
def run(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
) -> None:
    """Run the agent as a daemon: spans to the configured exporters until SIGTERM/SIGINT.

    On stop it drains the ring buffer and flushes every pending span.
    """
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        _fail(str(exc))
    from sits_trace.agent.daemon import Agent, format_stats_lines  # noqa: PLC0415
    from sits_trace.exporters import build_exporters  # noqa: PLC0415

    try:
        exporters = build_exporters(cfg)
    except (ConfigError, OSError) as exc:
        _fail(_exporter_error(cfg, exc))
    from .surface import operator_surface  # noqa: PLC0415 - the API only for `run`

    view = _live_view(cfg)  # what `sits-trace top` reads over the API socket
    agent = Agent(cfg, view.tee(exporters.sink))
    stop, reload = threading.Event(), threading.Event()
    _install_stop(stop, reload)
    try:
        agent.start()
    except ProbeError as exc:
        _fail(str(exc))
    exporters.attach_agent(agent)
    surface = operator_surface(cfg, agent, view, _fail)  # API socket, then READY=1
    typer.echo("sits-trace: agent running", err=True)
    live = [exporters]

    def on_reload() -> None:
        live[0] = _reload(config, agent, live[0], view.tee)

    try:
        agent.run(stop, reload=reload, on_reload=on_reload)
    finally:
        surface.stop()
        _shutdown(live[0])
    for line in format_stats_lines(agent.stats()):
        typer.echo(f"sits-trace: {line}", err=True)


def _exporter_error(cfg: Any, exc: Exception) -> str:
    """One line naming the key behind an exporter that could not start."""
    e = cfg.export
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return (f"export.prometheus_port: {e.prometheus_address}:{e.prometheus_port} is in use; "
                "choose a free port, or 0 to turn /metrics off")
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) == e.jsonl_path:
        return f"export.jsonl_path: {e.jsonl_path!r}: {exc.strerror}; choose a writable file"
    if isinstance(exc, OSError):
        return (f"exporters: {exc.strerror or exc}; check export.jsonl_path, "
                "export.prometheus_address and export.prometheus_port")
    return str(exc)


def _shutdown(exporters: Any) -> None:
    """Flush and stop the exporters within STOP_FLUSH_S together."""
    from sits_trace.agent.daemon import STOP_FLUSH_S  # noqa: PLC0415 - BCC stack: on use

    exporters.shutdown(STOP_FLUSH_S / max(1, len(exporters.exporters)))


def _reload(config: Path | None, agent: Any, old: Any,
            tee: Any = lambda sink: sink) -> Any:
    """SIGHUP: read the config file again; new exporters (endpoints, a reopened JSONL file
    after logrotate's rename) and CPU budget. A bad file keeps everything as it was."""
    from sits_trace.exporters import build_exporters  # noqa: PLC0415 - OTel stack: on use

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        typer.echo(f"sits-trace: reload refused, running configuration kept: {exc}", err=True)
        return old
    _shutdown(old)  # flushes to the old file / endpoint; frees the /metrics port
    try:
        new = build_exporters(cfg)
    except (ConfigError, OSError) as exc:
        typer.echo(f"sits-trace: reload: {exc}; previous exporters restored", err=True)
        cfg.export = agent.cfg.export
        new = build_exporters(agent.cfg)
    new.attach_agent(agent)
    agent.set_sink(tee(new.sink))  # the live view keeps its spans
    agent.set_cpu_budget(cfg.trace.cpu_budget)
    agent.cfg.export = cfg.export
    typer.echo("sits-trace: configuration reloaded", err=True)
    return new


def _live_view(cfg: Any) -> Any:
    from sits_trace.analyzers.live import LiveView  # noqa: PLC0415 - numpy only when run

    return LiveView(window_s=cfg.api.window_s, slowest=cfg.api.slowest,
                    service_name=cfg.export.service_name)


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable result")] = False,
) -> None:
    """Check what the agent needs, and print the one-line fix for each missing thing."""
    from sits_trace.agent.doctor import render, run_checks  # noqa: PLC0415

    checks = run_checks()
    if as_json:
        typer.echo(json.dumps([c.as_dict() for c in checks], indent=1))
    else:
        render(checks)
    if any(c.core and not c.ok for c in checks):
        raise typer.Exit(1)


@app.command()
def stats() -> None:
    """Print the running agent's counters (events seen and lost, spans, parser resyncs)."""
    from sits_trace.agent.config import STATS_PATH  # noqa: PLC0415

    try:
        typer.echo(STATS_PATH.read_text())
    except OSError:
        _fail(f"no stats at {STATS_PATH}: is `sits-trace run` running?", 1)


def _verdict_printer(as_json: bool) -> Any:
    lock = threading.Lock()

    def out(v: Any) -> None:
        line = json.dumps(v.to_json(), separators=(",", ":")) if as_json else v.line()
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    return out


def _rank_tables(normal: Path, anomalous: Path | None, method: str) -> None:
    if anomalous is None:
        _fail("--normal needs --anomalous (two metric tables, first column `time`)")
    from sits_trace.analyzers import baselines  # noqa: PLC0415 - pandas only for this command
    if method not in ("sits", "baro", "nsigma"):
        _fail(f"--method {method!r} is not one of sits, baro, nsigma")
    try:
        ranking = baselines.rank_table(baselines.load_table(normal),
                                       baselines.load_table(anomalous), method)
    except (OSError, ValueError, KeyError) as exc:
        _fail(f"cannot rank {normal} / {anomalous}: {exc}")
    items = ranking.items() if isinstance(ranking, dict) else ranking
    rows = [r if isinstance(r, dict) else {"metric": str(r[0]), "score": float(r[1])}
            for r in items]
    typer.echo(json.dumps({"ranking": rows}, separators=(",", ":")))


@app.command()
def rca(
    pid: Annotated[list[int] | None, typer.Option("--pid", "-p", help="trace only this process and its children (repeatable)")] = None,
    port: Annotated[int | None, typer.Option("--port", help="only spans whose server port is this")] = None,
    window: Annotated[float | None, typer.Option("--window", help="seconds per judged window (default rca.window_s, 10)")] = None,
    duration: Annotated[float | None, typer.Option("--duration", "-d", help="stop after this many seconds")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per verdict on stdout, nothing else")] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file ([rca], [[slo]])")] = None,
    from_file: Annotated[Path | None, typer.Option("--from", help="judge a recording (sits-trace record) instead of the kernel")] = None,
    normal: Annotated[Path | None, typer.Option("--normal", help="metric table (CSV, first column time) of normal operation")] = None,
    anomalous: Annotated[Path | None, typer.Option("--anomalous", help="metric table of the anomalous period")] = None,
    method: Annotated[str, typer.Option("--method", help="with --normal/--anomalous: sits, baro or nsigma")] = "sits",
    at: Annotated[str | None, typer.Option("--at", help="with --from: diagnose only the window holding this time (unix seconds or ISO 8601), breach or not")] = None,
) -> None:
    """Print a verdict whenever a service misses its SLO or degrades: the causes, ranked,
    with culprit, evidence and the milliseconds each explains (docs/rca.md).

    Examples:

      sits-trace rca --json -p $(pgrep -of vllm) --window 10

      sits-trace rca --from run.jsonl.gz --json

      sits-trace rca --from run.jsonl.gz --at 2026-12-05T12:03:20Z

      sits-trace rca --normal n.csv --anomalous a.csv --method baro --json
    """
    if normal is not None or anomalous is not None:
        _rank_tables(normal or Path(), anomalous, method.lower())
        return
    try:
        cfg = load_config(config, overrides={"trace.pids": pid or None, "trace.port": port})
    except ConfigError as exc:
        _fail(str(exc))
    from sits_trace.analyzers.rca.setup import SetupError, build_engine  # noqa: PLC0415

    printer = _verdict_printer(as_json)
    if at is not None and from_file is None:
        _fail("--at needs --from: a recording to look back into")
    if from_file is not None:
        _rca_replay(cfg, from_file, window, printer, None if at is None else _time_ns(at))
        return
    from sits_trace.analyzers.rca.live import LiveRca  # noqa: PLC0415

    from .daemon import Agent  # noqa: PLC0415

    holder: list[Any] = []
    try:
        engine = build_engine(cfg.rca, cfg.slo, window_s=window,
                              service_name=cfg.export.service_name,
                              frame=lambda: holder[0].features.frame()
                              if holder and holder[0].features is not None else None, live=True)
    except SetupError as exc:
        _fail(str(exc))
    agent = Agent(cfg, engine.add)
    holder.append(agent)
    stop = _started(agent)
    live = LiveRca(engine, [printer])
    live.start()
    typer.echo(f"sits-trace: judging {engine.s.window_s:g} s windows; Ctrl-C to stop", err=True)
    agent.run(stop, duration)
    live.stop()


def _time_ns(text: str) -> int:
    """Unix seconds or an ISO 8601 time (UTC unless it says otherwise) in ns."""
    import datetime as dt  # noqa: PLC0415

    try:
        return int(float(text) * 1e9)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        _fail(f"--at {text!r}: not unix seconds or an ISO 8601 time")
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return int(t.timestamp() * 1e9)


def _rca_replay(cfg: Any, path: Path, window: float | None, printer: Any,
                at_ns: int | None = None) -> None:
    from sits_trace.analyzers.rca.offline import frame_of, replay  # noqa: PLC0415
    from sits_trace.analyzers.rca.recording import RecordingError, read  # noqa: PLC0415
    from sits_trace.analyzers.rca.setup import SetupError, build_engine  # noqa: PLC0415

    try:
        rec = read(path)
    except (OSError, RecordingError) as exc:
        _fail(str(exc))
    ts = [s.end_time_unix_nano for s in rec.spans] or [0]
    try:
        engine = build_engine(cfg.rca, cfg.slo, window_s=window,
                              service_name=cfg.export.service_name, frame=frame_of(rec),
                              clock_ns=lambda: min(ts),
                              exclude_pids={int(rec.meta.get("agent_pid", 0))} - {0})
    except SetupError as exc:
        _fail(str(exc))
    if at_ns is not None:
        if not rec.spans or not min(ts) <= at_ns <= max(ts):
            _fail(f"--at: the recording's spans end between {min(ts) / 1e9:.3f} and "
                  f"{max(ts) / 1e9:.3f} (unix seconds)")
        engine.asked = lambda t0, t1: t0 <= at_ns < t1
    shown = 0
    for v in replay(rec, engine):
        if at_ns is None or v.window_start_unix_nano <= at_ns < v.window_end_unix_nano:
            printer(v)
            shown += 1
    if at_ns is not None and not shown:
        _fail(f"--at: the window holding that time has fewer than {engine.s.min_spans} "
              "requests of any service: nothing to diagnose", 1)


@app.command()
def record(
    out: Annotated[Path, typer.Option("--out", "-o", help="recording to write (gzip JSON lines)")],
    duration: Annotated[float, typer.Option("--duration", "-d", help="seconds to record")],
    pid: Annotated[list[int] | None, typer.Option("--pid", "-p", help="trace only this process and its children (repeatable)")] = None,
    port: Annotated[int | None, typer.Option("--port", help="only spans whose server port is this")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
) -> None:
    """Record spans, per-process CPU/memory and the per-second feature frame for offline
    analysis (`sits-trace rca --from FILE`) and fixtures.

    Examples:

      sits-trace record --out run.jsonl.gz --duration 60 -p $(pgrep -of uvicorn)
    """
    try:
        cfg = load_config(config, overrides={"trace.pids": pid or None, "trace.port": port})
    except ConfigError as exc:
        _fail(str(exc))
    import time  # noqa: PLC0415

    from sits_trace.analyzers.rca.live import RecordingLoop  # noqa: PLC0415
    from sits_trace.analyzers.rca.recording import Writer  # noqa: PLC0415

    from .daemon import Agent  # noqa: PLC0415

    try:
        writer = Writer(out, cfg.rca.window_s, time.time_ns(), os.getpid())
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror}")
    agent = Agent(cfg, writer.span)
    stop = _started(agent)

    def row(t_ns: int) -> None:
        if agent.features is not None:
            writer.frame(t_ns, agent.features.latest())

    loop = RecordingLoop(writer.procs, row)
    loop.start()
    typer.echo(f"sits-trace: recording to {out}; Ctrl-C to stop", err=True)
    agent.run(stop, duration)
    loop.stop()
    writer.close()
    typer.echo(f"sits-trace: {writer.spans} spans recorded", err=True)
from .opscli import register as _register_ops  # noqa: E402 - top, config, install-service, after app exists

_register_ops(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
