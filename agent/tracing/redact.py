"""Secrets never leave the node: query-string values and URL userinfo redacted in spans.

Every output (trace --json, JSONL, OTLP, Prometheus labels) is built from the span's
attributes, so redacting here, once, covers them all. Header values that carry
credentials are redacted earlier, by the parser (agent/tracing/http1.py). Following the
OTel HTTP semantic conventions, a redacted query value becomes `REDACTED` and the key is
kept, so a reader still sees which parameters a request had.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import unquote_plus

from sits_trace.agent.config import DEFAULT_QUERY_KEYS

REDACTED_VALUE = "REDACTED"



class QueryRedactor:
    """Replaces the values of the configured query keys; the rest of the query is kept
    byte for byte (no re-encoding)."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Iterable[str] = DEFAULT_QUERY_KEYS) -> None:
        self._keys = frozenset(k.strip().lower() for k in keys if k.strip())

    def query(self, query: str) -> str:
        if not self._keys:
            return query
        parts = query.split("&")
        changed = False
        for i, part in enumerate(parts):
            name, sep, value = part.partition("=")
            if sep and value and _unquote_key(name) in self._keys:
                parts[i] = f"{name}={REDACTED_VALUE}"
                changed = True
        return "&".join(parts) if changed else query


def _unquote_key(name: str) -> str:
    """The key as a server would read it: `%5F` is `_`, `+` is a space, any case."""
    if "%" in name or "+" in name:
        name = unquote_plus(name)
    return name.strip().lower()


def strip_userinfo(authority: str) -> str:
    """`host:port` of an authority that may carry `user:password@` (RFC 3986 userinfo,
    never exported: a Host header or absolute-form target can carry one)."""
    at = authority.rfind("@")
    return authority[at + 1:] if at >= 0 else authority
