"""sits-trace exporters."""
