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
    if _cuda_torch(torch_module) is None:
        return None
    decisions = (client if client is not None else ControlClient()).decisions()
    if decisions is None or decisions.stream_priority is None:
        return 0
    return decisions.stream_priority
