"""`python -m export`: write a training run's checkpoint as MODEL_DIR/VERSION, a SavedModel for TF Serving."""

from __future__ import annotations

import argparse
import logging
import sys

from common.quiet import quiet_tensorflow  # noqa: E402

quiet_tensorflow()  # before anything imports TensorFlow; --verbose keeps its C++ logs


def parse_args(argv: list[str] | None = None):  # noqa: ANN201 - an ExportConfig (imported lazily)
    """The ExportConfig of a command line; ValueError names the flag to fix."""
    from common.cli import add_dataclass_arguments, dataclass_from_args, examples
    from export.config import DEFAULT_SAMPLES, ExportConfig

    parser = argparse.ArgumentParser(prog="python -m export", description="Write a training run's checkpoint as "
                                     "MODEL_DIR/VERSION,\na SavedModel for TF Serving.", **examples(
        ("python -m export", "runs/default's best checkpoint as the next version of models/sentiment"),
        ("python -m export --checkpoint-dir runs/imdb --model-dir models/imdb", "another run, another model"),
        ("python -m export --checkpoint latest --version 7", "the latest checkpoint, as version 7")))
    add_dataclass_arguments(parser, ExportConfig, skip=("samples",))
    parser.add_argument(
        "--sample", dest="samples", action="append", metavar="TEXT",
        help="a review to check, print and use as a warm-up request (repeatable; default: three built-in ones)",
    )
    parser.add_argument("--verbose", action="store_true", help="also show TensorFlow's C++ log lines")
    args = parser.parse_args(argv)
    return dataclass_from_args(ExportConfig, args, samples=tuple(args.samples or DEFAULT_SAMPLES))


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ValueError as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from common.mesh import configure_devices
    from export.exporter import ExportError, describe_signatures, export_model

    configure_devices(1, "CPU")  # before any TensorFlow op: export restores onto one device
    try:
        result = export_model(config)
    except ExportError as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 2
    scores = [f"{what} accuracy {value:.4f}" for what, value in
              (("validation", result.validation_accuracy), ("test", result.test_accuracy)) if value is not None]
    print(f"exported version {result.version} to {result.path}")
    print(f"  from {result.checkpoint} (step {result.step}{''.join(', ' + s for s in scores)})")
    print(f"  drift baseline: {result.drift_baseline}" if result.drift_baseline else
          "  no drift baseline (the run kept no validation reviews): the server will not monitor this version")
    print()
    print(describe_signatures(result.path))
    print()
    print("sample predictions:")
    for p in result.samples:
        text = p.text if len(p.text) <= 70 else p.text[:67] + "..."
        print(f"  {p.label:<8}  p(positive)={p.probabilities[1]:.4f}  {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
