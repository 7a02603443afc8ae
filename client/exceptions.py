"""The client's errors: one base class, each kind also a builtin it resembles (as in requests).

Every error carries the server's message and the status it came with: the HTTP status code
(int) for REST, the gRPC status code name (str, e.g. "NOT_FOUND") for gRPC, or None when no
response arrived (connection refused, client-side timeout).
"""

from __future__ import annotations


class ClientError(Exception):
    """Base of every error raised by `SentimentClient`."""

    def __init__(self, message: str, status: int | str | None = None, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        """The server's error message (its `{"error": ...}` body or gRPC details), or what went wrong."""
        self.status = status
        """HTTP status (REST), gRPC code name (gRPC), or None if no response came back."""
        self.retry_after = retry_after
        """Seconds the server asked us to wait before retrying (HTTP Retry-After), if any."""

    def __str__(self) -> str:
        return f"{self.message} (status {self.status})" if self.status is not None else self.message


class InvalidURL(ClientError, ValueError):
    """The server address cannot be used as given: malformed, a bad port, or https:// against a
    plain-HTTP server. A usage error: fix the URL."""


class TlsError(ClientError):
    """The TLS handshake failed: the server's certificate does not verify against the CA bundle
    (`ca_file`, else the system's), names another host, or the server wants a client certificate
    it was not given or does not trust. A configuration error: retrying cannot help."""


class NotAuthorized(ClientError, PermissionError):
    """The server refused the caller: no valid bearer token (401 / UNAUTHENTICATED) or an operation
    it does not allow (403 / PERMISSION_DENIED). Pass `token=` (CLI: --token-file, $SENTIMENT_TOKEN)."""


class ModelNotFound(ClientError, LookupError):
    """The model, version, label or signature does not exist on the server (404 / NOT_FOUND)."""


class InvalidInput(ClientError, ValueError):
    """The server rejected the request as malformed: empty or oversized text, wrong types
    (400, 413 / INVALID_ARGUMENT). Retrying the same request cannot succeed."""


class ServerUnavailable(ClientError, ConnectionError):
    """No usable answer: connection refused or reset, server loading, draining or overloaded
    (503, 429 / UNAVAILABLE, RESOURCE_EXHAUSTED). Raised after the retries are used up."""


class DeadlineExceeded(ClientError, TimeoutError):
    """The call did not complete in time: the client's timeout, or the server's deadline (504 /
    DEADLINE_EXCEEDED). Predictions have no side effects, so retrying is safe."""


__all__ = ["ClientError", "InvalidURL", "TlsError", "NotAuthorized", "ModelNotFound", "InvalidInput", "ServerUnavailable", "DeadlineExceeded"]
