"""Serving errors: neutral kinds raised by the core, mapped to a status at each protocol edge.

The core (registry, batcher, validation) never knows HTTP or gRPC. Each error carries a `Code`
named like TensorFlow's / absl's status codes (the same names as `grpc.StatusCode`); the REST edge
maps it to an HTTP status with TF Serving's table (`http_server.cc: ToHTTPStatusCode`) and the
gRPC edge to the `grpc.StatusCode` of the same name.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """Canonical status codes (tensorflow/core/protobuf/error_codes.proto)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ServingError(Exception):
    """Base of every error the serving core reports to a client; `message` is safe to send."""

    code: Code = Code.INTERNAL
    retryable: bool = False
    """True when the same request may succeed a moment later (edges add Retry-After)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServingError, ValueError):
    """Malformed request: bad JSON or protobuf, wrong types, empty or oversized inputs."""

    code = Code.INVALID_ARGUMENT


class NotFound(ServingError, LookupError):
    """Unknown model, version, label or signature."""

    code = Code.NOT_FOUND


class PermissionDenied(ServingError, PermissionError):
    """An operation the server's flags do not allow (model management while it is off)."""

    code = Code.PERMISSION_DENIED


class Overloaded(ServingError):
    """The queue of pending work is full; safe to retry after a short wait."""

    code = Code.RESOURCE_EXHAUSTED
    retryable = True


class Unavailable(ServingError):
    """No model version loaded yet, the server is shutting down, or (configured) overload."""

    code = Code.UNAVAILABLE
    retryable = True


class DeadlineExceeded(ServingError, TimeoutError):
    """The request did not complete within its deadline."""

    code = Code.DEADLINE_EXCEEDED


class Internal(ServingError):
    """Unexpected failure inside the model call."""

    code = Code.INTERNAL


__all__ = [
    "Code",
    "ServingError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Overloaded",
    "Unavailable",
    "DeadlineExceeded",
    "Internal",
]
