"""sits-trace agent."""

from sits_trace.agent import native

native.guard()  # before any module of the compiled hot path is imported
