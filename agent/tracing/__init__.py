"""Tracing: connection tracking, HTTP/1.1 parsing, span assembly (bytes -> spans)."""
