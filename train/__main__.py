"""`python -m train`: the CLI onto TrainConfig."""

from __future__ import annotations

import argparse
import logging
import sys

from common.quiet import quiet_tensorflow  # noqa: E402

quiet_tensorflow()  # before anything imports TensorFlow; --verbose keeps its C++ logs


def _parser() -> argparse.ArgumentParser:
    from common.cli import add_dataclass_arguments, examples
    from train.config import TrainConfig

    parser = argparse.ArgumentParser(
        prog="python -m train", description="Train the sentiment model as DTensor programs on a mesh of devices;\n"
        "checkpoints, vocabulary and metrics go to --run-dir.", **examples(
            ("python -m train", "the bundled corpus into runs/default"),
            ("python -m train --data aclImdb_v1.tar.gz --run-dir runs/imdb", "IMDB, read from its tarball"),
            ("python -m train --strategy data --devices 4", "data parallel on 4 virtual CPU devices"),
            ("python -m train --mesh batch=2,model=2 --run-dir runs/imdb", "continue that run on another mesh"),
            ("python -m train --launch-local 2", "two clients of one mesh on this machine")))
    add_dataclass_arguments(parser, TrainConfig)
    parser.add_argument(
        "--launch-local",
        type=int,
        metavar="N",
        default=None,
        help="run N clients of one mesh on this machine (127.0.0.1, free ports), forward their output "
        "and stop them all if one fails; --devices stays the global device count",
    )
    parser.add_argument("--verbose", action="store_true", help="also show TensorFlow's C++ log lines")
    # Unset cluster flags fall back to DTENSOR_JOBS / DTENSOR_CLIENT_ID (flags win).
    parser.set_defaults(num_clients=None, client_id=None, jobs=None)
    return parser


def _launch_local(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> int:
    """--launch-local N: check the flags once here (not N times in the clients), then start them."""
    from common.cli import dataclass_from_args
    from common.mesh_spec import check_client_mesh
    from train.config import TrainConfig
    from train.launch import launch_local

    if args.launch_local < 1:
        parser.error(f"--launch-local must be at least 1, got {args.launch_local}")
    if args.num_clients is not None or args.client_id is not None or args.jobs is not None:
        parser.error("--launch-local sets --num-clients/--client-id/--jobs itself; leave them out")
    try:
        config = dataclass_from_args(TrainConfig, args, num_clients=args.launch_local, client_id=0, jobs=None)
        check_client_mesh(config.mesh_dims(), config.device_count(), config.num_clients)
    except ValueError as exc:
        parser.error(str(exc))
    return launch_local(args.launch_local, sys.argv[1:] if argv is None else argv)


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace):  # noqa: ANN202 - a TrainConfig
    """The config of this client: flags, with the cluster from DTENSOR_* where flags leave it out."""
    from common.cli import dataclass_from_args
    from train.config import TrainConfig
    from train.launch import ClusterError, resolve_cluster

    try:
        cluster = resolve_cluster(args.num_clients, args.client_id, args.jobs)
        return dataclass_from_args(TrainConfig, args, num_clients=cluster.num_clients, client_id=cluster.client_id,
                                   jobs=",".join(cluster.jobs) or None)
    except (ClusterError, ValueError) as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # DTensor's start-up chatter
    if args.launch_local is not None:
        return _launch_local(parser, args, argv)
    config = _config(parser, args)

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
    validation = "" if result.validation_accuracy is None else f", validation accuracy {result.validation_accuracy:.4f}"
    print(
        f"done: step {result.step}, epoch {result.epoch}; best checkpoint {result.best_checkpoint}{validation}, "
        f"test accuracy {result.test_accuracy:.4f}, test loss {result.test_loss:.4f}; in {result.run_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
