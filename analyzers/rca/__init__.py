"""Root-cause analysis: SLO breaches and degradation on the span stream, decomposed into the
causes of `causes.CAUSES`, with culprits and evidence (docs/rca.md)."""

from .causes import CAUSES, VOCABULARY
from .engine import RcaEngine, RcaSettings
from .slo import Breach, DegradationRule, Objective, Slo, parse_slos
from .verdict import CauseScore, Evidence, Verdict

__all__ = ["CAUSES", "VOCABULARY", "Breach", "CauseScore", "DegradationRule", "Evidence",
           "Objective", "RcaEngine", "RcaSettings", "Slo", "Verdict", "parse_slos"]
