"""`SentimentClient`: typed predictions from a sentiment model behind TF Serving's API.

It speaks only TensorFlow Serving's protocol (REST `:predict` with `instances`, model status,
model metadata; or the gRPC PredictionService/ModelService), so it works against this
project's `python -m serve` and against a real `tensorflow_model_server` alike.

The REST transport needs only `requests` (TensorFlow is never imported); the gRPC transport
imports TensorFlow and `tensorflow-serving-api` when it is first created.

    with SentimentClient("http://localhost:8501", model="sentiment") as client:
        client.wait_until_ready(timeout=30)
        for p in client.predict(["great movie", "dull and too long"]):
            print(p.label, p.score)
"""

from __future__ import annotations

import dataclasses
import email.utils
import logging
import random
import re
import time
import urllib.parse
from typing import Any, Callable, Iterable, Literal, Protocol, Sequence, TypeVar

import requests
from requests.adapters import HTTPAdapter

from client.exceptions import ClientError, DeadlineExceeded, InvalidInput, ModelNotFound, ServerUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
Transport = Literal["rest", "grpc"]
CLASS_NAMES = ("negative", "positive")


@dataclasses.dataclass(frozen=True)
class Prediction:
    text: str
    label: str
    """The predicted class: the model's `label` output, else the class of the highest probability."""
    score: float
    """Probability of `label`."""
    probabilities: dict[str, float]
    """Probability of every class, by class name."""


@dataclasses.dataclass(frozen=True)
class ModelVersionStatus:
    """One entry of TF Serving's model status (`GET /v1/models/NAME`, `GetModelStatus`)."""

    version: int
    state: str
    """START, LOADING, AVAILABLE, UNLOADING or END."""
    error_code: str = "OK"
    error_message: str = ""

    @property
    def available(self) -> bool:
        return self.state == "AVAILABLE"


RawPrediction = tuple[str | None, list[float]]
"""What a transport returns per text: (the `label` output if the model has one, probabilities)."""


class _Transport(Protocol):
    def predict(self, texts: Sequence[str], signature_name: str, timeout: float) -> list[RawPrediction]: ...
    def status(self, timeout: float) -> list[ModelVersionStatus]: ...
    def metadata(self, timeout: float) -> dict[str, Any]: ...
    def close(self) -> None: ...


class SentimentClient:
    """Client of one model on one server. Reuse one instance: it pools connections (up to
    `pool_size`, shared by threads calling it concurrently).

    url: `http://host:8501` for REST, `host:8500` (or `grpc://host:8500`) for gRPC.
    model: the model name (`/v1/models/NAME`); version / version_label pin a version (default: latest).
    timeout: seconds per attempt of every call (connect and read); override per call.
    retries: extra attempts after 429/503 responses and connection errors (gRPC: UNAVAILABLE,
        RESOURCE_EXHAUSTED), with exponential backoff and jitter, or the server's Retry-After.
        Other errors (400, 404, 500, deadlines) are never retried.
    batch_size: texts per request; `predict` splits longer lists into several requests.
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
    ) -> None:
        if transport not in ("rest", "grpc"):
            raise ValueError(f"transport={transport!r}: expected 'rest' or 'grpc'")
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
        self._transport: _Transport
        if transport == "rest":
            self._transport = RestTransport(url, model, version, version_label, pool_size=pool_size, session=session)
        else:
            from client.grpc_transport import GrpcTransport  # imports TensorFlow

            self._transport = GrpcTransport(url, model, version, version_label)

    def __repr__(self) -> str:
        return f"SentimentClient({self.url!r}, model={self.model!r}, transport={self.transport!r})"

    def __enter__(self) -> "SentimentClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._transport.close()

    # -- API ---------------------------------------------------------------------------------

    def predict(self, texts: str | Iterable[str], *, timeout: float | None = None) -> list[Prediction]:
        """Sentiment of each text, in order. Lists longer than `batch_size` go in several requests."""
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise InvalidInput("no texts to predict: pass at least one text")
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise InvalidInput(f"texts[{i}] is {type(text).__name__}, expected str")
        results: list[Prediction] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            raw = self._retrying(lambda t: self._transport.predict(chunk, self.signature_name, t), timeout)
            if len(raw) != len(chunk):
                raise ClientError(f"server returned {len(raw)} predictions for {len(chunk)} texts")
            results.extend(self._prediction(text, label, probs) for text, (label, probs) in zip(chunk, raw))
        return results

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


# -- REST ----------------------------------------------------------------------------------------


class RestTransport:
    """TF Serving's REST API over one pooled `requests.Session`; no TensorFlow needed."""

    def __init__(self, url: str, model: str, version: int | None, version_label: str | None, *,
                 pool_size: int = 10, session: requests.Session | None = None) -> None:
        if "://" not in url:
            url = "http://" + url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url={url!r}: expected http://host:port")
        self.base = url.rstrip("/")
        path = f"{self.base}/v1/models/{urllib.parse.quote(model, safe='')}"
        if version is not None:
            path += f"/versions/{int(version)}"
        elif version_label is not None:
            path += f"/labels/{urllib.parse.quote(version_label, safe='')}"
        self.model_url = path
        self._own_session = session is None
        self.session = session or requests.Session()
        if self._own_session:
            adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, max_retries=0)
            self.session.mount("http://", adapter)
            self.session.mount("https://", adapter)

    def close(self) -> None:
        if self._own_session:
            self.session.close()

    def predict(self, texts: Sequence[str], signature_name: str, timeout: float) -> list[RawPrediction]:
        body = self._request("POST", self.model_url + ":predict",
                             {"signature_name": signature_name, "instances": list(texts)}, timeout)
        predictions = body.get("predictions") if isinstance(body, dict) else None
        if not isinstance(predictions, list):
            raise ClientError(f"unexpected predict response: no 'predictions' list in {str(body)[:200]}")
        return [_raw_prediction(row) for row in predictions]

    def status(self, timeout: float) -> list[ModelVersionStatus]:
        body = self._request("GET", self.model_url, None, timeout)
        try:
            return [
                ModelVersionStatus(
                    version=int(s["version"]), state=s["state"],
                    error_code=s.get("status", {}).get("error_code", "OK"),
                    error_message=s.get("status", {}).get("error_message", ""),
                )
                for s in body["model_version_status"]
            ]
        except (KeyError, TypeError, ValueError):
            raise ClientError(f"unexpected status response: {str(body)[:200]}") from None

    def metadata(self, timeout: float) -> dict[str, Any]:
        return self._request("GET", self.model_url + "/metadata", None, timeout)

    def _request(self, method: str, url: str, body: Any, timeout: float) -> Any:
        try:
            response = self.session.request(method, url, json=body, timeout=timeout)
        except requests.ReadTimeout:
            raise DeadlineExceeded(f"no response from {self.base} within {timeout:g}s") from None
        except requests.ConnectionError as exc:  # refused, reset, DNS, connect timeout
            raise ServerUnavailable(f"cannot connect to {self.base}: {_reason(exc)}") from None
        except requests.RequestException as exc:
            raise ClientError(f"request to {self.base} failed: {_reason(exc)}") from None
        if response.status_code != 200:
            raise _http_error(response)
        try:
            return response.json()
        except ValueError:
            raise ClientError(f"response from {url} is not JSON: {response.text[:200]!r}", response.status_code) from None


def _raw_prediction(row: Any) -> RawPrediction:
    """One row of `predictions`: an object of outputs, or a bare list when the model has one output."""
    if isinstance(row, dict):
        probabilities = row.get("probabilities", row.get("scores"))
        label = row.get("label")
    else:
        probabilities, label = row, None
    if not isinstance(probabilities, list) or not all(isinstance(p, (int, float)) for p in probabilities):
        raise ClientError(f"unexpected prediction (no 'probabilities' output): {str(row)[:200]}")
    return (label if isinstance(label, str) else None), probabilities


def _http_error(response: requests.Response) -> ClientError:
    status = response.status_code
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:500] or response.reason or f"HTTP {status}"
    if status == 404:
        return ModelNotFound(message, status)
    if status in (400, 413, 422):
        return InvalidInput(message, status)
    if status in (429, 503):
        return ServerUnavailable(message, status, retry_after=_retry_after(response.headers.get("Retry-After")))
    if status in (408, 504):
        return DeadlineExceeded(message, status)
    return ClientError(message, status)


def _retry_after(value: str | None) -> float | None:
    """Retry-After: seconds, or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _reason(exc: Exception) -> str:
    """The useful part of a requests/urllib3 error: `[Errno 111] Connection refused`."""
    text = str(exc)
    match = re.search(r"\[Errno -?\d+\][^'\")]*", text)
    if match:
        return match.group(0).strip()
    for marker in ("Connection refused", "Connection reset", "Connection aborted", "timed out", "Name or service"):
        if marker.lower() in text.lower():
            return marker
    return type(exc).__name__
