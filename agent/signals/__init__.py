"""Signals: node and GPU signals beside each span, one module per bpf program or GPU source."""
