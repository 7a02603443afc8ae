"""Export a training checkpoint as a versioned SavedModel that TensorFlow Serving can load."""

from export.config import DEFAULT_SAMPLES, ExportConfig
from export.exporter import ExportError, ExportResult, Prediction, describe_signatures, export_model, next_version

__all__ = [
    "DEFAULT_SAMPLES",
    "ExportConfig",
    "ExportError",
    "ExportResult",
    "Prediction",
    "describe_signatures",
    "export_model",
    "next_version",
]
