"""sits_trace.client: what an inference server calls to follow the agent's decisions.

Standard library only (torch is used when present). Nothing here raises into the server:
without an agent every call returns the caller's default.
"""

from ._control import DEFAULT_SOCKET, ControlClient, Decisions, ProtocolError, parse_decisions
from ._pacer import CopyPacer, PaceStats
from ._stream import stream_priority

__all__ = [
    "DEFAULT_SOCKET",
    "ControlClient",
    "CopyPacer",
    "Decisions",
    "PaceStats",
    "ProtocolError",
    "parse_decisions",
    "stream_priority",
]
