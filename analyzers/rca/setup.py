"""Building the engine from the configuration (shared by `rca`, `rca --from` and `run`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine import RcaEngine, RcaSettings
from .model import LinearModel, load
from .slo import DegradationRule, parse_slos

if TYPE_CHECKING:
    import pandas as pd


class SetupError(ValueError):
    """A model file that cannot be read; the message says which and why."""


def model_from(setting: str) -> LinearModel | None:
    if setting == "none":
        return None
    try:
        return load(Path(setting) if setting else None)
    except (OSError, ValueError, KeyError) as exc:
        raise SetupError(f"rca.model: cannot read {setting}: {exc}") from None


def build_engine(rca: Any, slos: Sequence[Mapping[str, Any]], *, window_s: float | None = None,
                 service_name: str = "",
                 frame: Callable[[], pd.DataFrame | None] | None = None,
                 clock_ns: Callable[[], int] | None = None,
                 exclude_pids: set[int] | None = None, live: bool = False) -> RcaEngine:
    """`rca` is the config's RcaConfig (read by attribute). `live`: the node is the one the
    spans come from (a dependency's processes can be looked up), not a replayed recording."""
    settings = RcaSettings(
        window_s=window_s or rca.window_s, baseline_windows=rca.baseline_windows,
        min_spans=rca.min_spans, service_name=service_name,
        rule=DegradationRule(ratio=rca.degradation_ratio, min_increase_ms=rca.min_increase_ms))
    kw: dict[str, Any] = {"clock_ns": clock_ns} if clock_ns is not None else {}
    if live:
        from .listeners import local_pids  # noqa: PLC0415

        kw["peer_pids"] = local_pids
    return RcaEngine(settings, parse_slos(slos), model=model_from(rca.model), frame=frame,
                     exclude_pids=exclude_pids, **kw)
