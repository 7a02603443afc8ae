"""`python -m train`: the CLI onto TrainConfig."""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads


def main(argv: list[str] | None = None) -> int:
    from common.cli import add_dataclass_arguments, dataclass_from_args
    from train.config import TrainConfig

    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    add_dataclass_arguments(parser, TrainConfig)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = dataclass_from_args(TrainConfig, args)
    except ValueError as exc:
        parser.error(str(exc))

    from train.data import DataError
    from train.trainer import TrainingError, TrainingInterrupted, train

    try:
        result = train(config)
    except TrainingInterrupted as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (DataError, TrainingError, ValueError) as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"done: step {result.step}, epoch {result.epoch}, test accuracy {result.test_accuracy:.4f}, "
        f"test loss {result.test_loss:.4f}; checkpoints in {result.run_dir}/checkpoints"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
