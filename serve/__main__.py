"""`python -m serve --model-dir models/NAME [--port 8501] [--grpc-port 8500] [--workers N] ...`

Only parses arguments (from `ServeConfig`) and calls `serve.server.serve`; `--help` never
imports TensorFlow, which only model loading does.
"""

from __future__ import annotations

import argparse
import sys

from common.quiet import quiet_tensorflow  # noqa: E402

quiet_tensorflow()  # before anything imports TensorFlow; --verbose keeps its C++ logs


def parse_args(argv: list[str] | None = None):
    from common.cli import add_dataclass_arguments, dataclass_from_args, examples
    from serve.config import ServeConfig

    parser = argparse.ArgumentParser(
        prog="python -m serve",
        description="Serve a sentiment SavedModel over TF Serving's REST and gRPC APIs and KServe V2.",
        **examples(
            ("python -m serve", "models/sentiment on :8501, REST only"),
            ("python -m serve --model-dir models/imdb --grpc-port 8500", "another model, gRPC too"),
            ("python -m serve --model-config-file models.config --workers 1", "several models, one process"),
            ("python -m serve --tls-cert tls.crt --tls-key tls.key --auth-token-file tokens",
             "TLS on both ports, bearer tokens")),
    )
    add_dataclass_arguments(parser, ServeConfig)
    parser.add_argument("--verbose", action="store_true", help="also show TensorFlow's C++ log lines")
    args = parser.parse_args(argv)
    del args.verbose  # read by quiet_tensorflow() from the command line
    try:
        return dataclass_from_args(ServeConfig, args)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    from serve.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
