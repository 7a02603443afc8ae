"""What the client returns: typed predictions and model version statuses (no dependencies)."""

from __future__ import annotations

import dataclasses
from typing import Optional

CLASS_NAMES = ("negative", "positive")
"""The sentiment model's classes, in the order of its probabilities."""
EXPLAIN_SIGNATURE = "explain"
"""The exported model's signature that explains its answers (common.tf_serving.EXPLAIN_SIGNATURE)."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    text: str
    label: str
    """The predicted class: the model's `label` output, else the class of the highest probability."""
    score: float
    """Probability of `label`."""
    probabilities: dict[str, float]
    """Probability of every class, by class name."""


@dataclasses.dataclass(frozen=True)
class Explanation(Prediction):
    """A prediction with the reason for it: the model's explain signature, exact for this model."""

    contributions: list[tuple[str, float]]
    """Every n-gram of the text that the model knows, with how much it added to the log-odds of
    `label` (ln(score / (1 - score))), most supporting first; negative ones argued against it."""
    bias: float
    """The part of that log-odds no n-gram accounts for: sum(contributions) + bias = log-odds."""

    def top(self, k: int = 5) -> list[tuple[str, float]]:
        """The `k` n-grams that moved the answer most, either way, strongest first."""
        return sorted(self.contributions, key=lambda item: -abs(item[1]))[:k]


@dataclasses.dataclass(frozen=True)
class ModelVersionStatus:
    """One entry of TF Serving's model status (`GET /v1/models/NAME`, `GetModelStatus`)."""

    version: int
    state: str
    """START, LOADING, AVAILABLE, UNLOADING or END."""
    error_code: str = "OK"
    error_message: str = ""

    @property
    def available(self) -> bool:
        return self.state == "AVAILABLE"


RawPrediction = tuple[Optional[str], list[float]]
"""What a transport returns per text: (the `label` output if the model has one, probabilities)."""
RawExplanation = tuple[str, list[float], list[tuple[str, float]], float]
"""What a transport returns per text for an explanation: (label, probabilities, contributions, bias)."""
