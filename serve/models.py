"""Model registry: find versions under a model's base path, load and warm them up, switch atomically.

A version is an integer subdirectory of the base path holding a SavedModel. A poller thread
rescans the directory; a new version is loaded and warmed up (replaying
`assets.extra/tf_serving_warmup_requests`) while the current one keeps serving, then the set of
live versions is replaced in one assignment. Requests hold a reference to the `LoadedModel`
they resolved, so a version that is unloaded while they run still finishes them. TensorFlow is
imported only when the first version loads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from serve.config import ServeConfig, VersionPolicy
from serve.errors import InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)

WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")
PREDICT_METHOD = "tensorflow/serving/predict"
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
MAX_LOAD_ATTEMPTS = 5


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """One served model: its name, where its versions live, which of them to serve."""

    name: str
    base_path: str
    version_policy: VersionPolicy = "latest"
    versions: tuple[int, ...] = ()
    """Versions to serve with the `specific` policy."""
    version_labels: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_config(cls, config: ServeConfig) -> "ModelSource":
        return cls(config.model_name, config.model_dir, config.version_policy, config.versions, config.version_labels)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str
    """TF dtype enum name, e.g. DT_STRING, DT_FLOAT."""
    shape: tuple[int, ...] | None
    """Dimensions (-1 unknown), or None for unknown rank."""


@dataclasses.dataclass(frozen=True)
class Signature:
    name: str
    method_name: str
    inputs: dict[str, TensorInfo]
    outputs: dict[str, TensorInfo]


@dataclasses.dataclass
class VersionStatus:
    version: int
    state: str  # START, LOADING, AVAILABLE, UNLOADING, END (TF Serving's ModelVersionStatus.State)
    error_code: str = "OK"
    error_message: str = ""


class LoadedModel:
    """One loaded SavedModel version; `runner(name)` gives the batchable call of a signature."""

    def __init__(self, version: int, path: Path, model_delay_s: float = 0.0) -> None:
        import tensorflow as tf
        from google.protobuf import json_format
        from tensorflow.core.protobuf import saved_model_pb2

        self.version = version
        self.path = path
        self._delay = model_delay_s
        proto = saved_model_pb2.SavedModel()
        proto.ParseFromString((path / "saved_model.pb").read_bytes())
        sig_defs = proto.meta_graphs[0].signature_def
        self.signature_defs = dict(sig_defs)
        """SignatureDef protos by name, for gRPC GetModelMetadata."""
        # TF Serving prints metadata with proto field names and default values (utils/json_tensor).
        self.signature_def_json = {
            name: json_format.MessageToDict(
                sig, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            for name, sig in sig_defs.items()
        }
        self._module = tf.saved_model.load(str(path))
        self._functions = dict(self._module.signatures)
        self.signatures: dict[str, Signature] = {}
        for name in self._functions:
            sig = sig_defs[name]
            self.signatures[name] = Signature(
                name=name,
                method_name=sig.method_name,
                inputs={k: _tensor_info(v) for k, v in sig.inputs.items()},
                outputs={k: _tensor_info(v) for k, v in sig.outputs.items()},
            )
        self._runners = {name: _SignatureRunner(self._functions[name], self._delay) for name in self._functions}

    def signature(self, name: str) -> Signature:
        try:
            return self.signatures[name]
        except KeyError:
            raise NotFound(f"Serving signature name: \"{name}\" not found in signature def") from None

    def runner(self, name: str) -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
        self.signature(name)
        return self._runners[name]

    def signature_for_method(self, method: str, requested: str = "") -> Signature:
        """The signature to use for :classify/:regress: the requested one or the first of that method."""
        if requested:
            sig = self.signature(requested)
            if sig.method_name != method:
                raise InvalidArgument(
                    f"Expected {method.rsplit('/', 1)[-1]} signature method_name to be {method}. "
                    f"Was: {sig.method_name}"
                )
            return sig
        for name in ["serving_default", *sorted(self.signatures)]:
            sig = self.signatures.get(name)
            if sig is not None and sig.method_name == method:
                return sig
        raise InvalidArgument(f"model has no signature with method_name {method}")

    def warm_up(self, max_batch_size: int) -> int:
        """Replay the warmup records (as TF Serving does) or, without them, a few texts. Returns calls made."""
        calls = 0
        warmup = self.path / WARMUP_FILE
        if warmup.exists():
            for record in _read_warmup(warmup):
                name, inputs = self._warmup_inputs(record)
                if name is not None:
                    self._runners[name](inputs)
                    calls += 1
        default = self.signatures.get("serving_default")
        if default is not None and list(default.inputs) == ["text"]:
            for rows in sorted({1, max_batch_size}):
                self._runners["serving_default"]({"text": np.array([b"warm up"] * rows, dtype=object)})
                calls += 1
        return calls

    def _warmup_inputs(self, record: bytes) -> tuple[str | None, dict[str, np.ndarray]]:
        import tensorflow as tf
        from tensorflow_serving.apis import prediction_log_pb2

        entry = prediction_log_pb2.PredictionLog()
        entry.ParseFromString(record)
        kind = entry.WhichOneof("log_type")
        if kind == "predict_log":
            request = entry.predict_log.request
            name = request.model_spec.signature_name or "serving_default"
            return name, {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
        if kind == "classify_log":
            request = entry.classify_log.request
            sig = self.signature_for_method(CLASSIFY_METHOD, request.model_spec.signature_name)
            examples = [e.SerializeToString() for e in request.input.example_list.examples]
            (input_name,) = sig.inputs
            return sig.name, {input_name: np.array(examples, dtype=object)}
        log.warning("version %d: skipping warmup record of type %s", self.version, kind)
        return None, {}


class _SignatureRunner:
    """Calls one concrete function with numpy inputs, returns numpy outputs."""

    __slots__ = ("_fn", "_delay")

    def __init__(self, fn, delay: float) -> None:
        self._fn = fn
        self._delay = delay

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import tensorflow as tf

        if self._delay:
            time.sleep(self._delay)
        outputs = self._fn(**{k: tf.constant(v) for k, v in inputs.items()})
        return {k: v.numpy() for k, v in outputs.items()}


def _tensor_info(info) -> TensorInfo:
    from tensorflow.core.framework import types_pb2

    shape = None if info.tensor_shape.unknown_rank else tuple(d.size for d in info.tensor_shape.dim)
    return TensorInfo(types_pb2.DataType.Name(info.dtype), shape)


def _read_warmup(path: Path) -> list[bytes]:
    import tensorflow as tf

    return [r.numpy() for r in tf.data.TFRecordDataset(str(path))]


def _fingerprint(path: Path) -> tuple[int, float]:
    """(total bytes, newest mtime) of a version directory: changes while it is being written."""
    size, mtime = 0, 0.0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            size += st.st_size
            mtime = max(mtime, st.st_mtime)
    return size, mtime


def discover_versions(model_dir: str | os.PathLike) -> list[int]:
    """Integer subdirectories holding a saved_model.pb, ascending. Hidden/temp dirs are ignored."""
    try:
        entries = list(os.scandir(model_dir))
    except FileNotFoundError:
        return []
    versions = []
    for entry in entries:
        if entry.is_dir() and entry.name.isdigit() and os.path.exists(os.path.join(entry.path, "saved_model.pb")):
            versions.append(int(entry.name))
    return sorted(versions)


def select_versions(source: ModelSource, on_disk: list[int]) -> set[int]:
    """The versions the policy wants served, out of those on disk."""
    if not on_disk:
        return set()
    if source.version_policy == "latest":
        return {max(on_disk)}
    if source.version_policy == "all":
        return set(on_disk)
    return set(source.versions) & set(on_disk)


class ModelRegistry:
    """Live versions of one model. `refresh()` is the only writer; readers never lock."""

    def __init__(
        self,
        source: ModelSource,
        config: ServeConfig,
        on_change: Callable[["ModelRegistry"], None] | None = None,
    ) -> None:
        self.source = source
        self.name = source.name
        self.config = config
        self._on_change = on_change
        self._live: dict[int, LoadedModel] = {}
        self._status: dict[int, VersionStatus] = {}
        self._failed: dict[int, tuple[int, tuple[int, float]]] = {}  # version -> (attempts, dir fingerprint)
        self._labels = dict(source.version_labels)
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self._live)

    @property
    def live_versions(self) -> list[int]:
        return sorted(self._live)

    def get(self, version: int | None = None, label: str | None = None) -> LoadedModel:
        live = self._live
        if label is not None:
            version = self.label_version(label)
        if version is None:
            if not live:
                raise Unavailable(f"Servable not found for request: Latest({self.name}): no version loaded yet")
            return live[max(live)]
        model = live.get(version)
        if model is None:
            raise NotFound(f"Servable not found for request: Specific({self.name}, {version})")
        return model

    def status(self, version: int | None = None) -> list[VersionStatus]:
        statuses = dict(self._status)
        if version is not None:
            if version not in statuses:
                raise NotFound(f"Could not find version {version} of model {self.name}")
            return [statuses[version]]
        if not statuses:
            raise NotFound(f"Could not find any versions of model {self.name}")
        return [statuses[v] for v in sorted(statuses, reverse=True)]

    def label_version(self, label: str) -> int:
        if label not in self._labels:
            raise NotFound(f"Unrecognized servable version label: {label}")
        return self._labels[label]

    # -- loading -----------------------------------------------------------------------------

    def refresh(self) -> None:
        """One poll: load aspired versions (warm before going live), then unload the rest."""
        with self._refresh_lock:
            aspired = select_versions(self.source, discover_versions(self.source.base_path))
            for version in sorted(aspired - set(self._live), reverse=True):
                if self._stop.is_set():
                    return
                attempts, fingerprint = self._failed.get(version, (0, None))
                if attempts >= MAX_LOAD_ATTEMPTS and fingerprint == _fingerprint(self._version_dir(version)):
                    continue  # gave up on it until its files change
                self._load(version)
            if aspired & set(self._live):
                # Keep serving old versions until at least one aspired version is live.
                for version in sorted(set(self._live) - aspired):
                    self._unload(version)

    def _version_dir(self, version: int) -> Path:
        return Path(self.source.base_path) / str(version)

    def _load(self, version: int) -> None:
        path = self._version_dir(version)
        self._status[version] = VersionStatus(version, "LOADING")
        log.info("loading model %s version %d from %s", self.name, version, path)
        start = time.perf_counter()
        try:
            model = LoadedModel(version, path, self.config.model_delay_s)
            calls = model.warm_up(self.config.max_batch_size) if self.config.warmup else 0
        except Exception as exc:  # noqa: BLE001 - a bad version must not stop the server
            fingerprint = _fingerprint(path)
            attempts, old = self._failed.get(version, (0, None))
            attempts = attempts + 1 if old == fingerprint else 1
            self._failed[version] = (attempts, fingerprint)
            message = f"{type(exc).__name__}: {exc}".strip()[:2000]
            self._status[version] = VersionStatus(version, "END", "UNKNOWN", message)
            log.warning("model %s version %d failed to load (attempt %d/%d): %s",
                        self.name, version, attempts, MAX_LOAD_ATTEMPTS, message)
            return
        self._failed.pop(version, None)
        self._live = {**self._live, version: model}  # the atomic switch
        self._status[version] = VersionStatus(version, "AVAILABLE")
        log.info("model %s version %d live after %.2fs (%d warmup calls)",
                 self.name, version, time.perf_counter() - start, calls)
        if self._on_change:
            self._on_change(self)

    def _unload(self, version: int) -> None:
        self._status[version] = VersionStatus(version, "UNLOADING")
        live = dict(self._live)
        live.pop(version, None)
        self._live = live
        self._status[version] = VersionStatus(version, "END")
        log.info("model %s version %d unloaded", self.name, version)
        if self._on_change:
            self._on_change(self)

    def start(self) -> None:
        """Load in the background now, then poll every `poll_interval_s` (if > 0)."""
        self._thread = threading.Thread(target=self._poll, name=f"poller-{self.name}", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
                if not self._live and not self._status:
                    log.warning("no servable versions of model %s under %s yet", self.name, self.source.base_path)
            except Exception:  # noqa: BLE001 - keep polling
                log.exception("model poll failed")
            if self.config.poll_interval_s <= 0 and self._live:
                return
            self._stop.wait(self.config.poll_interval_s or 1.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
