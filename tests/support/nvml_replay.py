"""Record and replay NVML: the fixtures of the NVML sampler's tests.

RecordingNvml wraps pynvml and keeps every nvml* call's answer (tests/gpu/scenario.py records
one on a GPU machine); ReplayNvml plays such a recording back through pynvml's interface, so
agent/signals/nvml.py's sampler runs unchanged without a GPU (tests/unit/test_nvml_replay.py).
Test code: nothing in the agent imports it.
"""

from __future__ import annotations

import ctypes
import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sits_trace.agent.signals.nvml import _NO_DATA, error_code

_OPAQUE = ("nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlEventSetCreate")


class RecordingNvml:
    """Wraps pynvml: every nvml* call goes through and its result is kept for `save()`."""

    def __init__(self, base: Any, *, meta: dict[str, Any] | None = None) -> None:
        self._base = base
        self._handles: dict[int, str] = {}
        self.calls: dict[str, list[Any]] = {}
        self.meta: dict[str, Any] = dict(meta or {})

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._base, name)
        if not name.startswith("nvml") or not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            key = self._key(name, args)
            try:
                result = attr(*args)
            except Exception as exc:
                self.calls.setdefault(key, []).append({"__error__": error_code(exc)})
                raise
            if name == "nvmlDeviceGetHandleByIndex":
                self._handles[_address(result)] = f"dev{args[0]}"
            if name in _OPAQUE:
                out = None
            elif name == "nvmlGpmMetricsGet":  # 477 slots, numMetrics of them filled
                out = {"__struct__": {"metrics": [
                    {"__struct__": {"metricId": m.metricId, "nvmlReturn": m.nvmlReturn,
                                    "value": m.value}}
                    for m in result.metrics[:result.numMetrics]]}}
            else:
                out = self._plain(result)
            self.calls.setdefault(key, []).append(out)
            return result

        return call

    def _key(self, name: str, args: Sequence[Any]) -> str:
        if name == "nvmlDeviceGetHandleByIndex":
            return f"{name}:{args[0]}"
        tok = next((self._handles[a] for a in map(_address, args) if a in self._handles), "")
        return f"{name}:{tok}" if tok else name

    def _plain(self, v: Any) -> Any:
        if isinstance(v, (int, float, str, bool)) or v is None:
            return v
        if isinstance(v, bytes):
            return v.decode("utf-8", "replace")
        if isinstance(v, (list, tuple)):
            return {"__tuple__": [self._plain(x) for x in v]} if isinstance(v, tuple) \
                else [self._plain(x) for x in v]
        if isinstance(v, ctypes.Array):
            return [self._plain(x) for x in v]
        if isinstance(v, (ctypes.Structure, ctypes.Union)):
            return {"__struct__": {f[0]: self._plain(getattr(v, f[0])) for f in v._fields_}}
        if isinstance(v, ctypes._Pointer):  # a device handle, or NULL
            return {"__handle__": self._handles.get(_address(v), "")}
        if isinstance(v, ctypes._SimpleCData):
            return self._plain(v.value)
        if hasattr(v, "__dict__"):  # pynvml's nvmlFriendlyObject (process lists)
            return {"__struct__": {k: self._plain(x) for k, x in vars(v).items()}}
        return str(v)

    def save(self, path: Path) -> None:
        """JSON, gzip-compressed when the name ends in .gz."""
        text = json.dumps({"meta": self.meta, "calls": self.calls}, separators=(",", ":")) + "\n"
        if str(path).endswith(".gz"):
            Path(path).write_bytes(gzip.compress(text.encode()))
        else:
            Path(path).write_text(text)


def _address(v: Any) -> int:
    try:
        return int(ctypes.cast(v, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return 0


class ReplayNvml:
    """pynvml's interface over a fixture written by RecordingNvml: each call returns the next
    recorded answer for that function and device; constants and types come from `base`."""

    def __init__(self, path: Path, base: Any) -> None:
        raw = Path(path).read_bytes()
        data = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
        self.meta: dict[str, Any] = data.get("meta", {})
        self._calls: dict[str, list[Any]] = data["calls"]
        self._pos: dict[str, int] = {}
        self._base = base
        self._tokens: dict[int, str] = {}
        self._keep: list[Any] = []

    @property
    def clock_offset_ns(self) -> int:
        return int(self.meta.get("clock_offset_ns", 0))

    def exhausted(self, name: str) -> bool:
        return all(self._pos.get(k, 0) >= len(v) for k, v in self._calls.items()
                   if k.split(":")[0] == name)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("nvml") or not callable(getattr(self._base, name, None)):
            return getattr(self._base, name)

        def call(*args: Any) -> Any:
            key = self._key(name, args)
            seq = self._calls.get(key, [])
            i = self._pos.get(key, 0)
            if i >= len(seq):
                raise self._base.NVMLError(_NO_DATA)
            self._pos[key] = i + 1
            return self._answer(name, args, seq[i])

        return call

    def _key(self, name: str, args: Sequence[Any]) -> str:
        if name == "nvmlDeviceGetHandleByIndex":
            return f"{name}:{args[0]}"
        tok = next((self._tokens[id(a)] for a in args if id(a) in self._tokens), "")
        return f"{name}:{tok}" if tok else name

    def _answer(self, name: str, args: Sequence[Any], rec: Any) -> Any:
        if isinstance(rec, dict) and "__error__" in rec:
            raise self._base.NVMLError(rec["__error__"])
        if name == "nvmlDeviceGetHandleByIndex":
            h = SimpleNamespace(token=f"dev{args[0]}")
            self._tokens[id(h)] = h.token
            self._keep.append(h)
            return h
        if name == "nvmlGpmSampleAlloc":
            return self._base.c_nvmlGpmSample_t()
        if name == "nvmlGpmSampleGet":
            return args[1]
        if name == "nvmlEventSetCreate":
            return SimpleNamespace(event_set=True)
        return _rebuild(rec, self._tokens_by_name())

    def _tokens_by_name(self) -> dict[str, Any]:
        return {tok: next(h for h in self._keep if h.token == tok) for tok in
                set(self._tokens.values())}


def _rebuild(v: Any, handles: dict[str, Any]) -> Any:
    if isinstance(v, list):
        return [_rebuild(x, handles) for x in v]
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(_rebuild(x, handles) for x in v["__tuple__"])
        if "__struct__" in v:
            return SimpleNamespace(**{k: _rebuild(x, handles) for k, x in v["__struct__"].items()})
        if "__handle__" in v:
            return handles.get(v["__handle__"])
    return v
