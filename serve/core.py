"""The serving core shared by every frontend (REST now, gRPC later): registry + batcher + metrics.

Nothing here knows HTTP or gRPC. Frontends resolve a model, validate the request into numpy
arrays, and call `ServingCore.run`; errors are `serve.errors.ServingError` subclasses, each
with `http_status` and `grpc_code`. A second frontend shares the same instance:

    core = ServingCore(config).start()          # once per process
    app = create_app(config, core)              # REST
    # gRPC Predict handler, per call:
    core.request_started()                      # lets the batcher wait for this request
    try:
        model = core.model(spec.name, spec.version.value or None, spec.version_label or None)
        inputs = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
        outputs = core.run(model, spec.signature_name or "serving_default", inputs)
    except ServingError as exc:
        context.abort(exc.grpc_code, exc.message)
    finally:
        core.request_finished()
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Mapping, Sequence

import numpy as np

from common.model import CLASS_NAMES
from serve.batching import Batcher
from serve.config import ServeConfig
from serve.errors import InvalidArgument, NotFound
from serve.metrics import Metrics
from serve.models import LoadedModel, ModelRegistry

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sentiment:
    label: str
    score: float
    """Probability of `label`."""
    probabilities: dict[str, float]


class ServingCore:
    """Create once per process; pass to `create_app` (and to a gRPC server) to share it."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.registry = ModelRegistry(config, on_change=self._on_model_change)
        self.batcher = Batcher(
            max_batch_size=config.max_batch_size,
            batch_timeout_s=config.batch_timeout_s,
            max_queued_rows=config.max_queued_rows,
            num_threads=config.num_batch_threads,
            overload_status=config.overload_status,
            on_batch=self.metrics.observe_batch,
            arriving=lambda: self._arriving,
            pad_single_row=config.pad_single_row,
        )
        self.metrics.queued_rows.set_function(lambda: self.batcher.queued_rows)
        self._draining = threading.Event()
        self._started = False
        self._arriving = 0  # requests received by a frontend, not yet submitted to the batcher
        self._arriving_lock = threading.Lock()
        self._local = threading.local()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "ServingCore":
        """Start loading (in the background) and polling for versions."""
        if not self._started:
            self._started = True
            self.registry.start()
        return self

    def load_now(self) -> "ServingCore":
        """Load synchronously (tests, benchmarks); polling is not started."""
        self.registry.refresh()
        return self

    @property
    def ready(self) -> bool:
        return self.registry.ready and not self._draining.is_set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def begin_drain(self) -> None:
        """Readiness turns false; requests already accepted still complete."""
        self._draining.set()

    def close(self) -> None:
        self._draining.set()
        self.registry.stop()
        self.batcher.close(timeout=self.config.drain_timeout_s)

    def _on_model_change(self, registry: ModelRegistry) -> None:
        live = registry.live_versions
        name = self.config.model_name
        self.metrics.live_versions.labels(name).set(len(live))
        if live:
            self.metrics.model_version.labels(name).set(max(live))

    # -- requests ----------------------------------------------------------------------------

    def request_started(self) -> None:
        """Frontends call this when a request that may run the model arrives (same thread as
        `run`), and `request_finished` when it is done; the batcher waits only for those."""
        self._local.arriving = True
        with self._arriving_lock:
            self._arriving += 1

    def request_finished(self) -> None:
        self._left_arrival()

    def _left_arrival(self) -> None:
        if getattr(self._local, "arriving", False):
            self._local.arriving = False
            with self._arriving_lock:
                self._arriving -= 1

    def model(self, name: str, version: int | None = None, label: str | None = None) -> LoadedModel:
        if name != self.config.model_name:
            spec = f"Specific({name}, {version})" if version is not None else f"Latest({name})"
            raise NotFound(f"Servable not found for request: {spec}")
        return self.registry.get(version, label)

    def run(self, model: LoadedModel, signature_name: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Batched call of one signature; inputs must match the signature's input names."""
        signature = model.signature(signature_name)
        missing = set(signature.inputs) - set(inputs)
        extra = set(inputs) - set(signature.inputs)
        if missing or extra:
            raise InvalidArgument(
                f"signature {signature_name!r} expects inputs {sorted(signature.inputs)}, got {sorted(inputs)}"
            )
        deadline = time.monotonic() + self.config.request_timeout_s
        self._left_arrival()
        return self.batcher.submit(model.runner(signature_name), inputs, deadline)

    def predict_texts(self, texts: Sequence[str], version: int | None = None) -> tuple[int, list[Sentiment]]:
        """Sentiment of each text with the default (or given) version; returns (version, results)."""
        model = self.registry.get(version)
        values = np.array([t.encode("utf-8") for t in texts], dtype=object)
        out = self.run(model, "serving_default", {"text": values})
        probabilities = out["probabilities"].tolist()
        results = []
        for label, probs in zip(out["label"], probabilities):
            label = label.decode("utf-8")
            by_class = dict(zip(CLASS_NAMES, probs))
            results.append(Sentiment(label=label, score=by_class.get(label, max(probs)), probabilities=by_class))
        return model.version, results
