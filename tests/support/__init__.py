"""Test-only helpers: OTLP receivers and sample spans, NVML record/replay."""
