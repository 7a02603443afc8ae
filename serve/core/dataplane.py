"""The serving core shared by every protocol edge: models, validation, the batcher, metrics.

Nothing here knows HTTP or gRPC. An edge decodes its request into plain values (numpy arrays,
tf.Example protos, model names), then calls the core, which validates everything once, queues the
model call and raises neutral `serve.core.errors.ServingError`s that each edge maps to its own status.
Runs on one asyncio event loop; model versions load in background threads.

    core = ServingCore(config)
    await core.start()                                   # on the serving loop
    model = core.model("sentiment")                      # NotFound / Unavailable
    outputs = await core.predict(model, "serving_default", {"text": texts})
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np

from common.classes import CLASS_NAMES
from common.tf_serving import CLASSIFY_METHOD, EXPLAIN_SIGNATURE
from serve.config import ServeConfig
from serve.core.auth import authorizer_for
from serve.core.batcher import Batcher
from serve.core.dtypes import NUMPY_DTYPES, bytes_array, dtype_name, short_dtype
from serve.core.errors import InvalidArgument, NotFound, Overloaded, PermissionDenied, ServingError, Unavailable
from serve.core.loaded_model import LoadedModel, Signature, TensorInfo
from serve.core.metrics import Metrics, merge_worker_metrics
from serve.core.model_config_file import ModelConfigError, check_roots, model_roots
from serve.core.model_versions import ModelSource, ModelVersions, VersionStatus
from serve.core.monitor import DriftCollector, VersionMonitor, describe
from serve.core.peers import Peers

log = logging.getLogger(__name__)

TEXT_INPUT = "text"
"""A string input with this name holds review text: it must be non-empty, valid UTF-8."""
CLASSIFY_FEATURES = (TEXT_INPUT,)
"""The tf.train.Example features a classify signature reads; edges convert no others."""
EXPLAIN_NGRAMS = "ngrams"
EXPLAIN_CONTRIBUTIONS = "contributions"
"""Outputs of the explain signature padded to the longest review of a call ("" and 0)."""
MAX_DIMS = 32
VALUES_PER_ROW = 1024
"""Most values one row of a numeric input may hold (the declared shape is checked before decoding)."""

RowLabel = Callable[[str, int], str]
"""(input name, row) -> how the request spells that place, e.g. `instances[3]`."""


def _default_label(name: str, row: int) -> str:
    return f"inputs[{name!r}][{row}]"


@dataclasses.dataclass(frozen=True)
class Readiness:
    ready: bool
    draining: bool
    waiting: list[str]
    """Models still loading that the server waits for."""
    unavailable: list[str]
    """Models with no live version that the server does not wait for."""
    live_versions: dict[str, list[int]]


@dataclasses.dataclass(frozen=True)
class Sentiment:
    label: str
    score: float
    """Probability of `label`."""
    probabilities: dict[str, float]


class ServingCore:
    """Create once per worker process; every edge of that process shares it."""

    def __init__(self, config: ServeConfig, sources: Sequence[ModelSource] | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        sources = list(sources) if sources is not None else [ModelSource.from_config(config)]
        self.models: dict[str, ModelVersions] = {}
        self.batchers: dict[str, Batcher] = {}
        """One batcher per model: its own bounded queue share and model thread(s)."""
        for source in sources:
            self._add(source)
        self.default_model = sources[0].name
        self._initial = frozenset(self.models)
        """Models the server started with: only these hold readiness back while they load."""
        self.metrics.queued_rows.set_function(lambda: sum(b.queued_rows for b in self.batchers.values()))
        self._draining = False
        self._started = False
        self.peers: Peers | None = None
        """Set by one of several workers: a scrape then returns every worker's metrics, and a
        reload reaches every worker."""
        self.roots = config.model_roots if config.model_roots else model_roots(config, sources)
        """Where reloaded models may come from (resolved)."""
        self.auth = authorizer_for(config)
        """Who may call what (--auth-token-file); every edge of this worker asks it."""
        self.metrics.registry.register(DriftCollector(self._monitors))

    def _add(self, source: ModelSource) -> None:
        self.models[source.name] = ModelVersions(source, self.config, on_change=self._on_model_change)
        self.batchers[source.name] = Batcher(
            max_batch_size=self.config.max_batch_size,
            batch_timeout_s=self.config.batch_timeout_s,
            max_queued_rows=self.config.max_queued_rows,
            num_threads=self.config.num_batch_threads,
            overloaded=Overloaded if self.config.overload_status == 429 else Unavailable,
            on_batch=lambda rows, requests, seconds, name=source.name: self.metrics.observe_batch(
                name, rows, requests, seconds),
            alone=lambda: self.metrics.in_flight <= 1,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> "ServingCore":
        """Start the batchers on the running loop, and loading and polling model versions in
        background threads."""
        self._started = True
        for name in self.models:
            self._start_model(name)
        return self

    def _start_model(self, name: str) -> None:
        self.batchers[name].start()
        self.models[name].start()

    async def apply_sources(self, sources: Sequence[ModelSource]) -> None:
        """A new set of models (a re-read model config file): start new ones, stop removed ones,
        update changed policies and labels in place. A model whose base path changed starts over."""
        wanted = {s.name: s for s in sources}
        for name in [n for n in self.models if n not in wanted or wanted[n].base_path != self.models[n].source.base_path]:
            registry, batcher = self.models.pop(name), self.batchers.pop(name)
            log.info("model %s %s", name, "removed from the config" if name not in wanted else "has a new base path")
            await asyncio.to_thread(registry.stop)
            await batcher.close(timeout=self.config.drain_timeout_s)
            self.metrics.live_versions.labels(name).set(0)
        for name, source in wanted.items():
            if name in self.models:
                self.models[name].update(source)
            else:
                log.info("model %s added from %s", name, source.base_path)
                self._add(source)
                if self._started:
                    self._start_model(name)
        if self.default_model not in self.models and sources:
            self.default_model = sources[0].name

    def check_model_management(self) -> None:
        """PermissionDenied unless the operator enabled model management (before a request's config
        is even read: a client that may not reload learns nothing from its errors)."""
        if not self.config.model_management:
            raise PermissionDenied("model management is off on this server (start it with --model-management "
                                   "to allow HandleReloadConfigRequest)")

    def check_sources(self, sources: Sequence[ModelSource], origin: str) -> None:
        """ModelConfigError if a base path lies outside the server's model roots."""
        check_roots(sources, self.roots, origin)

    async def reload_models(self, sources: Sequence[ModelSource], origin: str) -> None:
        """A client's new set of models, applied by every worker before this returns (see
        `Peers.apply_everywhere`); InvalidArgument for a base path outside the model roots."""
        self.check_model_management()
        try:
            self.check_sources(sources, origin)
        except ModelConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        if self.peers is not None:
            await self.peers.apply_everywhere(list(sources))
        else:
            await self.apply_sources(sources)

    @property
    def ready(self) -> bool:
        return self.readiness().ready

    def readiness(self) -> "Readiness":
        """Ready when not draining, some model has a live version, and no model the server
        started with is still loading. A model that cannot load (its base path missing, only
        broken versions) or one added later by a config change does not hold readiness back:
        it reports its own status instead."""
        models = self.models
        waiting = [n for n, r in models.items() if not r.ready and r.loading and n in self._initial]
        unavailable = [n for n, r in models.items() if not r.ready and n not in waiting]
        ready = not self._draining and not waiting and any(r.ready for r in models.values())
        return Readiness(ready, self._draining, waiting, unavailable,
                         {n: r.live_versions for n, r in models.items()})

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Readiness turns false; requests already accepted still complete."""
        self._draining = True

    async def metrics_text(self) -> bytes:
        """The Prometheus exposition: this process's, or every worker's (`serve.core.peers`)."""
        if self.peers is None:
            return self.metrics.render()
        return merge_worker_metrics(await self.peers.metrics_of_all())

    async def close(self) -> None:
        self._draining = True
        if self.peers is not None:
            await self.peers.close()
        await asyncio.gather(*(asyncio.to_thread(r.stop) for r in self.models.values()))
        for batcher in self.batchers.values():
            await batcher.close(timeout=self.config.drain_timeout_s)

    def _on_model_change(self, registry: ModelVersions) -> None:
        live = registry.live_versions
        self.metrics.live_versions.labels(registry.name).set(len(live))
        if live:
            self.metrics.model_version.labels(registry.name).set(max(live))

    # -- models ------------------------------------------------------------------------------

    def live_versions(self, name: str) -> list[int]:
        """The versions of model `name` being served now; NotFound for an unknown model."""
        versions = self.models.get(name)
        if versions is None:
            raise NotFound(f"Could not find any versions of model {name}")
        return versions.live_versions

    def model_statuses(self) -> dict[str, list[VersionStatus]]:
        """Every model with the status of its versions ([] while nothing is on disk)."""
        out = {}
        for name, versions in self.models.items():
            try:
                out[name] = versions.status()
            except NotFound:
                out[name] = []
        return out

    def model(self, name: str, version: int | None = None, label: str | None = None) -> LoadedModel:
        """The loaded version to answer with: `version`, the one `label` points at, or the latest."""
        registry = self.models.get(name)
        if registry is None:
            spec = f"Specific({name}, {version})" if version is not None else f"Latest({name})"
            raise NotFound(f"Servable not found for request: {spec}")
        return registry.get(version, label)

    def status(self, name: str, version: int | None = None, label: str | None = None) -> list[VersionStatus]:
        versions = self.models.get(name)
        if versions is None:
            raise NotFound(f"Could not find any versions of model {name}")
        if label is not None:
            version = versions.label_version(label)
        return versions.status(version)

    # -- drift monitoring --------------------------------------------------------------------

    def _live_models(self, name: str) -> list[LoadedModel]:
        registry = self.models[name]
        live = []
        for version in registry.live_versions:
            with contextlib.suppress(NotFound):  # unloaded meanwhile
                live.append(registry.get(version))
        return live

    def _monitors(self) -> list[tuple[str, int, VersionMonitor]]:
        return [(name, model.version, model.monitor) for name in list(self.models)
                for model in self._live_models(name) if model.monitor is not None]

    def monitoring_windows(self, name: str) -> dict:
        """This worker's drift windows of model `name`'s monitored live versions, by version."""
        if name not in self.models:
            return {}
        return {str(m.version): m.monitor.counts() for m in self._live_models(name) if m.monitor is not None}

    async def monitoring(self, name: str, version: int | None = None, label: str | None = None) -> dict:
        """Drift monitoring of model `name`: one version (by number or label), or every live one,
        with every worker's windows summed (`serve.core.monitor.describe`)."""
        models = [self.model(name, version, label)] if version is not None or label is not None else (
            self._live_models(name) if name in self.models else [self.model(name)])
        if self.peers is None:
            by_worker = {0: self.monitoring_windows(name)}
        else:
            by_worker = await self.peers.monitoring_of_all(name)
        config = self.config
        return {"model": name, "versions": [
            describe(m.version, m.monitoring, m.monitor.baseline if m.monitor else None,
                     {w: windows.get(str(m.version)) for w, windows in by_worker.items()},
                     config.monitoring_window, config.monitoring_window_s)
            for m in sorted(models, key=lambda m: -m.version)]}

    # -- requests ----------------------------------------------------------------------------

    async def predict(
        self,
        model: LoadedModel,
        signature_name: str,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout_s: float | None = None,
        row_label: RowLabel = _default_label,
    ) -> dict[str, np.ndarray]:
        """Validate `inputs` against the signature and run it batched."""
        signature = model.signature(signature_name)
        validate_inputs(signature, inputs, self.config, row_label)
        return await self._run(model, signature_name, inputs, timeout_s)

    async def classify(
        self, model: LoadedModel, signature_name: str, rows: Sequence[Mapping[str, Any]],
        context: Mapping[str, Any] | None = None, *, timeout_s: float | None = None,
    ) -> tuple[Signature, dict[str, np.ndarray]]:
        """Run a classify signature; returns (signature, outputs). `rows` and `context` map feature
        names to tf.train.Feature protos (edges pass only `CLASSIFY_FEATURES`); a row's own feature
        wins over the context's, and the model gets Examples holding only the features it reads."""
        signature = model.signature_for_method(CLASSIFY_METHOD, signature_name)
        check_rows(len(rows), self.config.max_rows_per_request)
        shared = (context or {}).get(TEXT_INPUT)
        shared_example = None if shared is None else _classify_example(shared, f"context.{TEXT_INPUT}", self.config)
        serialized = np.empty(len(rows), dtype=object)
        total = 0
        for i, features in enumerate(rows):
            if TEXT_INPUT in features:
                serialized[i] = _classify_example(features[TEXT_INPUT], f"examples[{i}].{TEXT_INPUT}", self.config)
            elif shared_example is not None:
                serialized[i] = shared_example  # the same bytes object: merging copies nothing
            else:
                raise InvalidArgument(f"examples[{i}]: no {TEXT_INPUT!r} feature")
            total += len(serialized[i])
        if total > self.config.max_body_bytes:
            # a context text merged into many examples: bound what the model is asked to read
            raise InvalidArgument(f"the examples hold {total} bytes of text with the context merged in, "
                                  f"more than the limit of {self.config.max_body_bytes}")
        (input_name,) = signature.inputs
        return signature, await self._run(model, signature.name, {input_name: serialized}, timeout_s)

    async def sentiment(self, texts: Sequence[bytes], name: str | None = None) -> tuple[int, list[Sentiment]]:
        """Sentiment of each (UTF-8) text with the latest version; returns (version, results)."""
        model = self.model(name or self.default_model)
        out = await self.predict(model, "serving_default", {TEXT_INPUT: bytes_array(texts)},
                                 row_label=lambda _name, i: f"texts[{i}]")
        results = []
        for label, row in zip(out["label"].tolist(), out["probabilities"]):
            # float32 in its shortest decimal form, the same digits as the predict API writes
            probs = [float(str(p)) for p in row]
            label = label.decode("utf-8")
            by_class = dict(zip(CLASS_NAMES, probs))
            results.append(Sentiment(label=label, score=by_class.get(label, max(probs)), probabilities=by_class))
        return model.version, results

    async def _run(
        self, model: LoadedModel, signature_name: str, inputs: Mapping[str, np.ndarray], timeout_s: float | None
    ) -> dict[str, np.ndarray]:
        timeout = self.config.request_timeout_s if timeout_s is None else min(timeout_s, self.config.request_timeout_s)
        batcher = self.batchers.get(model.name)
        if batcher is None:
            raise Unavailable(f"model {model.name} was removed from the server's config")
        return await batcher.submit(model.runner(signature_name), inputs, timeout)

    def receiving(self, name: str) -> ContextManager[None]:
        """Edges read and decode a request for model `name` inside this block, so that the model's
        batcher waits for it (and for such requests only) before running a batch."""
        batcher = self.batchers.get(name)
        return _NOT_BATCHED if batcher is None else batcher.receiving()


_NOT_BATCHED = contextlib.nullcontext()


# -- validation, once for every edge -------------------------------------------------------------


def _classify_example(feature: Any, where: str, config: ServeConfig) -> bytes:
    """A text feature (a tf.train.Feature), checked, as a serialized Example holding only it."""
    from tensorflow.core.example import example_pb2

    kind = feature.WhichOneof("kind")
    if kind != "bytes_list" or len(feature.bytes_list.value) != 1:
        raise InvalidArgument(f"{where}: expected one string, got {kind or 'nothing'}")
    check_text(feature.bytes_list.value[0], where, config)
    example = example_pb2.Example()
    example.features.feature[TEXT_INPUT].CopyFrom(feature)
    return example.SerializeToString()


def explain_signature(model: LoadedModel, requested: str = "") -> Signature:
    """The signature an explanation runs (`export.exporter.SentimentModel.explain`, called through
    `ServingCore.predict`); InvalidArgument when a request names another one or the version was
    exported before explanations existed."""
    if requested not in ("", EXPLAIN_SIGNATURE):
        raise InvalidArgument(f"explanations come from the {EXPLAIN_SIGNATURE!r} signature, not {requested!r}")
    if EXPLAIN_SIGNATURE not in model.signatures:
        raise InvalidArgument(f"version {model.version} of model {model.name} has no {EXPLAIN_SIGNATURE!r} "
                              "signature: export it again with this release's python -m export")
    return model.signatures[EXPLAIN_SIGNATURE]


def check_rows(rows: int, max_rows: int) -> None:
    """Edges call this as soon as they know a request's row count, before converting any row."""
    if rows == 0:
        raise InvalidArgument("no instances: at least one input row is required")
    if rows > max_rows:
        raise InvalidArgument(f"{rows} instances in one request, more than the limit of {max_rows}")


def check_declared_shape(signature: Signature, name: str, shape: Sequence[int], config: ServeConfig) -> int:
    """A shape a client declares for input `name`, before anything is allocated for it: a rank the
    signature takes, rows within the limit, a bounded element count. Returns the element count."""
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise InvalidArgument(f"input {name!r}: invalid tensor shape {list(shape)}")
    info = signature.inputs.get(name)
    if info is not None:
        check_shape(name, info, shape)
    check_rows(shape[0] if shape else 1, config.max_rows_per_request)
    count = math.prod(shape)
    limit = config.max_rows_per_request * VALUES_PER_ROW
    if count > limit:
        raise InvalidArgument(f"input {name!r}: the shape {list(shape)} declares {count} values, "
                              f"more than the limit of {limit}")
    return count


def check_shape(name: str, info: TensorInfo, shape: Sequence[int]) -> None:
    """The shape of input `name` (declared or decoded) against its signature."""
    if not shape:
        raise InvalidArgument(f"input {name!r}: expected a batch (rank >= 1), got a scalar")
    if info.shape is not None and (
        len(shape) != len(info.shape) or any(d not in (-1, a) for d, a in zip(info.shape[1:], shape[1:]))
    ):
        if info.dtype == "DT_STRING" and len(info.shape) == 1:
            raise InvalidArgument(f"input {name!r}: string inputs must have rank 1, got shape {list(shape)}")
        raise InvalidArgument(f"input {name!r} has shape {list(shape)}, expected {list(info.shape)}")


def check_text(data: bytes, where: str, config: ServeConfig) -> None:
    """A review text: non-empty, valid UTF-8, at most `max_text_bytes`."""
    if len(data) > config.max_text_bytes:
        raise InvalidArgument(f"{where}: text is {len(data)} bytes, more than the limit of {config.max_text_bytes}")
    if not data.strip():
        raise InvalidArgument(f"{where}: text is empty")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{where}: text is not valid UTF-8") from None


def validate_inputs(
    signature: Signature, inputs: Mapping[str, np.ndarray], config: ServeConfig, row_label: RowLabel = _default_label
) -> None:
    """Names, dtypes, shapes, row counts and text limits of a predict request; InvalidArgument if not."""
    if set(inputs) != set(signature.inputs):
        raise InvalidArgument(
            f"signature {signature.name!r} expects inputs {sorted(signature.inputs)}, got {sorted(inputs)}"
        )
    rows = None
    for name, array in inputs.items():
        info = signature.inputs[name]
        got = dtype_name(array)
        if got != info.dtype and not (info.dtype in NUMPY_DTYPES and array.dtype == NUMPY_DTYPES[info.dtype]):
            raise InvalidArgument(
                f"input {name!r}: expects {short_dtype(info.dtype)} but {short_dtype(got)} is provided"
            )
        check_shape(name, info, array.shape)
        check_rows(len(array), config.max_rows_per_request)
        if rows is not None and len(array) != rows:
            raise InvalidArgument("all inputs must have the same number of rows")
        rows = len(array)
        if info.dtype == "DT_STRING":
            _check_strings(name, array, config, row_label)


def _check_strings(name: str, array: np.ndarray, config: ServeConfig, row_label: RowLabel) -> None:
    limit = config.max_text_bytes
    for i, value in enumerate(array.ravel().tolist()):
        if not isinstance(value, bytes):
            raise InvalidArgument(f"{row_label(name, i)}: expected bytes, got {type(value).__name__}")
        if name == TEXT_INPUT:
            check_text(value, row_label(name, i), config)
        elif len(value) > limit:
            raise InvalidArgument(f"{row_label(name, i)}: value is {len(value)} bytes, more than the limit of {limit}")


__all__ = ["ServingCore", "Sentiment", "ServingError", "check_declared_shape", "check_rows", "check_shape", "check_text",
           "explain_signature", "validate_inputs"]
