"""What `serve.http2.machine.ServerConnection.receive` reports, one event per thing the application
must act on. Everything else (SETTINGS, PING, flow control, PRIORITY, protocol errors on streams the
application never saw) the machine answers itself."""

from __future__ import annotations

from typing import NamedTuple

from serve.http2.headers import RequestHead


class RequestReceived(NamedTuple):
    """A new stream's request headers, validated (RFC 9113 8.2-8.3); `end_stream`: no body follows."""

    stream_id: int
    head: RequestHead
    end_stream: bool


class DataReceived(NamedTuple):
    """Request body bytes (padding removed); `end_stream`: the last of them. The application gives
    the bytes' flow-control credit back (`credit_stream`, `credit_connection`) once it no longer holds them."""

    stream_id: int
    data: bytes
    end_stream: bool


class TrailersReceived(NamedTuple):
    """The request's trailers arrived (their fields are not kept): the request has ended."""

    stream_id: int


class HeadersTooLarge(NamedTuple):
    """A new stream whose header list was past the limit: the stream is open for an answer, but the
    header table is out of step, so GOAWAY has been sent and no later request is read."""

    stream_id: int
    end_stream: bool


class StreamReset(NamedTuple):
    """A stream the application knows ended without an answer: reset by the client (`remote`), or by
    the machine for a stream error (`code`, and `reason` in words)."""

    stream_id: int
    code: int
    remote: bool
    reason: str = ""


class RequestRefused(NamedTuple):
    """A new stream refused before the application saw it (malformed request, stream limit, GOAWAY
    sent): already reset with `code`; reported so the application can count and log it."""

    stream_id: int
    code: int
    reason: str


class ConnectionTerminated(NamedTuple):
    """The client sent GOAWAY: it opens no more streams; those up to `last_stream_id` go on."""

    code: int
    last_stream_id: int
    debug: bytes


class ConnectionFailed(NamedTuple):
    """A connection error: GOAWAY with `code` is queued, nothing more is read; close the connection
    once it is written. Every open stream is gone."""

    code: int
    reason: str


Event = (RequestReceived | DataReceived | TrailersReceived | HeadersTooLarge | StreamReset | RequestRefused
         | ConnectionTerminated | ConnectionFailed)

__all__ = ["ConnectionFailed", "ConnectionTerminated", "DataReceived", "Event", "HeadersTooLarge", "RequestReceived",
           "RequestRefused", "StreamReset", "TrailersReceived"]
