"""Our model: multinomial logistic regression over `rank.FEATURES`, trained with scikit-learn
on labelled fault runs (bench/rca_eval.py train) and shipped as a small JSON file of
coefficients, so the agent scores a breach with numpy alone and no pickled objects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import causes as C

SHIPPED = Path(__file__).with_name("model_v1.json")


@dataclass(frozen=True, slots=True)
class LinearModel:
    version: str
    features: tuple[str, ...]
    classes: tuple[str, ...]
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray  # classes x features
    intercept: np.ndarray
    trained_with: str = ""

    def proba(self, f: Mapping[str, float]) -> dict[str, float]:
        x = np.array([f.get(k, 0.0) for k in self.features], dtype=float)
        z = self.coef @ ((x - self.mean) / self.scale) + self.intercept
        p = np.exp(z - z.max())
        p /= p.sum()
        return dict(zip(self.classes, p.tolist()))

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "trained_with": self.trained_with,
                "features": list(self.features), "classes": list(self.classes),
                "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "coef": self.coef.tolist(), "intercept": self.intercept.tolist()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LinearModel:
        return cls(str(d["version"]), tuple(d["features"]), tuple(d["classes"]),
                   np.array(d["mean"], float), np.array(d["scale"], float),
                   np.array(d["coef"], float).reshape(len(d["classes"]), len(d["features"])),
                   np.array(d["intercept"], float), str(d.get("trained_with", "")))


def load(path: Path | None = None) -> LinearModel | None:
    """The model at `path` (default: the shipped one); None when there is none."""
    p = path or SHIPPED
    try:
        return LinearModel.from_json(json.loads(p.read_text()))
    except FileNotFoundError:
        if path is None:
            return None
        raise


def combine(model: LinearModel | None, heuristic: Mapping[str, float]) -> dict[str, float]:
    """The model's probabilities for the causes it was trained on; the rules' shares for the
    others (GPU causes until GPU runs are labelled)."""
    return dict(heuristic) if model is None else _merge(model, heuristic)


def _merge(model: LinearModel, heuristic: Mapping[str, float]) -> dict[str, float]:
    return {c: s for c, s in heuristic.items() if c not in model.classes}


def scores(model: LinearModel | None, f: Mapping[str, float],
           heuristic: Mapping[str, float]) -> dict[str, float]:
    """The model's probabilities are conditional on the cause being one it was trained on:
    the rules' shares of the measured causes it was not trained on (host memory, the GPU's)
    come off the top, and the model splits what is left. Without that a model that never saw
    a memory fault puts 1.0 on whatever it knows (a memory stall fills the server's slots:
    `server_queueing`) against the rules' 0.8 for memory. `unknown` (the unexplained rest)
    is not taken off: it is no measured cause."""
    out = combine(model, heuristic)
    if model is not None:
        known = max(0.0, 1.0 - sum(v for c, v in out.items() if c != C.UNKNOWN))
        out.update({c: known * v for c, v in model.proba(f).items()})
    return out


def train(x: np.ndarray, y: Sequence[str], features: Sequence[str], version: str,
          command: str, c: float = 1.0) -> LinearModel:
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415 - scikit-learn only to train
    from sklearn.preprocessing import StandardScaler  # noqa: PLC0415 - scikit-learn only to train

    sc = StandardScaler().fit(x)
    lr = LogisticRegression(C=c, max_iter=2000).fit(sc.transform(x), list(y))
    classes = tuple(str(k) for k in lr.classes_)
    coef, icpt = lr.coef_, lr.intercept_
    if len(classes) == 2:  # binary: sklearn keeps one row; softmax needs both
        coef = np.vstack([-coef[0] / 2, coef[0] / 2])
        icpt = np.array([-icpt[0] / 2, icpt[0] / 2])
    scale = np.where(sc.scale_ > 0, sc.scale_, 1.0)
    return LinearModel(version, tuple(features), classes, sc.mean_.copy(), scale, coef, icpt,
                       command)
