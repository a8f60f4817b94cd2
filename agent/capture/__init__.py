"""Capture: BPF programs loaded and attached, the ring read, records decoded (bpf -> bytes)."""
