"""sits-trace analyzers."""

# first, as sits_trace.exporters does through its own imports: the guard that keeps a stale
# compiled module out of this process (agent/native.py) runs before any module here loads
from sits_trace.agent import native as _native  # noqa: F401
