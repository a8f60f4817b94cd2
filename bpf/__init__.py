"""sits-trace bpf."""
