"""What the client returns: typed predictions and model version statuses (no dependencies)."""

from __future__ import annotations

import dataclasses
from typing import Optional

CLASS_NAMES = ("negative", "positive")
"""The sentiment model's classes, in the order of its probabilities."""


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
