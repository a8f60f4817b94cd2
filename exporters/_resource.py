"""The OTel resource of a span: which service, process, host and container it came from.

A span carries ``process.pid`` and ``process.executable.name``; this adds
``service.name``, ``host.name`` and ``container.id`` (from ``/proc/<pid>/cgroup``:
docker, containerd, CRI-O and kubepods layouts). The /proc root is passed in so
tests use a fake tree; resources are cached per (pid, executable) with a bound.
"""

from __future__ import annotations

import re
import socket
from collections import OrderedDict
from collections.abc import Mapping

from sits_trace.agent.model import AttrValue, Span

# attributes that describe the process, not the request: they move to the resource
PROCESS_KEYS = ("process.pid", "process.executable.name", "process.command")

# the last path element of a cgroup line, e.g. docker-<id>.scope, cri-containerd-<id>.scope,
# crio-<id>.scope, libpod-<id>.scope, or a bare <id> (cgroup v1 /docker/<id>, /kubepods/.../<id>)
_CONTAINER_RE = re.compile(
    r"(?:^|/)(?:docker-|cri-containerd-|containerd-|crio-|libpod-)?([0-9a-f]{64})(?:\.scope)?$")
_RUNTIME_HINT = re.compile(r"docker|containerd|kubepods|crio|libpod|machine\.slice")


def container_id_from_cgroup(text: str) -> str | None:
    """The container id in a /proc/<pid>/cgroup text, or None for a host process."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1].strip()
        if not _RUNTIME_HINT.search(path):
            continue
        m = _CONTAINER_RE.search(path)
        if m:
            return m.group(1)
    return None


def parse_key_values(text: str) -> dict[str, str]:
    """'k=v,k2=v2' (OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS), %-decoded."""
    from urllib.parse import unquote  # noqa: PLC0415 - only for OTEL_RESOURCE_ATTRIBUTES

    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[unquote(key.strip())] = unquote(value.strip())
    return out


class ResourceResolver:
    """Resource attributes for a span's process; cached, bounded, never raising."""

    def __init__(self, *, service_name: str = "", extra: Mapping[str, str] | None = None,
                 proc_root: str = "/proc", hostname: str | None = None,
                 max_entries: int = 4096) -> None:
        self._service = service_name  # "" means: the traced executable's name
        self._extra = dict(extra or {})
        self._proc = proc_root
        self._host = hostname if hostname is not None else socket.gethostname()
        self._max = max_entries
        self._cache: OrderedDict[tuple[int, str], dict[str, AttrValue]] = OrderedDict()
        # the common case first: a span's pid as the tracer wrote it (an int) and its
        # executable's name, as last resolved (every span of a batch asks)
        self._by_pid: dict[int, tuple[AttrValue | None, dict[str, AttrValue]]] = {}

    def attributes(self, span: Span) -> dict[str, AttrValue]:
        raw = span.attributes.get("process.pid")
        if type(raw) is int:
            seen = self._by_pid.get(raw)
            if seen is not None and seen[0] == span.attributes.get("process.executable.name"):
                return seen[1]
        attrs = self._resolve(span)
        if type(raw) is int:
            if len(self._by_pid) >= self._max:
                self._by_pid.clear()
            self._by_pid[raw] = (span.attributes.get("process.executable.name"), attrs)
        return attrs

    def _resolve(self, span: Span) -> dict[str, AttrValue]:
        pid = _as_int(span.attributes.get("process.pid"))
        exe = str(span.attributes.get("process.executable.name", ""))
        key = (pid, exe)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        attrs = self._build(pid, exe)
        self._cache[key] = attrs
        if len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return attrs

    def _build(self, pid: int, exe: str) -> dict[str, AttrValue]:
        attrs: dict[str, AttrValue] = {"service.name": self._service or exe or "unknown_service",
                                       "host.name": self._host}
        if pid:
            attrs["process.pid"] = pid
        if exe:
            attrs["process.executable.name"] = exe
        cid = self._container_id(pid) if pid else None
        if cid:
            attrs["container.id"] = cid
        attrs.update(self._extra)
        if self._service:
            attrs["service.name"] = self._service
        return attrs

    def _container_id(self, pid: int) -> str | None:
        try:
            with open(f"{self._proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
                return container_id_from_cgroup(f.read())
        except OSError:
            return None


def _as_int(v: AttrValue | None) -> int:
    if isinstance(v, bool) or v is None:
        return 0
    try:
        return int(v)
    except ValueError:
        return 0
