"""The REST port's application: one routing table, JSON errors, metrics, CORS, access log.

Deliberately framework-free, and not ASGI: on this server's hot path every microsecond per request
counts, so the connection (`serve.http.connection`) hands the app a `Request` and writes the
`Response` it returns in one piece, with no message dicts in between. Handlers take a `Request` and
return a `Response`; they raise `ServingError`s (mapped to HTTP with TF Serving's table, `http_server.cc:
ToHTTPStatusCode`) or `HttpError`s (HTTP-only conditions: 404 route, 405, 413).
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
import zlib
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence

import orjson

from serve.core import memory
from serve.core.auth import Authorizer
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
    if exc.code is Code.UNAUTHENTICATED:
        headers.append((b"www-authenticate", b'Bearer realm="sentiment-dtensor"'))
    return Response(error_body(exc.message), HTTP_STATUS.get(exc.code, 500), JSON, headers)


class Request:
    """One HTTP request: what its head said, and its body as the connection receives it.

    The connection (`serve.http.connection`) makes one when a request's headers are complete and
    hands it to the app at once; the body keeps arriving (`feed`, `finish`) while the handler runs,
    and `await body()` waits for the rest. A request whose body came with its headers (nearly all
    of them) never waits.
    """

    __slots__ = ("method", "head", "path", "raw_path", "query", "headers", "client", "match", "route_label", "max_body",
                 "body_size", "_body", "_complete", "_gone", "_waiter", "_on_wait")

    def __init__(self, method: str, raw_path: str, headers: list[tuple[bytes, bytes]], *, max_body: int,
                 query: bytes = b"", client: tuple[str, int] | None = None) -> None:
        self.head = method == "HEAD"
        """HEAD is answered as GET, without the body."""
        self.method = "GET" if self.head else method
        self.raw_path = raw_path
        """The path as sent (still URL-encoded): TF Serving matches model names on it."""
        self.path = urllib.parse.unquote(raw_path) if "%" in raw_path else raw_path
        self.query = query
        self.headers = headers
        """(lower-case name, value) pairs, in the order sent."""
        self.client = client
        self.match: re.Match | None = None
        self.route_label = "other"
        self.max_body = max_body
        self.body_size = 0
        """Bytes of body read (inflated size for gzip): large requests are followed by a memory trim."""
        self._body: bytes | bytearray = b""
        """The body so far: the first chunk as it came (nearly always the only one), later ones
        appended in place (a body sent in many tiny chunks costs no object per chunk)."""
        self._complete = False
        self._gone = False
        self._waiter: asyncio.Future | None = None
        self._on_wait: Callable[[], None] | None = None
        """Called the first time a handler waits for body bytes (the connection sends 100 Continue)."""

    def header(self, name: bytes) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None

    # -- the connection's side -----------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        if not self._body:
            self._body = chunk
        elif chunk:
            if not isinstance(self._body, bytearray):
                self._body = bytearray(self._body)
            self._body += chunk

    @property
    def received(self) -> int:
        """Body bytes received so far."""
        return len(self._body)

    def finish(self) -> None:
        """The whole body has arrived."""
        self._complete = True
        self._wake()

    def disconnect(self) -> None:
        """The client went away: a handler waiting for the body gets ClientGone."""
        self._gone = True
        self._body = b""
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the handler's side --------------------------------------------------------------------

    async def body(self) -> bytes:
        """The whole body (gzip inflated, as TF Serving does); 413 past `max_body` bytes."""
        if not self._complete:
            if self._gone:
                raise ClientGone
            if self._on_wait is not None:
                self._on_wait()
                self._on_wait = None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            if not self._complete or self._gone:
                raise ClientGone
        data = self._body if isinstance(self._body, bytes) else bytes(self._body)
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
    scope: str = "api"
    """Who may call it with --auth-token-file: `api` (a token), `metrics` (a token unless
    --metrics-open) or `open` (probes and the page's own files: anyone)."""

    @classmethod
    def of(cls, name: str, methods: str, pattern: str, handler: Handler, raw: bool = False,
           scope: str = "api") -> "Route":
        return cls(name, frozenset(methods.split()), re.compile(pattern), handler, raw, scope)


class App:
    """Route a request, run its handler, map its errors to HTTP, add CORS headers; count and log
    each answer once the connection has sent it."""

    def __init__(self, routes: Sequence[Route], *, metrics, max_body_bytes: int,
                 cors_origins: Sequence[str] = (), access_log_enabled: bool = False,
                 authorizer: Authorizer | None = None) -> None:
        self.routes = list(routes)
        self.auth = authorizer if authorizer is not None and authorizer.enabled else None
        self.open_scopes = {"open", "metrics"} if authorizer is not None and authorizer.metrics_open else {"open"}
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.cors_origins = tuple(cors_origins)
        self.access_log = access_log_enabled

    async def __call__(self, request: Request) -> Response | None:
        """The answer to `request`; None when there is nobody to answer (the client left before its
        body arrived, or the server abandoned the request at shutdown)."""
        metrics = self.metrics
        metrics.in_flight += 1
        try:
            response = await self._respond(request)
        except (ClientGone, asyncio.CancelledError):
            return None
        finally:
            metrics.in_flight -= 1
        if self.cors_origins:
            self._add_cors(request, response)
        return response

    def answered(self, request: Request, status: int, elapsed_s: float) -> None:
        """After the answer was written: metrics, a memory trim after a large body, the access log."""
        self.metrics.observe_request(request.route_label, str(status), elapsed_s)
        memory.after_request(request.body_size)
        if self.access_log:
            client = request.client or ("-", 0)
            target = request.raw_path + ("?" + request.query.decode("latin-1") if request.query else "")
            method = "HEAD" if request.head else request.method
            access_log.info('%s "%s %s" %d %.1fms', client[0], method, target, status, elapsed_s * 1e3)

    async def _respond(self, request: Request) -> Response:
        try:
            route = self._route(request)
            request.route_label = route.name
            if self.auth is not None and route.scope not in self.open_scopes:
                self.auth.check(request.header(b"authorization"))
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
        raise HttpError(404, f"Not Found: no route for {'HEAD' if request.head else method} {request.path}")

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


_PREFLIGHT = Route.of("preflight", "OPTIONS", "", _preflight, scope="open")
