"""sits-trace analyzers."""
