"""The REST transport: TF Serving's REST API over one pooled `requests.Session` (no TensorFlow).

Works against this project's `python -m serve` and against a real `tensorflow_model_server`.
"""

from __future__ import annotations

import email.utils
import re
import time
import urllib.parse
from typing import Any, Sequence

import requests
import urllib3
from requests.adapters import HTTPAdapter

from client.exceptions import (ClientError, DeadlineExceeded, InvalidInput, InvalidURL, ModelNotFound, NotAuthorized,
                               ServerUnavailable, TlsError)
from client.results import ModelVersionStatus, RawExplanation, RawPrediction
from client.security import NO_SECURITY, Security


def parse_url(url: str) -> str:
    """`host:port` or `http(s)://host:port[/prefix]` -> a base URL; InvalidURL (a usage error) if malformed."""
    if "://" not in url:
        if "/" in url or url.startswith(("http:", "https:")):  # "http//host", "http:/host": a mistyped scheme
            raise InvalidURL(f"url={url!r}: expected http://host:port, https://host:port or host:port")
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidURL(f"url={url!r}: expected http://host:port or https://host:port")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError:
        raise InvalidURL(f"url={url!r}: the port must be a number from 1 to 65535") from None
    return url.rstrip("/")


class RestTransport:
    """TF Serving's REST API over one pooled `requests.Session`; no TensorFlow needed."""

    def __init__(self, url: str, model: str, version: int | None, version_label: str | None, *,
                 pool_size: int = 10, session: requests.Session | None = None,
                 security: Security = NO_SECURITY) -> None:
        self.base = parse_url(url)
        if security.tls_files_given and not self.base.startswith("https://"):
            raise InvalidURL(f"url={url!r}: a CA bundle or client certificate needs an https:// URL")
        self.security = security
        self._options: dict[str, Any] = {}
        """Per request, so that a session passed in keeps its own settings for other uses."""
        if security.ca_file is not None:
            self._options["verify"] = security.ca_file
        if security.cert_file is not None:
            self._options["cert"] = (security.cert_file, security.key_file)
        if security.authorization is not None:
            self._options["headers"] = {"Authorization": security.authorization}
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

    def explain(self, texts: Sequence[str], timeout: float) -> list[RawExplanation]:
        body = self._request("POST", self.model_url + ":explain", {"instances": list(texts)}, timeout)
        predictions = body.get("predictions") if isinstance(body, dict) else None
        if not isinstance(predictions, list):
            raise ClientError(f"unexpected explain response: no 'predictions' list in {str(body)[:200]}")
        return [_raw_explanation(row) for row in predictions]

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
            response = self.session.request(method, url, json=body, timeout=timeout, **self._options)
        except requests.exceptions.SSLError as exc:  # retrying cannot help: the URL or a file is wrong
            raise _tls_error(exc, self.base, self.security) from None
        except requests.ReadTimeout:
            raise DeadlineExceeded(f"no response from {self.base} within {timeout:g}s") from None
        except requests.ConnectionError as exc:  # refused, reset, DNS, connect timeout
            if _closed_before_response(exc):
                # A keep-alive connection the server closed as the request went out (a draining or
                # restarting server, an idle timeout): nothing was answered, and a prediction has no
                # side effects, so the retry goes out at once, on a new connection.
                raise ServerUnavailable(f"{self.base} closed the connection before answering: {_reason(exc)}"
                                        f"{_CERT_HINT if self.security.cert_file else ''}", retry_after=0.0) from None
            raise ServerUnavailable(f"cannot connect to {self.base}: {_reason(exc)}") from None
        except requests.RequestException as exc:
            raise ClientError(f"request to {self.base} failed: {_reason(exc)}") from None
        if response.status_code != 200:
            raise _http_error(response)
        try:
            return response.json()
        except ValueError:
            raise ClientError(f"response from {url} is not JSON: {response.text[:200]!r}", response.status_code) from None


_CERT_HINT = " (if it asks for client certificates, it may not trust cert_file, CLI --cert)"
"""TLS 1.3 tells a client that its certificate was refused only when it reads: a closed connection."""


def _closed_before_response(exc: requests.ConnectionError) -> bool:
    """The request was sent on an open connection that closed without a response byte (not a
    connection refused or a DNS failure, which urllib3 reports as MaxRetryError)."""
    return bool(exc.args) and isinstance(exc.args[0], urllib3.exceptions.ProtocolError)


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


def _raw_explanation(row: Any) -> RawExplanation:
    """One row of an explain answer: label, probabilities, ngrams, contributions and bias."""
    try:
        label, probabilities = row["label"], [float(p) for p in row["probabilities"]]
        pairs = list(zip(row["ngrams"], (float(c) for c in row["contributions"]), strict=True))
        return str(label), probabilities, pairs, float(row["bias"])
    except (KeyError, TypeError, ValueError):
        raise ClientError(f"unexpected explanation: {str(row)[:200]}") from None


def _http_error(response: requests.Response) -> ClientError:
    status = response.status_code
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:500] or response.reason or f"HTTP {status}"
    if status == 404:
        return ModelNotFound(message, status)
    if status in (401, 403):
        return NotAuthorized(message, status)
    if status in (400, 413, 422):
        return InvalidInput(message, status)
    if status in (429, 503):
        return ServerUnavailable(message, status, retry_after=_retry_after(response.headers.get("Retry-After")))
    if status in (408, 504):
        return DeadlineExceeded(message, status)
    return ClientError(message, status)


def _tls_error(exc: requests.exceptions.SSLError, base: str, security: Security) -> ClientError:
    """What to change after a failed handshake: the URL (a plain-HTTP server), the CA bundle or the
    host name (a certificate that does not verify), or the client certificate (one the server wants)."""
    reason = _reason(exc)
    text = str(exc)
    if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
        return InvalidURL(f"TLS with {base} failed ({reason}): the server speaks plain HTTP, "
                          f"use {base.replace('https://', 'http://', 1)}")
    if "CERTIFICATE_VERIFY_FAILED" in text:
        trusted = f"the CA bundle {security.ca_file}" if security.ca_file else "the system's CA certificates"
        return TlsError(f"the certificate of {base} does not verify against {trusted} ({reason}): pass the CA "
                        "that signed it (ca_file=, CLI --ca-file), or use the host name it was issued for")
    if any(marker in text for marker in ("CERTIFICATE_REQUIRED", "certificate required", "UNKNOWN_CA", "unknown ca",
                                         "BAD_CERTIFICATE", "bad certificate")):
        return TlsError(f"{base} refused the client certificate ({reason}): it wants one signed by a CA it trusts "
                        "(cert_file= and key_file=, CLI --cert and --key)")
    if "EOF occurred" in text:
        hint = (" it does not trust the client certificate (cert_file=)" if security.cert_file
                else " it may want a client certificate (cert_file= and key_file=, CLI --cert and --key)")
        return TlsError(f"{base} closed the connection during the TLS handshake:{hint}")
    return TlsError(f"TLS with {base} failed ({reason})")


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
    match = re.search(r"\[SSL[^\]]*\] ([^(')]*)", text)
    if match:
        return match.group(1).strip()
    for marker in ("Connection refused", "Connection reset", "Connection aborted", "timed out", "Name or service"):
        if marker.lower() in text.lower():
            return marker
    return type(exc).__name__
