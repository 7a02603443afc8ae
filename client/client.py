"""`SentimentClient`: typed predictions from a sentiment model behind TF Serving's API.

A thin facade over a transport (`client.rest.RestTransport`, or from `client.grpc_transport`
`GrpcTransport` and `V2GrpcTransport`, kept apart from it as requests keeps its adapters apart from
sessions): it splits long lists into requests, retries what is safe to retry, and turns raw
outputs into `Prediction`s. Transports:
- "rest": TensorFlow Serving's REST API (`:predict` with `instances`, model status, metadata);
- "grpc": TensorFlow Serving's gRPC PredictionService/ModelService;
- "grpc-v2": the Open Inference Protocol (KServe V2) over gRPC (Triton, KServe, MLServer speak it).
So it works against this project's `python -m serve` and a real `tensorflow_model_server` alike.

The REST transport needs only `requests`; the gRPC ones need grpcio and protobuf
(`pip install "sentiment-client[grpc]"`). TensorFlow is never imported.

    with SentimentClient("http://localhost:8501", model="sentiment") as client:
        client.wait_until_ready(timeout=30)
        for p in client.predict(["great movie", "dull and too long"]):
            print(p.label, p.score)
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any, Callable, Iterable, Iterator, Literal, Protocol, Sequence, TypeVar

import requests

from client.exceptions import ClientError, DeadlineExceeded, InvalidInput, ModelNotFound, ServerUnavailable
from client.rest import RestTransport
from client.results import CLASS_NAMES, Explanation, ModelVersionStatus, Prediction, RawExplanation, RawPrediction
from client.security import Security

log = logging.getLogger(__name__)

T = TypeVar("T")
Transport = Literal["rest", "grpc", "grpc-v2"]
TRANSPORTS = ("rest", "grpc", "grpc-v2")


class _Transport(Protocol):
    def predict(self, texts: Sequence[str], signature_name: str, timeout: float) -> list[RawPrediction]: ...
    def explain(self, texts: Sequence[str], timeout: float) -> list[RawExplanation]: ...
    def status(self, timeout: float) -> list[ModelVersionStatus]: ...
    def metadata(self, timeout: float) -> dict[str, Any]: ...
    def close(self) -> None: ...


class SentimentClient:
    """Client of one model on one server. Reuse one instance: it pools connections (up to
    `pool_size`, shared by threads calling it concurrently).

    url: `http://host:8501` for REST, `host:8500` (or `grpc://host:8500`) for either gRPC transport.
    model: the model name (`/v1/models/NAME`); version / version_label pin a version (default: latest).
    timeout: seconds per attempt of every call (connect and read); override per call.
    retries: extra attempts after 429/503 responses and connection errors (gRPC: UNAVAILABLE,
        RESOURCE_EXHAUSTED), with exponential backoff and jitter, or the server's Retry-After.
        Other errors (400, 404, 500, deadlines) are never retried.
    batch_size: texts per request; `predict` splits longer lists into several requests.
    ca_file: PEM bundle of the CAs that signed the server's certificate (default: the system's CAs);
        REST needs an `https://` URL, gRPC turns TLS on (as does an `https://` or `grpcs://` target).
    cert_file, key_file: a client certificate and its key, for servers that ask for one (mTLS).
    token: a bearer token, sent as `Authorization: Bearer TOKEN` (gRPC: `authorization` metadata).
    A certificate that does not verify raises `TlsError`; a refused token `NotAuthorized`.
    """

    def __init__(
        self,
        url: str = "http://localhost:8501",
        model: str = "sentiment",
        *,
        transport: Transport = "rest",
        version: int | None = None,
        version_label: str | None = None,
        signature_name: str = "serving_default",
        timeout: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_backoff_s: float = 10.0,
        batch_size: int = 64,
        pool_size: int = 10,
        class_names: Sequence[str] = CLASS_NAMES,
        session: requests.Session | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        token: str | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: expected one of {', '.join(TRANSPORTS)}")
        if version is not None and version_label is not None:
            raise ValueError("give version or version_label, not both")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: must be > 0")
        if retries < 0:
            raise ValueError(f"retries={retries}: must be >= 0")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        self.url = url
        self.model = model
        self.transport = transport
        self.signature_name = signature_name
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.batch_size = batch_size
        self.class_names = tuple(class_names)
        security = Security(ca_file, cert_file, key_file, token)
        self._transport: _Transport
        if transport == "rest":
            self._transport = RestTransport(url, model, version, version_label, pool_size=pool_size, session=session,
                                            security=security)
        else:
            try:
                from client.grpc_transport import GrpcTransport, V2GrpcTransport
            except ImportError as exc:
                raise ClientError(f"the gRPC transports need grpcio and protobuf "
                                  f"(pip install \"sentiment-client[grpc]\"): {exc}") from None
            kind = GrpcTransport if transport == "grpc" else V2GrpcTransport
            self._transport = kind(url, model, version, version_label, security)

    def __repr__(self) -> str:
        return f"SentimentClient({self.url!r}, model={self.model!r}, transport={self.transport!r})"

    def __enter__(self) -> "SentimentClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections (or the gRPC channel); `with SentimentClient(...)` does it on exit."""
        self._transport.close()

    # -- API ---------------------------------------------------------------------------------

    def predict(self, texts: str | Iterable[str], *, timeout: float | None = None) -> list[Prediction]:
        """Sentiment of each text, in order. Lists longer than `batch_size` go in several requests."""
        results: list[Prediction] = []
        for chunk in self._chunks(texts):
            raw = self._retrying(lambda t: self._transport.predict(chunk, self.signature_name, t), timeout)
            if len(raw) != len(chunk):
                raise ClientError(f"server returned {len(raw)} predictions for {len(chunk)} texts")
            results.extend(self._prediction(text, label, probs) for text, (label, probs) in zip(chunk, raw))
        return results

    def explain(self, texts: str | Iterable[str], *, timeout: float | None = None) -> list[Explanation]:
        """Sentiment of each text with the n-grams that drove it (REST `:explain`, or gRPC Predict
        with the `explain` signature; not over grpc-v2). Each call runs alone on the server."""
        results: list[Explanation] = []
        for chunk in self._chunks(texts):
            raw = self._retrying(lambda t: self._transport.explain(chunk, t), timeout)
            if len(raw) != len(chunk):
                raise ClientError(f"server returned {len(raw)} explanations for {len(chunk)} texts")
            for text, (label, probs, contributions, bias) in zip(chunk, raw):
                base = self._prediction(text, label, probs)
                results.append(Explanation(**dataclasses.asdict(base), contributions=contributions, bias=bias))
        return results

    def _chunks(self, texts: str | Iterable[str]) -> Iterator[list[str]]:
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise InvalidInput("no texts to predict: pass at least one text")
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise InvalidInput(f"texts[{i}] is {type(text).__name__}, expected str")
        for start in range(0, len(items), self.batch_size):
            yield items[start : start + self.batch_size]

    def status(self, *, timeout: float | None = None) -> list[ModelVersionStatus]:
        """State of the model's versions (newest first as the server lists them)."""
        return self._retrying(self._transport.status, timeout)

    def metadata(self, *, timeout: float | None = None) -> dict[str, Any]:
        """TF Serving's metadata JSON: `{"model_spec": ..., "metadata": {"signature_def": ...}}`
        (the same shape over gRPC, converted from the protos)."""
        return self._retrying(self._transport.metadata, timeout)

    def wait_until_ready(self, timeout: float = 60.0, poll_interval_s: float = 0.25) -> list[ModelVersionStatus]:
        """Poll the model status until a version is AVAILABLE; returns the statuses. Raises
        `ServerUnavailable` (with the last error seen) if none is within `timeout` seconds."""
        end = time.monotonic() + timeout
        last: str = "no answer"
        while True:
            remaining = end - time.monotonic()
            try:
                statuses = self._transport.status(max(0.05, min(self.timeout, remaining)))
                if any(s.available for s in statuses):
                    return statuses
                last = "versions " + ", ".join(f"{s.version}: {s.state}" for s in statuses)
            except (ServerUnavailable, ModelNotFound, DeadlineExceeded) as exc:
                last = str(exc)  # not up, still loading, or slow: keep waiting
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise ServerUnavailable(f"model {self.model!r} at {self.url} not ready after {timeout:g}s: {last}")
            time.sleep(min(poll_interval_s, remaining))

    # -- internals ---------------------------------------------------------------------------

    def _prediction(self, text: str, label: str | None, probabilities: list[float]) -> Prediction:
        names = self.class_names if len(self.class_names) == len(probabilities) else tuple(
            str(i) for i in range(len(probabilities)))
        by_class = dict(zip(names, (float(p) for p in probabilities)))
        if not by_class:
            raise ClientError("server returned no probabilities")
        if label is None:
            label = max(by_class, key=by_class.__getitem__)
        score = by_class.get(label, max(by_class.values()))
        return Prediction(text=text, label=label, score=score, probabilities=by_class)

    def _retrying(self, call: Callable[[float], T], timeout: float | None) -> T:
        timeout = self.timeout if timeout is None else timeout
        attempt = 0
        while True:
            try:
                return call(timeout)
            except ServerUnavailable as exc:
                if attempt >= self.retries:
                    raise
                delay = self._backoff(attempt, exc.retry_after)
                log.info("attempt %d of %d failed (%s); retrying in %.2fs", attempt + 1, self.retries + 1, exc, delay)
                time.sleep(delay)
                attempt += 1

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_backoff_s)
        ceiling = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # "equal jitter": spread clients out
