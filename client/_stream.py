"""Which CUDA stream priority the latency-critical compute stream should get."""

from __future__ import annotations

import importlib
from types import ModuleType

from ._control import ControlClient


def _cuda_torch(torch_module: ModuleType | None) -> ModuleType | None:
    if torch_module is None:
        try:
            torch_module = importlib.import_module("torch")
        except ImportError:
            return None
    try:
        return torch_module if bool(torch_module.cuda.is_available()) else None
    except (AttributeError, RuntimeError):
        return None


def stream_priority(torch_module: ModuleType | None = None,
                    client: ControlClient | None = None) -> int | None:
    """The priority for `torch.cuda.Stream(priority=...)`: None without torch or CUDA,
    0 (the default priority) when the agent has no decision, else the agent's value."""
    torch_module = _cuda_torch(torch_module)
    if torch_module is None:
        return None
    decisions = (client if client is not None else ControlClient()).decisions()
    if decisions is None or decisions.stream_priority is None:
        return 0
    return _clamp(torch_module, decisions.stream_priority)


def _clamp(torch_module: ModuleType | None, priority: int) -> int:
    """Into the device's range where torch tells it: (least, greatest), e.g. (0, -3) on an H200;
    lower numbers are higher priorities."""
    ranger = getattr(getattr(getattr(torch_module, "cuda", None), "Stream", None),
                     "priority_range", None)
    if ranger is None:
        return priority
    least, greatest = ranger()
    return max(int(greatest), min(int(least), priority))
