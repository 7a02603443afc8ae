"""One loaded SavedModel version: its signatures, a batchable call per signature, warm-up.

TensorFlow is imported only when a version is loaded (never by the HTTP layer).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from common.drift import BASELINE_FILE, COUNT_OUTPUTS, MONITOR_SIGNATURE, Baseline, BaselineError
from common.tf_serving import ASSETS_EXTRA, CLASSIFY_METHOD, DEFAULT_SIGNATURE, WARMUP_FILE
from serve.core.errors import InvalidArgument, NotFound
from serve.core.monitor import VersionMonitor

log = logging.getLogger(__name__)



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


class LoadError(Exception):
    """A version that cannot be loaded: a status code and a plain cause, safe to show to clients
    (the original exception, with file paths and TensorFlow details, is its __cause__)."""

    def __init__(self, code: str, cause: str) -> None:
        super().__init__(cause)
        self.code = code
        self.cause = cause


class LoadedModel:
    """One loaded SavedModel version; `runner(name)` gives the batchable call of a signature."""

    def __init__(self, name: str, version: int, path: Path, monitoring: tuple[int, float] | None = None) -> None:
        """`monitoring`: (window reviews, window seconds) to monitor the version's drift when its
        export has a baseline; None: not monitored."""
        import tensorflow as tf
        from google.protobuf import json_format
        from tensorflow.core.protobuf import saved_model_pb2

        self.name = name
        self.version = version
        self.path = path
        proto = saved_model_pb2.SavedModel()
        try:
            proto.ParseFromString((path / "saved_model.pb").read_bytes())
            sig_defs = proto.meta_graphs[0].signature_def
        except OSError as exc:
            raise LoadError("NOT_FOUND", "saved_model.pb cannot be read") from exc
        except Exception as exc:  # noqa: BLE001 - DecodeError, or a graph without meta graphs
            raise LoadError("DATA_LOSS", "saved_model.pb is not a valid SavedModel (truncated or corrupt)") from exc
        self.signature_defs = dict(sig_defs)
        """SignatureDef protos by name, for gRPC GetModelMetadata."""
        # TF Serving prints metadata with proto field names and default values (utils/json_tensor).
        self.signature_def_json = {
            name: json_format.MessageToDict(
                sig, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            for name, sig in sig_defs.items()
        }
        try:
            self._module = tf.saved_model.load(str(path))
        except Exception as exc:  # noqa: BLE001 - TensorFlow raises many kinds here
            raise LoadError("DATA_LOSS", "its variables or assets are missing, truncated or corrupt") from exc
        self._functions = dict(self._module.signatures)
        self.signatures: dict[str, Signature] = {}
        for name in self._functions:
            sig = sig_defs[name]
            self.signatures[name] = Signature(
                name=name,
                method_name=sig.method_name,
                inputs={k: _tensor_info(sig.inputs[k]) for k in sorted(sig.inputs)},
                outputs={k: _tensor_info(sig.outputs[k]) for k in sorted(sig.outputs)},
            )  # sorted: a protobuf map has no order, answers list their outputs in one
        self._runners = {name: _SignatureRunner(self._functions[name], _mergeable(self.signatures[name]),
                                                tuple(self.signatures[name].outputs))
                         for name in self._functions}
        self.monitor: VersionMonitor | None = None
        self.monitoring = "off (--no-monitoring)"
        """Whether the version is monitored, or why not, in words."""
        if monitoring is not None:
            self._start_monitoring(*monitoring)

    def _start_monitoring(self, window_reviews: int, window_seconds: float) -> None:
        """Serve serving_default through the monitor signature (the same answers, and what the
        drift statistics need) when the export has one and a baseline."""
        baseline_path = self.path / ASSETS_EXTRA / BASELINE_FILE
        if MONITOR_SIGNATURE not in self._runners:
            return self._unmonitored("its export has no monitor signature (exported by an earlier release)")
        if not baseline_path.is_file():
            return self._unmonitored("its export has no drift baseline (exported by an earlier release, or trained "
                                     "without validation reviews)")
        try:
            baseline = Baseline.load(baseline_path)
        except BaselineError as exc:
            return self._unmonitored(f"its drift baseline is unusable ({exc})", logging.WARNING)
        default = self.signatures.get(DEFAULT_SIGNATURE)
        outputs = set(self.signatures[MONITOR_SIGNATURE].outputs)
        if default is None or not {*default.outputs, *COUNT_OUTPUTS} <= outputs:
            return self._unmonitored("its monitor signature does not give serving_default's outputs", logging.WARNING)
        self.monitor = VersionMonitor(baseline, window_reviews, window_seconds)
        self._monitored = _MonitoredRunner(self._runners[MONITOR_SIGNATURE], tuple(default.outputs), self.monitor)
        self.monitoring = "on"

    def _unmonitored(self, why: str, level: int = logging.INFO) -> None:
        self.monitoring = f"off: {why}"
        log.log(level, "model %s version %d is not monitored: %s", self.name, self.version, why)

    def signature(self, name: str) -> Signature:
        try:
            return self.signatures[name]
        except KeyError:
            raise NotFound(f"Serving signature name: \"{name}\" not found in signature def") from None

    def runner(self, name: str) -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
        self.signature(name)
        if name == DEFAULT_SIGNATURE and self.monitor is not None:
            return self._monitored
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
        try:
            return self._warm_up(max_batch_size)
        except Exception as exc:  # noqa: BLE001
            raise LoadError("UNKNOWN", "its warm-up requests failed") from exc

    def _warm_up(self, max_batch_size: int) -> int:
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
            names = [DEFAULT_SIGNATURE] + ([MONITOR_SIGNATURE] if self.monitor is not None else [])
            for rows in sorted({1, max_batch_size}):
                for name in names:  # not through the monitored runner: warm-up is not traffic
                    self._runners[name]({"text": np.array([b"warm up"] * rows, dtype=object)})
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
    """Calls one concrete function with numpy inputs, returns numpy outputs. `mergeable`: whether
    the batcher may merge requests into one call (see `_mergeable`).

    The call skips what `ConcreteFunction.__call__` does before its own `_call_flat`: binding
    keyword arguments to the function's type and canonicalizing them, ~100-150 us of Python per
    call measured at batch 1 (a quarter of the whole call for the default model), for inputs the
    core has already checked against the signature (names, dtypes, shapes). The flat order is
    read from the function once and checked against its placeholders; a function whose order
    cannot be confirmed is called the ordinary way."""

    __slots__ = ("_fn", "mergeable", "_flat", "_outputs")

    def __init__(self, fn, mergeable: bool = True, outputs: tuple[str, ...] = ()) -> None:  # noqa: ANN001
        self._fn = fn
        self.mergeable = mergeable
        self._flat = _flat_inputs(fn)
        self._outputs = outputs
        """The outputs in the order answers list them (the function's own dict order is not fixed)."""

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import tensorflow as tf

        if self._flat is None:
            outputs = self._fn(**{k: tf.constant(v) for k, v in inputs.items()})
        else:
            args = [tf.constant(inputs[name], dtype=dtype) for name, dtype in self._flat]
            outputs = self._fn._call_flat(args, captured_inputs=self._fn.captured_inputs)
        if self._outputs and len(outputs) == len(self._outputs):
            return {k: outputs[k].numpy() for k in self._outputs}
        return {k: v.numpy() for k, v in outputs.items()}


class _MonitoredRunner:
    """serving_default's call made through the monitor signature: clients get serving_default's
    outputs (the same ops on the same inputs, checked bit for bit by export), the version's
    monitor gets the rest. A monitor that fails is logged once and never fails the answer."""

    __slots__ = ("_runner", "_outputs", "_monitor", "mergeable", "_failed")

    def __init__(self, runner: _SignatureRunner, outputs: tuple[str, ...], monitor: VersionMonitor) -> None:
        self._runner, self._outputs, self._monitor = runner, outputs, monitor
        self.mergeable = runner.mergeable
        self._failed = False

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self._runner(inputs)
        try:
            self._monitor.observe(outputs)
        except Exception:  # noqa: BLE001 - monitoring must never cost an answer
            if not self._failed:
                self._failed = True
                log.exception("drift monitoring failed; answers are unaffected")
        return {name: outputs[name] for name in self._outputs}


def _flat_inputs(fn) -> list[tuple[str, Any]] | None:  # noqa: ANN001 - a ConcreteFunction
    """[(input name, dtype)] in the order `_call_flat` takes them, or None when that order cannot
    be confirmed from the function's placeholders (then it is called with keywords)."""
    try:
        args, kwargs = fn.structured_input_signature
        if args or not hasattr(fn, "_call_flat"):
            return None
        order = [(name, kwargs[name].dtype) for name in sorted(kwargs)]  # nest.flatten's order of a dict
        placeholders = [t.name.split(":")[0] for t in fn.inputs[:len(order)]]
        if placeholders != [name for name, _ in order] or len(fn.inputs) != len(order) + len(fn.captured_inputs):
            return None
        return order
    except (AttributeError, TypeError, ValueError):
        return None


def _mergeable(signature: Signature) -> bool:
    """Requests may share a model call when every output has a fixed size past the batch axis. An
    output such as the explain signature's n-grams ([batch, most n-grams of a review in the call],
    padded) would otherwise change with what else was in the call: each request runs alone."""
    return all(info.shape is not None and all(d >= 0 for d in info.shape[1:]) for info in signature.outputs.values())


def _tensor_info(info) -> TensorInfo:
    from tensorflow.core.framework import types_pb2

    shape = None if info.tensor_shape.unknown_rank else tuple(d.size for d in info.tensor_shape.dim)
    return TensorInfo(types_pb2.DataType.Name(info.dtype), shape)


def _read_warmup(path: Path) -> list[bytes]:
    import tensorflow as tf

    return [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
