"""Several models from TF Serving's own model config file (`--model-config-file`).

The file is a `tensorflow.serving.ModelServerConfig` text proto, parsed with the proto classes
`tensorflow-serving-api` ships (which do not import TensorFlow), so an existing TF Serving config
works unchanged:

    model_config_list {
      config {
        name: "sentiment"
        base_path: "/models/sentiment"
        model_platform: "tensorflow"
        model_version_policy { latest { num_versions: 2 } }     # or all {}, or specific { versions: 1 }
        version_labels { key: "stable" value: 1 }
      }
    }

Fields this server has no use for (logging_config, ...) are accepted and ignored.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

from serve.config import ServeConfig
from serve.core.model_versions import ModelSource


class ModelConfigError(ValueError):
    """An unusable model config file; the message names the file, the line and the field."""


def read_model_config(path: str | Path) -> list[ModelSource]:
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"--model-config-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        message = str(exc).split(" : ", 1)[-1]
        raise ModelConfigError(f"{path} line {exc.GetLine()}, column {exc.GetColumn()}: {message}") from None
    return sources_from_config(config, str(path))


def sources_from_config(config, origin: str) -> list[ModelSource]:  # noqa: ANN001 - a ModelServerConfig
    """The models of a ModelServerConfig (from the file, or gRPC's HandleReloadConfigRequest);
    ModelConfigError naming `origin` and the entry when one is unusable."""
    if config.WhichOneof("config") == "custom_model_config":
        raise ModelConfigError(f"{origin}: custom_model_config is not supported; use model_config_list")
    sources: list[ModelSource] = []
    for i, entry in enumerate(config.model_config_list.config):
        where = f"{origin}: model_config_list.config[{i}]"
        if not entry.name:
            raise ModelConfigError(f"{where}: 'name' is required")
        if not entry.base_path:
            raise ModelConfigError(f"{where} ({entry.name}): 'base_path' is required")
        if entry.model_platform not in ("", "tensorflow"):
            raise ModelConfigError(f"{where} ({entry.name}): model_platform {entry.model_platform!r} is not supported "
                                   "(only tensorflow SavedModels)")
        if any(s.name == entry.name for s in sources):
            raise ModelConfigError(f"{where}: model name {entry.name!r} appears twice")
        sources.append(_source(entry, where))
    if not sources:
        raise ModelConfigError(f"{origin}: model_config_list has no config entries")
    return sources


def _source(entry, where: str) -> ModelSource:
    policy = entry.model_version_policy
    kind = policy.WhichOneof("policy_choice") or "latest"
    num_latest, versions = 1, ()
    if kind == "latest":
        num_latest = policy.latest.num_versions or 1
    elif kind == "specific":
        versions = tuple(policy.specific.versions)
        if not versions:
            raise ModelConfigError(f"{where} ({entry.name}): specific {{ versions }} lists no version")
    labels = tuple(sorted((label, int(version)) for label, version in entry.version_labels.items()))
    return ModelSource(entry.name, entry.base_path, kind, versions, labels, num_latest)


def model_roots(config: ServeConfig, sources: Sequence[ModelSource]) -> tuple[str, ...]:
    """The directories reloads may take models from, resolved (symlinks followed): --model-root,
    else the directories holding the models configured at start (`/models` for `/models/sentiment`:
    a model may be added beside them, nothing elsewhere). ModelConfigError for a root that is not
    a directory."""
    if config.model_roots:
        for root in config.model_roots:
            if not os.path.isdir(root):
                raise ModelConfigError(f"--model-root {root}: not a directory")
        roots = config.model_roots
    else:
        roots = [os.path.dirname(os.path.abspath(source.base_path)) for source in sources]
    return tuple(dict.fromkeys(os.path.realpath(root) for root in roots))


def check_roots(sources: Sequence[ModelSource], roots: Sequence[str], origin: str) -> None:
    """ModelConfigError naming the roots (not the path asked for) if a base path lies outside them;
    checked before anything under a base path is listed, read or logged."""
    for i, source in enumerate(sources):
        path = os.path.realpath(source.base_path)
        if not any(os.path.commonpath([path, root]) == root for root in roots):
            raise ModelConfigError(f"{origin}: model_config_list.config[{i}] ({source.name}): base_path is outside "
                                   f"{', '.join(roots)}, where this server takes models from (--model-root)")


def config_sources(config: ServeConfig) -> list[ModelSource]:
    """The models a server runs: from --model-config-file, else the one --model-dir."""
    if config.model_config_file:
        return read_model_config(config.model_config_file)
    return [ModelSource.from_config(config)]


def file_fingerprint(path: str | Path) -> str | None:
    """A digest of the file's bytes (None if unreadable): what a poll compares to see a change."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
