"""Export a training checkpoint as a versioned SavedModel that TensorFlow Serving can load.

The exporter (which imports TensorFlow) loads on first use, so `python -m export --help` is quick
and quiet.
"""

from export.config import DEFAULT_SAMPLES, ExportConfig

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


def __getattr__(name: str):
    if name in __all__:
        from export import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module 'export' has no attribute {name!r}")
