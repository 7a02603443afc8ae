"""Serving errors: one base class, each kind mapped to an HTTP status and a gRPC status code.

Both frontends (REST here, gRPC later) raise and catch these; the core never builds HTTP or
gRPC responses itself. The table follows TF Serving (tensorflow/serving util/net_http status).
"""

from __future__ import annotations

import grpc


class ServingError(Exception):
    """Base of every error the serving core reports to a client."""

    http_status: int = 500
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"error": self.message}


class InvalidArgument(ServingError, ValueError):
    """Malformed request: bad JSON, wrong types, empty or oversized inputs."""

    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServingError, LookupError):
    """Unknown model, version, label or signature."""

    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND


class TooLarge(ServingError):
    """Request body over the configured limit."""

    http_status = 413
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Overloaded(ServingError):
    """Queue of pending work is full; safe to retry after a short wait."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, http_status: int = 429) -> None:
        super().__init__(message)
        self.http_status = http_status
        if http_status == 503:
            self.grpc_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServingError, TimeoutError):
    """The request did not complete within its deadline."""

    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServingError):
    """No model loaded yet, or the server is shutting down; safe to retry elsewhere."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE


class Internal(ServingError):
    """Unexpected failure inside the model call."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL


__all__ = [
    "ServingError",
    "InvalidArgument",
    "NotFound",
    "TooLarge",
    "Overloaded",
    "DeadlineExceeded",
    "Unavailable",
    "Internal",
]
