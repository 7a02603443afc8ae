"""gRPC's wire protocol over HTTP/2 (gRPC's PROTOCOL-HTTP2.md), without IO: what a request's headers
say (`CallHead`), its one length-prefixed message (inflated if compressed, never past the limit),
answers' headers and trailers, and the status a handler ends a call with (`RpcError`).

A status message is safe to show the client and short: at most MAX_STATUS_MESSAGE bytes go out, and
whatever of the request a message repeats (a method path, a model name) is cut to a few hundred bytes
before it is put in (`echo`), so an answer never grows with what the client sent.
"""

from __future__ import annotations

import struct
import zlib
from typing import AsyncIterator, Awaitable, Callable, NamedTuple, Protocol

from serve.core.errors import Code
from serve.http2.headers import RequestHead

MAX_STATUS_MESSAGE = 1024
"""The longest grpc-message sent, in bytes after percent-encoding."""
ECHO_LIMIT = 200
"""The most characters of anything the client sent that an error message repeats."""

RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))
OK_TRAILERS = ((b"grpc-status", b"0"),)
_PREFIX = struct.Struct(">BL")


class RpcError(Exception):
    """Ends a call with a gRPC status; `message` (grpc-message) is safe to show the client."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def echo(text: str) -> str:
    """`text` from the client, cut to ECHO_LIMIT characters for an error message."""
    return text if len(text) <= ECHO_LIMIT else text[:ECHO_LIMIT] + "..."


class CallContext(Protocol):
    """What a handler may ask of its call (`serve.grpc.connection.Call`)."""

    authorization: bytes | None
    """The call's `authorization` metadata, if it sent one."""

    def time_remaining(self) -> float | None:
        """Seconds left before the client's deadline, or None if it set none."""


class Method(NamedTuple):
    """A served method: `handler(request_bytes, call)` returns the answer's bytes (unary) or is an
    async iterator of answers (`streaming`, server streaming)."""

    handler: Callable[[bytes, CallContext], Awaitable[bytes] | AsyncIterator[bytes]]
    streaming: bool = False


class CallHead(NamedTuple):
    """What a request's headers ask of gRPC (worked out once per distinct header block)."""

    path: str
    """The method, `/package.Service/Method`, as UTF-8."""
    problem: tuple[int, str] | None
    """(HTTP status, message) for a request that is not gRPC at all: it gets a plain HTTP answer."""
    encoding: bytes
    timeout_s: float | None
    authorization: bytes | None


def call_head(head: RequestHead) -> CallHead:
    """The gRPC reading of a validated request head, kept on the head (`head.memo`)."""
    known = head.memo
    if known is not None:
        return known
    content_type = head.get(b"content-type", b"")
    problem = None
    if head.method != b"POST":
        problem = (405, "this port speaks gRPC: HTTP/2 POST requests with content-type application/grpc; "
                        "the REST API is on the server's HTTP port")
    elif not content_type.startswith(b"application/grpc"):
        problem = (415, "this port speaks gRPC: requests need content-type application/grpc")
    timeout = head.get(b"grpc-timeout")
    known = head.memo = CallHead(head.path.decode("utf-8", "replace"), problem, head.get(b"grpc-encoding", b""),
                                 parse_timeout(timeout) if timeout else None, head.get(b"authorization"))
    return known


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout: up to 8 digits and a unit (H M S m u n); None if malformed."""
    units = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in units:
        return None
    return int(digits) * units[unit]


def message(reply: bytes) -> bytes:
    """One length-prefixed, uncompressed message."""
    return _PREFIX.pack(0, len(reply)) + reply


def _percent_encode(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII but '%' as is, every other byte %XX; at most
    MAX_STATUS_MESSAGE bytes of it."""
    out = bytearray()
    for byte in text.encode("utf-8"):
        piece = byte if 0x20 <= byte <= 0x7E and byte != 0x25 else None
        if len(out) + (1 if piece is not None else 3) > MAX_STATUS_MESSAGE:
            break
        if piece is not None:
            out.append(piece)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


_STATUS = {code: (b"grpc-status", str(code.value).encode()) for code in Code}


def status_fields(code: Code, text: str) -> tuple[tuple[bytes, bytes], ...]:
    """Trailers (or the tail of a trailers-only answer) for a status."""
    if code == Code.OK and not text:
        return OK_TRAILERS
    return (_STATUS[code], (b"grpc-message", _percent_encode(text))) if text else (_STATUS[code],)


_DECOMPRESSORS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
"""grpc-encoding -> zlib's wbits for it (what grpcio sends with `compression=grpc.Compression.Gzip`)."""


def request_message(body: bytes, encoding: bytes, limit: int) -> bytes:
    """A unary call's one request message, decompressed (to at most `limit` bytes); RpcError if
    the body is not exactly one message or cannot be read."""
    if len(body) < 5:
        raise RpcError(Code.INTERNAL, "a unary call needs exactly one request message; none arrived")
    if int.from_bytes(body[1:5], "big") != len(body) - 5:
        raise RpcError(Code.INTERNAL, "a unary call needs exactly one request message; the length prefix does not match")
    if body[0] == 0:
        return body[5:]
    if body[0] != 1:
        raise RpcError(Code.INTERNAL, f"unknown message flag {body[0]}")
    if encoding in (b"", b"identity"):
        raise RpcError(Code.INTERNAL, "a compressed message without grpc-encoding")
    wbits = _DECOMPRESSORS.get(encoding)
    name = echo(encoding.decode("latin-1"))
    if wbits is None:
        raise RpcError(Code.UNIMPLEMENTED, f"grpc-encoding {name!r} is not supported: "
                                           "send gzip, deflate or uncompressed messages")
    inflater = zlib.decompressobj(wbits)
    try:
        inflated = inflater.decompress(body[5:], limit + 1)  # never more than the limit, whatever the ratio
    except zlib.error:
        raise RpcError(Code.INTERNAL, f"the request message is not valid {name} data") from None
    if len(inflated) > limit:
        raise RpcError(Code.RESOURCE_EXHAUSTED, f"request message larger than the limit of {limit} bytes "
                                                "once decompressed (--max-body-bytes)")
    if not inflater.eof:
        raise RpcError(Code.INTERNAL, f"the request message is truncated {name} data")
    return inflated


__all__ = ["CallContext", "CallHead", "Method", "OK_TRAILERS", "RESPONSE_HEADERS", "RpcError", "call_head", "echo", "message",
           "parse_timeout", "request_message", "status_fields"]
