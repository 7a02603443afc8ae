"""Drift baselines: what the held-out reviews looked like to the model, written by export beside
the SavedModel and compared by the server with the reviews it serves. numpy only (no TensorFlow).

Per review the model's `monitor` signature gives what the server cannot see itself: its length in
words, the share of its n-grams not in the vocabulary, and the predicted probability of the
positive class. The baseline keeps each statistic's distribution over bins cut at the held-out
reviews' deciles (equal shares, so every bin is well measured), the predicted class's share, the
true label prior, the share of low-confidence answers and the share of reviews unlike training
(outside the held-out reviews' 1st-99th percentile in length or above their 99th in unknown
n-grams).

Drift is scored with the population stability index, PSI = sum (o - e) ln(o / e) over the
baseline's bins, e the baseline's share of a bin and o the window's: it is the standard of
production model monitoring, so its usual reading carries over (under 0.1 the same, 0.1-0.25 a
moderate shift, above 0.25 a significant one), it grows with both missing and new mass, and over
equal-share bins its value for a window drawn like the baseline is about (bins - 1) / reviews
(0.01 for 1,000 reviews). Jensen-Shannon distance would be bounded but has no such reading.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

BASELINE_FILE = "drift_baseline.json"
"""Inside a version's assets.extra/ (TF Serving ignores that directory)."""
FORMAT = 1
MONITOR_SIGNATURE = "monitor"
"""Predict-method signature: serving_default's outputs and the per-review statistics below."""
COUNT_OUTPUTS = ("words", "ngrams", "known_ngrams")
"""The monitor signature's outputs beyond serving_default's: int64 [batch] each."""
STATISTICS = ("words", "unknown_ngram_share", "positive_probability", "predicted_class")
"""What drift is scored on, in this order."""
DESCRIPTIONS = {
    "words": "length of a review in words",
    "unknown_ngram_share": "share of a review's n-grams not in the vocabulary",
    "positive_probability": "predicted probability of the positive class",
    "predicted_class": "predicted class (negative, positive)",
}
SHORT_NAMES = {"words": "length", "unknown_ngram_share": "unknown n-grams",
               "positive_probability": "predicted probability", "predicted_class": "predicted class"}
LOW_CONFIDENCE = 0.7
"""An answer whose larger class probability is below this is a low-confidence answer."""
DRIFT_THRESHOLD = 0.25
"""PSI above which a statistic has shifted significantly (the usual reading of PSI)."""
MIN_REVIEWS = 100
"""Fewer reviews in a window than this are not judged (PSI's noise is about (bins - 1) / reviews)."""
MIN_BASELINE_REVIEWS = 50
"""A baseline needs at least this many held-out reviews (its deciles are rough below that)."""
_DECILES = np.linspace(0.1, 0.9, 9)
_SMOOTHING = 0.5
"""Added to each bin's count before taking shares: an empty bin scores large, not infinite."""


class BaselineError(ValueError):
    """A baseline file that cannot be used; the message says what is wrong with it."""


def unknown_share(ngrams: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Per review, the share of its n-grams not in the vocabulary (1 for a review without any)."""
    ngrams = np.asarray(ngrams, np.float64)
    return np.where(ngrams > 0, 1.0 - np.asarray(known, np.float64) / np.maximum(ngrams, 1.0), 1.0)


def review_statistics(counts: Mapping[str, np.ndarray], probabilities: np.ndarray) -> dict[str, np.ndarray]:
    """Each statistic of STATISTICS per review, from the monitor signature's outputs."""
    positive = np.asarray(probabilities, np.float64)[:, 1]
    return {"words": np.asarray(counts["words"], np.float64),
            "unknown_ngram_share": unknown_share(counts["ngrams"], counts["known_ngrams"]),
            "positive_probability": positive,
            "predicted_class": (np.asarray(probabilities)[:, 1] > np.asarray(probabilities)[:, 0]).astype(np.float64)}


@dataclass(frozen=True)
class Baseline:
    """Bins and shares of each statistic on the held-out reviews (see the module docstring)."""

    edges: dict[str, tuple[float, ...]]
    """Per statistic, the inner cut points: bin i holds values v with edges[i-1] < v <= edges[i]
    (Prometheus's `le`)."""
    shares: dict[str, tuple[float, ...]]
    """Per statistic, the held-out reviews' share of each bin (len(edges) + 1 bins)."""
    reviews: int
    source: str
    label_prior: float
    """Share of positive labels among the held-out reviews."""
    low_confidence_share: float
    unlike_bounds: dict[str, float]
    """words_min, words_max, unknown_max: a review outside them is unlike training."""
    unlike_share: float

    @classmethod
    def from_reviews(cls, statistics: Mapping[str, np.ndarray], labels: np.ndarray, source: str) -> "Baseline":
        """The baseline of held-out reviews: `statistics` as `review_statistics` gives them."""
        reviews = len(labels)
        if reviews < MIN_BASELINE_REVIEWS:
            raise BaselineError(f"{reviews} held-out reviews are too few for a drift baseline "
                                f"(at least {MIN_BASELINE_REVIEWS}; raise --validation-fraction)")
        edges = {name: _edges(name, statistics[name]) for name in STATISTICS}
        shares = {name: tuple(float(s) for s in np.bincount(np.searchsorted(edges[name], statistics[name],
                                                                             side="left"),
                                                             minlength=len(edges[name]) + 1) / reviews)
                  for name in STATISTICS}
        words, unknown = statistics["words"], statistics["unknown_ngram_share"]
        bounds = {"words_min": float(np.quantile(words, 0.01)), "words_max": float(np.quantile(words, 0.99)),
                  "unknown_max": float(np.quantile(unknown, 0.99))}
        return cls(edges, shares, reviews, source, float(np.mean(labels)),
                   float(np.mean(low_confidence(statistics["positive_probability"]))), bounds,
                   float(np.mean(_unlike(bounds, statistics))))

    def bins(self, statistics: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per statistic, the bin of each review."""
        return {name: np.searchsorted(self.edges[name], statistics[name], side="left") for name in STATISTICS}

    def unlike(self, statistics: Mapping[str, np.ndarray]) -> np.ndarray:
        """Per review, whether it is unlike the held-out reviews (see unlike_bounds)."""
        return _unlike(self.unlike_bounds, statistics)

    def psi(self, name: str, counts: np.ndarray) -> float:
        """Population stability index of a window's bin counts of statistic `name` (see the module)."""
        expected = np.asarray(self.shares[name]) * self.reviews + _SMOOTHING
        expected /= expected.sum()
        observed = np.asarray(counts, np.float64) + _SMOOTHING
        observed /= observed.sum()
        return float(np.sum((observed - expected) * np.log(observed / expected)))

    def to_json(self) -> dict:
        return {"format": FORMAT, "source": self.source, "reviews": self.reviews, "label_prior": self.label_prior,
                "low_confidence": {"threshold": LOW_CONFIDENCE, "share": self.low_confidence_share},
                "unlike_training": {**self.unlike_bounds, "share": self.unlike_share},
                "statistics": {name: {"description": DESCRIPTIONS[name], "edges": list(self.edges[name]),
                                      "shares": list(self.shares[name])} for name in STATISTICS}}

    @classmethod
    def from_json(cls, data: dict) -> "Baseline":
        try:
            if data["format"] != FORMAT:
                raise BaselineError(f"format {data['format']} is not {FORMAT}: written by another release")
            stats = data["statistics"]
            edges = {name: tuple(float(e) for e in stats[name]["edges"]) for name in STATISTICS}
            shares = {name: tuple(float(s) for s in stats[name]["shares"]) for name in STATISTICS}
            unlike = data["unlike_training"]
            baseline = cls(edges, shares, int(data["reviews"]), str(data["source"]), float(data["label_prior"]),
                           float(data["low_confidence"]["share"]),
                           {k: float(unlike[k]) for k in ("words_min", "words_max", "unknown_max")},
                           float(unlike["share"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, BaselineError):
                raise
            raise BaselineError(f"not a drift baseline ({type(exc).__name__}: {exc})") from None
        for name in STATISTICS:
            if len(shares[name]) != len(edges[name]) + 1 or list(edges[name]) != sorted(edges[name]):
                raise BaselineError(f"statistic {name}: {len(edges[name])} sorted edges need "
                                    f"{len(edges[name]) + 1} shares")
        if baseline.reviews < 1:
            raise BaselineError("it counts no reviews")
        return baseline

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "Baseline":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BaselineError(f"cannot be read as JSON ({type(exc).__name__})") from None
        if not isinstance(data, dict):
            raise BaselineError("not a JSON object")
        return cls.from_json(data)


def _edges(name: str, values: np.ndarray) -> tuple[float, ...]:
    """Inner cut points at the values' deciles (ties merged; the class's at 0.5)."""
    if name == "predicted_class":
        return (0.5,)
    cuts = np.unique(np.quantile(np.asarray(values, np.float64), _DECILES))
    if name == "words":
        cuts = np.unique(np.floor(cuts))  # whole word counts
    return tuple(float(c) for c in cuts if math.isfinite(c))


def _unlike(bounds: Mapping[str, float], statistics: Mapping[str, np.ndarray]) -> np.ndarray:
    words = statistics["words"]
    return ((words < bounds["words_min"]) | (words > bounds["words_max"])
            | (statistics["unknown_ngram_share"] > bounds["unknown_max"]))


def low_confidence(positive: np.ndarray) -> np.ndarray:
    """Per answer, whether its larger class probability is below LOW_CONFIDENCE."""
    return np.maximum(positive, 1.0 - positive) < LOW_CONFIDENCE
