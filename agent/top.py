"""`sits-trace top`: the live terminal view of a node (textual), fed by snapshots.

A snapshot (analyzers/live.py) comes from the daemon's API socket, or, when no daemon answers,
from an agent this process starts itself (root needed then). `--once` prints one frame as plain
text (`render_text`), `--once --json` the snapshot itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

Snapshot = dict[str, Any]
SPARK = "▁▂▃▄▅▆▇█"

# column label -> (snapshot key, reverse sort by default)
COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("SERVICE", "service", False), ("ROUTE", "route", False), ("KIND", "kind", False),
    ("PORT", "port", False), ("REQ/S", "rate_per_s", True), ("ERR%", "error_rate", True),
    ("P50ms", "latency_p50_ms", True), ("P95ms", "latency_p95_ms", True),
    ("P99ms", "latency_p99_ms", True), ("TTFTp50", "ttft_p50_ms", True),
    ("TTFTp95", "ttft_p95_ms", True), ("LAST 60s", "rate_history", True),
)


class SnapshotSource(Protocol):
    name: str

    def snapshot(self, slowest: bool = True) -> Snapshot: ...

    def close(self) -> None: ...


# ---- the data, as text ----

def sparkline(values: Sequence[float], width: int = 30) -> str:
    """The last `width` values (pairs summed when there are twice as many) as block characters."""
    vals = list(values)
    if len(vals) > width:
        step = -(-len(vals) // width)
        vals = [sum(vals[i:i + step]) for i in range(0, len(vals), step)]
    top = max(vals, default=0.0)
    if top <= 0:
        return " " * len(vals)
    return "".join(SPARK[min(7, int(v / top * 7.999))] if v > 0 else " " for v in vals)


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def fmt_rate(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def row_cells(r: dict[str, Any]) -> list[str]:
    return [r["service"][:16], r["route"][:40], r["kind"][:6], str(r["port"]),
            fmt_rate(r["rate_per_s"]), f"{100 * r['error_rate']:.1f}",
            fmt_ms(r["latency_p50_ms"]), fmt_ms(r["latency_p95_ms"]), fmt_ms(r["latency_p99_ms"]),
            fmt_ms(r["ttft_p50_ms"]), fmt_ms(r["ttft_p95_ms"]), sparkline(r["rate_history"], 20)]


@dataclass(slots=True)
class Filter:
    """`text` as typed: words, each either `pid:N`, `port:N`, `route:S`, `service:S`, or a
    substring of the service, route, port or pids; a route must match every word."""

    text: str = ""

    def matches(self, r: dict[str, Any]) -> bool:
        return all(self._word(w, r) for w in self.text.split())

    @staticmethod
    def _word(w: str, r: dict[str, Any]) -> bool:
        field, _, value = w.partition(":")
        if value and field == "pid":
            return value in {str(p) for p in r["pids"]}
        if value and field == "port":
            return value == str(r["port"])
        if value and field in ("route", "service"):
            return value.lower() in str(r[field]).lower()
        hay = " ".join([r["service"], r["route"], str(r["port"]), *map(str, r["pids"])])
        return w.lower() in hay.lower()


def sort_routes(routes: list[dict[str, Any]], key: str, reverse: bool) -> list[dict[str, Any]]:
    def k(r: dict[str, Any]) -> Any:
        v = r[key]
        if key == "rate_history":
            return sum(v)
        return (v is not None, v if v is not None else 0)
    return sorted(routes, key=k, reverse=reverse)


_GPU_FIELDS = (("util", "gpu_util_pct", "{:.0f}%"), ("sm", "sm_active_pct", "{:.0f}%"),
               ("mem", "memory_used_bytes", "{:.1f}GiB"), ("pcie tx", "pcie_tx_bytes_per_s", "{:.0f}MB/s"),
               ("rx", "pcie_rx_bytes_per_s", "{:.0f}MB/s"), ("clk", "sm_clock_mhz", "{:.0f}MHz"),
               ("reasons", "clocks_event_reasons", "{:#x}"), ("power", "power_w", "{:.0f}W"))
_SCALE = {"memory_used_bytes": 2**-30, "pcie_tx_bytes_per_s": 1e-6, "pcie_rx_bytes_per_s": 1e-6}


def gpu_lines(snap: Snapshot) -> list[str]:
    gpus: dict[str, dict[str, float]] = snap.get("gpus", {})
    if not gpus:
        return ["GPU   no GPU signals on this node (no NVML device); spans and node signals work"]
    out = []
    for ent, sig in gpus.items():
        parts = []
        for label, key, fmt in _GPU_FIELDS:
            if key in sig:
                v = sig[key] * _SCALE.get(key, 1.0)
                parts.append(f"{label} {fmt.format(int(v) if 'x' in fmt else v)}")
        out.append(f"{ent.upper():<5} " + "  ".join(parts))
    return out


def node_line(snap: Snapshot) -> str:
    n: dict[str, float] = snap.get("node", {})
    parts = []
    if "cpu_runq_delay_s_per_s" in n:
        parts.append(f"run-queue {1000 * n['cpu_runq_delay_s_per_s']:.1f} ms/s over "
                     f"{n.get('cpu_runq_processes', 0):.0f} procs "
                     f"(worst mean wait {n.get('cpu_runq_worst_mean_wait_us', 0):.0f} us)")
    else:
        parts.append("run-queue -")
    if "tcp_retransmits_per_s" in n:
        parts.append(f"TCP retransmits {n['tcp_retransmits_per_s']:.1f}/s  "
                     f"resets out {n.get('tcp_resets_out_per_s', 0):.1f}/s "
                     f"in {n.get('tcp_resets_in_per_s', 0):.1f}/s")
    else:
        parts.append("TCP -")
    return "NODE  " + "   ".join(parts)


def agent_line(snap: Snapshot) -> str:
    a = snap.get("agent", {})
    t = a.get("tracer", {})
    lost = sum(a.get("kernel_lost", {}).values())
    return (f"AGENT {snap.get('source', '?')}  spans {t.get('spans', 0)}  "
            f"lost {lost}  shed {t.get('exchanges_shed', 0)}  "
            f"resyncs {t.get('parser', {}).get('resyncs', 0)}  window {snap.get('window_s', 0):.0f}s")


def verdict_lines(snap: Snapshot) -> list[str]:
    out = []
    for title, key in (("VERDICTS", "verdicts"), ("ACTIONS", "actions")):
        items = snap.get(key, [])
        if not items:
            out.append(f"{title:<9} none yet")
        for v in items[-5:]:
            out.append(f"{title:<9} " + "  ".join(f"{k}={v[k]}" for k in v))
    return out


def render_text(snap: Snapshot, flt: Filter | None = None, sort_key: str = "rate_per_s",
                reverse: bool = True) -> str:
    routes = [r for r in snap.get("routes", []) if (flt or Filter()).matches(r)]
    routes = sort_routes(routes, sort_key, reverse)
    header = [c[0] for c in COLUMNS]
    rows = [row_cells(r) for r in routes]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    lines = [agent_line(snap), node_line(snap), *gpu_lines(snap), ""]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if not rows:
        lines.append("(no requests in the window yet)")
    lines += ["", *verdict_lines(snap)]
    return "\n".join(lines) + "\n"


def span_detail(span: dict[str, Any]) -> str:
    """Every field and attribute of one recent span, attributes sorted (sits.* grouped)."""
    lines = [f"trace_id  {span['trace_id']}", f"span_id   {span['span_id']}",
             f"parent    {span.get('parent_span_id') or '-'}", f"name      {span['name']}",
             f"kind      {span['kind']}", f"duration  {span.get('duration_ms', 0):.3f} ms",
             f"status    {span.get('status', {}).get('code', '')}", ""]
    attrs: dict[str, Any] = span.get("attributes", {})
    width = max((len(k) for k in attrs), default=0)
    lines += [f"{k:<{width}}  {attrs[k]}" for k in sorted(attrs)]
    return "\n".join(lines)


# ---- sources ----

class DaemonSource:
    name = "daemon"

    def __init__(self, socket_path: str) -> None:
        self.path = socket_path

    def snapshot(self, slowest: bool = True) -> Snapshot:
        from .api import query

        snap: Snapshot = query(self.path, "snapshot" if slowest else "summary")
        return snap

    def close(self) -> None:
        pass


class LocalSource:
    """An agent of this process's own, tracing into a live view (needs root, like `trace`)."""

    name = "in-process"

    def __init__(self, cfg: Any) -> None:
        from sits_trace.analyzers.live import LiveView

        from .daemon import Agent

        self.live = LiveView(window_s=cfg.api.window_s, slowest=cfg.api.slowest,
                             service_name=cfg.export.service_name)
        self.agent = Agent(cfg, self.live.add)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Attach the probes (raises ProbeError) and trace from a background thread."""
        self.agent.start()
        self._thread = threading.Thread(target=self.agent.run, args=(self._stop,),
                                        name="sits-agent", daemon=True)
        self._thread.start()

    def snapshot(self, slowest: bool = True) -> Snapshot:
        from .surface import snapshot

        return snapshot(self.agent, self.live, source=self.name, slowest=slowest)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


# ---- the app ----

def table_lines(routes: list[dict[str, Any]], sort_index: int, reverse: bool) -> list[str]:
    """The header and one line per route, columns padded to their widest cell."""
    header = [c[0] + (("v" if reverse else "^") if i == sort_index else "")
              for i, c in enumerate(COLUMNS)]
    rows = [row_cells(r) for r in routes]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [header, *rows]]


def make_app(source: SnapshotSource, interval_s: float = 1.0, filter_text: str = "") -> Any:
    """The textual App (imported here so `--once` and the API never import textual).

    The routes table is one Text redrawn per refresh (a DataTable re-renders every cell on
    each change: ~10x the CPU at 30 routes), with its own cursor."""
    from rich.text import Text
    from textual.app import App, ComposeResult
    from textual.binding import Binding
    from textual.containers import VerticalScroll
    from textual.screen import Screen
    from textual.widgets import Footer, Input, Static

    class DetailScreen(Screen[None]):
        BINDINGS: ClassVar[list[Any]] = [Binding("escape,q", "app.pop_screen", "Back")]

        def __init__(self, route: dict[str, Any]) -> None:
            super().__init__()
            self.route = route

        def compose(self) -> ComposeResult:
            r = self.route
            yield Static(f"slowest recent requests of {r['service']} {r['kind']} {r['route']} "
                         f"port {r['port']} ({len(r['slowest'])} kept)", id="detail-title")
            with VerticalScroll():
                for i, span in enumerate(r["slowest"], 1):
                    yield Static(f"#{i}\n{span_detail(span)}\n", classes="span", markup=False)
                if not r["slowest"]:
                    yield Static("no request in the window")
            yield Footer()

    class TopApp(App[None]):
        TITLE = "sits-trace top"
        AUTO_FOCUS = None  # keys go to the app's bindings; "/" focuses the filter box
        CSS = ("#status, #gpu, #verdicts { height: auto; padding: 0 1; } "
               "#filter { display: none; } #filter.shown { display: block; } "
               "#routes { height: 1fr; padding: 0 1; } "
               ".span { padding: 0 1; border-bottom: solid $panel; }")
        BINDINGS: ClassVar[list[Any]] = [
            Binding("q", "quit", "Quit"), Binding("slash", "filter", "Filter"),
            Binding("s", "sort", "Sort"), Binding("r", "reverse", "Reverse"),
            Binding("enter", "drill", "Slowest requests"), Binding("p", "pause", "Pause"),
            Binding("up,k", "move(-1)", "Up", show=False),
            Binding("down,j", "move(1)", "Down", show=False),
            Binding("pageup", "move(-10)", show=False), Binding("pagedown", "move(10)", show=False),
        ]

        def __init__(self) -> None:
            super().__init__()
            self.source = source
            self.filter = Filter(filter_text)
            self.sort_index = 4  # REQ/S
            self.reverse = True
            self.paused = False
            self.snap: Snapshot = {}
            self.shown: list[dict[str, Any]] = []
            self.cursor = 0
            self.texts: dict[str, str] = {}
            self.error = ""

        def compose(self) -> ComposeResult:
            yield Static("", id="status", markup=False)
            yield Static("", id="gpu", markup=False)
            yield Input(placeholder="filter: pid:N port:N route:S service:S or any text (Enter)",
                        id="filter", value=filter_text)
            yield Static("", id="routes")
            yield Static("", id="verdicts", markup=False)
            yield Footer()

        def on_mount(self) -> None:
            self.refresh_data()
            self.set_interval(interval_s, self.refresh_data)

        def refresh_data(self) -> None:
            if self.paused or len(self.screen_stack) > 1:  # frozen while a drill-down is open
                return
            try:
                self.snap = self.source.snapshot(slowest=False)
                self.error = ""
            except Exception as exc:  # noqa: BLE001 - shown in the status line, retried
                self.error = str(exc)
            self.redraw()

        def _set(self, selector: str, text: str) -> None:
            if self.texts.get(selector) != text:
                self.texts[selector] = text
                self.query_one(selector, Static).update(text)

        def redraw(self) -> None:
            snap = self.snap
            status = agent_line(snap) + "\n" + node_line(snap)
            if self.error:
                status += f"\n{self.error}"
            self._set("#status", status)
            self._set("#gpu", "\n".join(gpu_lines(snap)))
            self._set("#verdicts", "\n".join(verdict_lines(snap)))
            _, key, _ = COLUMNS[self.sort_index]
            self.shown = sort_routes([r for r in snap.get("routes", []) if self.filter.matches(r)],
                                     key, self.reverse)
            self.cursor = max(0, min(self.cursor, len(self.shown) - 1))
            self._draw_table()
            self.sub_title = (f"{len(self.shown)} routes  sort {COLUMNS[self.sort_index][0]}"
                              + (f"  filter '{self.filter.text}'" if self.filter.text else "")
                              + ("  PAUSED" if self.paused else ""))

        def _draw_table(self) -> None:
            widget = self.query_one("#routes", Static)
            lines = table_lines(self.shown, self.sort_index, self.reverse)
            height = max(2, widget.size.height or 20) - 1
            top = max(0, self.cursor - height + 1)
            text = Text(lines[0] + "\n", style="bold", no_wrap=True, overflow="crop")
            for i, line in enumerate(lines[1 + top: 1 + top + height], top):
                text.append(line + "\n", style="reverse" if i == self.cursor else "")
            if not self.shown:
                text.append("(no requests in the window yet)")
            key = "\n".join(lines) + f"|{self.cursor}|{top}"
            if self.texts.get("#routes") != key:
                self.texts["#routes"] = key
                widget.update(text)

        def visible_routes(self) -> list[str]:
            """The table's route lines, as shown (tests read it)."""
            return table_lines(self.shown, self.sort_index, self.reverse)[1:]

        def action_move(self, delta: int) -> None:
            self.cursor = max(0, min(self.cursor + delta, len(self.shown) - 1))
            self._draw_table()

        def action_filter(self) -> None:
            box = self.query_one("#filter", Input)
            box.add_class("shown")
            box.focus()

        def on_input_submitted(self, event: Input.Submitted) -> None:
            self.filter = Filter(event.value.strip())
            if not self.filter.text:
                event.input.remove_class("shown")
            self.set_focus(None)
            self.redraw()

        def action_sort(self) -> None:
            self.sort_index = (self.sort_index + 1) % len(COLUMNS)
            self.reverse = COLUMNS[self.sort_index][2]
            self.redraw()

        def action_reverse(self) -> None:
            self.reverse = not self.reverse
            self.redraw()

        def action_pause(self) -> None:
            self.paused = not self.paused
            self.redraw()

        def action_drill(self) -> None:
            if not 0 <= self.cursor < len(self.shown):
                return
            want = _route_id(self.shown[self.cursor])
            try:  # the slowest spans travel only on demand
                full = self.source.snapshot(slowest=True)
            except Exception as exc:  # noqa: BLE001 - shown, the view goes on
                self.error = str(exc)
                self.redraw()
                return
            route = next((r for r in full.get("routes", []) if _route_id(r) == want),
                         self.shown[self.cursor] | {"slowest": []})
            self.push_screen(DetailScreen(route))

    return TopApp()


def _route_id(r: dict[str, Any]) -> str:
    return f"{r['service']}|{r['kind']}|{r['port']}|{r['route']}"


def open_source(socket_path: str, start_local: Callable[[], LocalSource]) -> SnapshotSource:
    """The daemon when its socket answers, else an agent of our own."""
    from .api import ApiError, query

    if socket_path:
        try:
            query(socket_path, "ping", timeout_s=2.0)
            return DaemonSource(socket_path)
        except ApiError:
            pass
    local = start_local()
    local.start()
    return local
