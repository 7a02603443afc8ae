"""A small ASGI application: one routing table, JSON errors, metrics, CORS, access log.

Deliberately framework-free: on this server's hot path every microsecond per request counts (a
bare ASGI app under uvicorn answered about 2.5x the requests of Starlette on the same machine,
measured 2026-12-02 with a route that parses a JSON body). Handlers take a `Request` and return a
`Response`; they raise `ServingError`s (mapped to HTTP with TF Serving's table, `http_server.cc:
ToHTTPStatusCode`) or `HttpError`s (HTTP-only conditions: 404 route, 405, 413).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence

import orjson

from serve.core import memory
from serve.core.errors import Code, ServingError

log = logging.getLogger(__name__)
access_log = logging.getLogger("serve.access")

JSON = b"application/json"

HTTP_STATUS = {
    Code.OK: 200, Code.CANCELLED: 499, Code.UNKNOWN: 500, Code.INVALID_ARGUMENT: 400,
    Code.DEADLINE_EXCEEDED: 504, Code.NOT_FOUND: 404, Code.ALREADY_EXISTS: 409,
    Code.PERMISSION_DENIED: 403, Code.RESOURCE_EXHAUSTED: 429, Code.FAILED_PRECONDITION: 400,
    Code.ABORTED: 409, Code.OUT_OF_RANGE: 400, Code.UNIMPLEMENTED: 501, Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503, Code.DATA_LOSS: 500, Code.UNAUTHENTICATED: 401,
}
"""Neutral status -> HTTP status, exactly TF Serving's ToHTTPStatusCode."""

RETRY_AFTER_S = 1


class HttpError(Exception):
    """An HTTP-level refusal that has no gRPC counterpart (unknown route, wrong method, body too large)."""

    def __init__(self, status: int, message: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)


class ClientGone(Exception):
    """The client disconnected before its request body arrived; nobody is left to answer."""


@dataclass(slots=True)
class Response:
    body: bytes
    status: int = 200
    content_type: bytes = JSON
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def dumps(obj: Any) -> bytes:
    """Compact JSON; numpy arrays and scalars are written directly (float32 in its shortest form)."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def json_response(obj: Any, status: int = 200, headers: Iterable[tuple[bytes, bytes]] = ()) -> Response:
    return Response(dumps(obj), status, JSON, list(headers))


def error_body(message: str) -> bytes:
    return dumps({"error": message})


def error_response(exc: ServingError) -> Response:
    headers = [(b"retry-after", str(RETRY_AFTER_S).encode())] if exc.retryable else []
    return Response(error_body(exc.message), HTTP_STATUS.get(exc.code, 500), JSON, headers)


class Request:
    """One HTTP request: method, path, headers from the ASGI scope; the body read on demand."""

    __slots__ = ("scope", "_receive", "method", "path", "raw_path", "match", "route_label", "max_body", "body_size")

    def __init__(self, scope: dict, receive: Callable[[], Awaitable[dict]], max_body: int) -> None:
        self.scope = scope
        self._receive = receive
        method = scope["method"]
        self.method = "GET" if method == "HEAD" else method
        self.path: str = scope["path"]
        raw = scope.get("raw_path")
        self.raw_path: str = raw.decode("latin-1") if raw else self.path
        self.match: re.Match | None = None
        self.route_label = "other"
        self.max_body = max_body
        self.body_size = 0
        """Bytes of body read (inflated size for gzip): large requests are followed by a memory trim."""

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return value.decode("latin-1")
        return None

    async def body(self) -> bytes:
        """The whole body (gzip inflated, as TF Serving does); 413 past `max_body` bytes."""
        message = await self._receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        data = message.get("body", b"")
        if message.get("more_body", False):
            chunks, size = [data], len(data)
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body:
                    raise self._too_large()
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            data = b"".join(chunks)
        self.body_size = len(data)
        if len(data) > self.max_body:
            raise self._too_large()
        encoding = self.header(b"content-encoding")
        if encoding and encoding.strip().lower() == "gzip":
            data = self._gunzip(data)
            self.body_size = max(self.body_size, len(data))
        return data

    def _too_large(self) -> HttpError:
        return HttpError(413, f"request body larger than the limit of {self.max_body} bytes",
                         [(b"connection", b"close")])

    def _gunzip(self, data: bytes) -> bytes:
        """Every gzip member (RFC 1952 allows several), up to `max_body` bytes in all; a truncated
        stream or bytes after the last member are a 400, never silently dropped."""
        out, rest = [], data
        size = 0
        while True:
            inflater = zlib.decompressobj(zlib.MAX_WBITS | 16)
            try:
                chunk = inflater.decompress(rest, self.max_body + 1 - size)
            except zlib.error:
                raise HttpError(400, "request body is not valid gzip (Content-Encoding: gzip)") from None
            size += len(chunk)
            if size > self.max_body or inflater.unconsumed_tail:
                raise self._too_large()
            if not inflater.eof:
                raise HttpError(400, "request body is truncated gzip (Content-Encoding: gzip): the stream ends early")
            out.append(chunk)
            rest = inflater.unused_data
            if not rest:
                return b"".join(out)


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    name: str
    """Label in metrics and access logs."""
    methods: frozenset[str]
    pattern: re.Pattern
    handler: Handler
    raw: bool = False
    """Match the raw (still URL-encoded) path, as TF Serving does for model names."""

    @classmethod
    def of(cls, name: str, methods: str, pattern: str, handler: Handler, raw: bool = False) -> "Route":
        return cls(name, frozenset(methods.split()), re.compile(pattern), handler, raw)


class App:
    """The ASGI callable: route, run the handler, map errors, count, log, add CORS headers."""

    def __init__(self, routes: Sequence[Route], *, metrics, max_body_bytes: int,
                 cors_origins: Sequence[str] = (), access_log_enabled: bool = False) -> None:
        self.routes = list(routes)
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.cors_origins = tuple(cors_origins)
        self.access_log = access_log_enabled

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":  # uvicorn runs with lifespan off; answer politely anyway
                message = await receive()
                await send({"type": message["type"] + ".complete"})
            return
        start = time.perf_counter()
        request = Request(scope, receive, self.max_body_bytes)
        metrics = self.metrics
        metrics.in_flight += 1
        try:
            response = await self._respond(request)
        except (ClientGone, asyncio.CancelledError):  # nobody to answer, or abandoned at shutdown
            response = None
        finally:
            metrics.in_flight -= 1
        if response is None:
            return
        if self.cors_origins:
            self._add_cors(request, response)
        headers = [(b"content-type", response.content_type), (b"content-length", str(len(response.body)).encode())]
        headers += response.headers
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})
        elapsed = time.perf_counter() - start
        metrics.observe_request(request.route_label, str(response.status), elapsed)
        memory.after_request(request.body_size)
        if self.access_log:
            client = scope.get("client") or ("-", 0)
            query = scope.get("query_string") or b""
            target = request.raw_path + ("?" + query.decode("latin-1") if query else "")
            access_log.info('%s "%s %s" %d %.1fms', client[0], scope["method"], target, response.status, elapsed * 1e3)

    async def _respond(self, request: Request) -> Response:
        try:
            route = self._route(request)
            request.route_label = route.name
            return await route.handler(request)
        except ServingError as exc:
            return error_response(exc)
        except HttpError as exc:
            return Response(error_body(exc.message), exc.status, JSON, exc.headers)
        except ClientGone:
            raise
        except Exception:  # noqa: BLE001 - a bug: log it here, never send a traceback
            log.exception("unhandled error in %s %s", request.method, request.path)
            return Response(error_body("internal error"), 500)

    def _route(self, request: Request) -> Route:
        allowed: set[str] = set()
        method = request.method
        for route in self.routes:
            match = route.pattern.fullmatch(request.raw_path if route.raw else request.path)
            if match is None:
                continue
            if method in route.methods:
                request.match = match
                return route
            allowed |= route.methods
        if method == "OPTIONS" and allowed and self.cors_origins:
            return _PREFLIGHT
        if allowed:
            methods = sorted(allowed | ({"HEAD"} if "GET" in allowed else set()))
            raise HttpError(405, f"Method Not Allowed: {request.method} {request.path} (allowed: {', '.join(methods)})",
                            [(b"allow", ", ".join(methods).encode())])
        raise HttpError(404, f"Not Found: no route for {request.scope['method']} {request.path}")

    def _add_cors(self, request: Request, response: Response) -> None:
        origin = request.header(b"origin")
        if not origin:
            return
        if "*" in self.cors_origins:
            response.headers.append((b"access-control-allow-origin", b"*"))
        elif origin in self.cors_origins:
            response.headers += [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        else:
            return
        if request.method == "OPTIONS":
            asked = request.header(b"access-control-request-headers") or "Content-Type"
            response.headers += [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", asked.encode("latin-1")),
                (b"access-control-max-age", b"600"),
            ]
        response.headers.append((b"access-control-expose-headers", b"X-Model-Version"))


async def _preflight(_request: Request) -> Response:
    return Response(b"", 200, b"text/plain")


_PREFLIGHT = Route.of("preflight", "OPTIONS", "", _preflight)
