"""What the model is, without TensorFlow: its size and BatchNorm settings (saved as model.json)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from common.classes import CLASS_NAMES
from common.run_dir import atomic_write_json

NUM_CLASSES = len(CLASS_NAMES)


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild the model; saved beside the checkpoint as model.json."""

    max_tokens: int = 1200
    """Input width: the TF-IDF vocabulary's n-grams (rounded up to a multiple of 8)."""
    hidden: int = 64
    """Units of the hidden Dense layer."""
    bn_momentum: float = 0.9
    """Moving-statistics momentum of BatchNorm (Keras uses 0.99; small corpora want faster)."""
    bn_epsilon: float = 1e-3
    """Added to the variance before the square root."""

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {self.max_tokens}")
        if self.hidden < 1:
            raise ValueError(f"hidden must be at least 1, got {self.hidden}")
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ValueError(f"bn_momentum must be in [0, 1), got {self.bn_momentum}")

    def save(self, path: Path) -> None:
        atomic_write_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        values = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "dense1_kernel": (self.max_tokens, self.hidden),
            "dense1_bias": (self.hidden,),
            "bn_gamma": (self.hidden,),
            "bn_beta": (self.hidden,),
            "bn_moving_mean": (self.hidden,),
            "bn_moving_variance": (self.hidden,),
            "dense2_kernel": (self.hidden, NUM_CLASSES),
            "dense2_bias": (NUM_CLASSES,),
        }


@dataclass(frozen=True)
class VectorizerSettings:
    """How text becomes features (saved in vocabulary.json with the vocabulary)."""

    ngrams: int = 2
    """Longest n-gram: 1 unigrams only, 2 unigrams and bigrams, ..."""
    sublinear_tf: bool = True
    """Use 1 + ln(count) instead of the raw count (a word said ten times is not ten times the evidence)."""
    normalize: bool = True
    """Scale every row to unit L2 norm (long and short reviews weigh the same)."""
    min_df: int = 2
    """Keep n-grams that occur in at least this many training texts."""
    nb_weighting: bool = False
    """Also weigh each n-gram by |its naive-Bayes log-count ratio| between the classes (NBSVM's
    trick, Wang & Manning 2012): n-grams that separate the classes count for more from the start.
    False in vocabulary.json files written before it existed."""

    def __post_init__(self) -> None:
        if not 1 <= self.ngrams <= 5:
            raise ValueError(f"--ngrams must be in 1..5, got {self.ngrams}")
        if self.min_df < 1:
            raise ValueError(f"--min-df must be at least 1, got {self.min_df}")
