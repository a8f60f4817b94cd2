"""Recordings for offline analysis and fixtures: gzip-compressed JSON lines.

  {"type": "meta", "version": 1, "window_s": 10, "started_unix_nano": ...}
  {"type": "span", "span": <the span as `trace --json` prints it>}
  {"type": "procs", "t": ..., "psi": {...}, "procs": [[pid, comm, cpu_s, rss_mb, majflt, minflt]]}
  {"type": "frame", "t": ..., "row": [[signal, entity, value], ...]}   (the feature frame)
  {"type": "label", "cause": ..., "culprit": ..., "start_ns": ..., "end_ns": ..., ...}

Labels come from the fault runner (bench/rca_runs.py): the truth the evaluation scores against.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sits_trace.agent.model import Row, Span

from .procs import ProcSnapshot

VERSION = 1


class RecordingError(ValueError):
    """A file that is not a recording; the message says which line."""


class Writer:
    def __init__(self, path: Path, window_s: float = 10.0, started_ns: int = 0,
                 agent_pid: int = 0) -> None:
        # held open for the whole recording; close() ends it
        self._f: IO[str] = gzip.open(path, "wt", compresslevel=6)  # noqa: SIM115
        self._lock = threading.Lock()
        self.spans = 0
        self._write({"type": "meta", "version": VERSION, "window_s": window_s,
                     "started_unix_nano": started_ns, "agent_pid": agent_pid})

    def _write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            self._f.write(line)

    def span(self, s: Span) -> None:
        self.spans += 1
        self._write({"type": "span", "span": s.to_json()})

    def procs(self, snap: ProcSnapshot) -> None:
        self._write({"type": "procs", **snap.to_json()})

    def frame(self, t_ns: int, row: Row) -> None:
        self._write({"type": "frame", "t": t_ns, "row": [[s, e, v] for (s, e), v in row.items()]})

    def label(self, **fields: Any) -> None:
        self._write({"type": "label", **fields})

    def close(self) -> None:
        with self._lock:
            self._f.close()


def span_from_json(d: dict[str, Any]) -> Span:
    return Span(str(d["trace_id"]), str(d["span_id"]), d.get("parent_span_id"), str(d["name"]),
                str(d["kind"]), int(d["start_time_unix_nano"]), int(d["end_time_unix_nano"]),
                dict(d.get("attributes", {})), str(d.get("status", {}).get("code", "UNSET")))


@dataclass(slots=True)
class Recording:
    meta: dict[str, Any] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    procs: list[ProcSnapshot] = field(default_factory=list)
    frames: list[tuple[int, Row]] = field(default_factory=list)
    labels: list[dict[str, Any]] = field(default_factory=list)


def lines(path: Path) -> Iterator[dict[str, Any]]:
    try:
        with gzip.open(path, "rt") as f:
            for n, line in enumerate(f, 1):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    raise RecordingError(f"{path}:{n}: not a JSON line") from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise RecordingError(f"{path}: not a gzip recording ({exc})") from None


def read(path: Path) -> Recording:
    rec = Recording()
    for d in lines(path):
        t = d.get("type")
        if t == "meta":
            rec.meta = d
        elif t == "span":
            rec.spans.append(span_from_json(d["span"]))
        elif t == "procs":
            rec.procs.append(ProcSnapshot.from_json(d))
        elif t == "frame":
            rec.frames.append((int(d["t"]), {(str(s), str(e)): float(v) for s, e, v in d["row"]}))
        elif t == "label":
            rec.labels.append(d)
    if not rec.meta:
        raise RecordingError(f"{path}: no meta line: not a sits-trace recording")
    return rec
