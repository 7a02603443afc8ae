"""One HTTP/1.1 connection of the REST port: httptools parses, this protocol guards and answers.

The server's own protocol (no ASGI server underneath): a request goes from the parser's callbacks
straight to the app (`serve.http.routing.App`) and its answer is written in one piece (status line,
pre-encoded headers and body in one write). What it guards against, for a server facing hostile
clients and load balancers:
- a new connection that never sends anything gets the keep-alive timeout; a request's headers must
  arrive within `header_timeout_s` (slowloris) and its body within `body_timeout_s`, else 408;
- headers past `max_header_bytes` or `MAX_HEADERS` are a 431; a Content-Length (or a chunked body)
  past `max_body_bytes` is a 413 before the rest is read;
- past `max_connections` open connections a new one gets an immediate 503 with Retry-After
  (after closing one that has waited longest without a request, if any waited EVICT_AFTER_S);
- parser errors (garbage request line, bad Content-Length, bad chunking) are answered as JSON
  `{"error": ...}`, like every other error of this server;
- every early answer ends with a lingering close (FIN after the response, then read and discard
  until the client closes) so the client reads the answer instead of a connection reset;
- pipelined requests are answered in order, one at a time (reading pauses while one waits);
- on drain (SIGTERM), every answer carries `Connection: close`, and a keep-alive connection is
  closed by the server only once it has been idle for DRAIN_IDLE_S: a client that sends its next
  request right after an answer gets it answered (with `Connection: close`) instead of a closed socket.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import socket
import time
from typing import Protocol

import httptools

from serve.host import ConnectionHost
from serve.http.routing import RETRY_AFTER_S, App, Request, Response, error_body

log = logging.getLogger(__name__)

LINGER_S = 2.0
"""How long a refused connection is read (and discarded) after its answer before it is closed."""
DRAIN_IDLE_S = 1.0
"""On drain, how long a keep-alive connection may stay idle before the server closes it. Closing a
connection whose client is sending at that moment loses the request (the client sees a reset): a
client that keeps sending sends well within this, one that stopped is not sending now."""
MAX_HEADERS = 256
MAX_PIPELINED = 16
"""Complete requests a connection may have waiting behind the one being answered; past this it is
not read until the queue shrinks."""

STATUS_LINES = {int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_IDLE, _HEADERS, _BODY, _WAITING = range(4)
_CLOSE, _KEEP_ALIVE, _KEEP_ALIVE_10 = range(3)
"""How an answer ends: the connection closes, or stays open (HTTP/1.0 asks for it to be said)."""
_ENDINGS = (b"connection: close\r\n\r\n", b"\r\n", b"connection: keep-alive\r\n\r\n")


class DateHeader(Protocol):
    header: bytes
    """`date: ...\\r\\n` for the answers (RFC 9110 asks an origin server for it), kept current by the port."""


class HttpConnection(asyncio.Protocol):
    """One client connection; made by the port (`serve.http.server.RestServer`) for each accepted socket."""

    def __init__(self, host: ConnectionHost, app: App, date: DateHeader) -> None:
        self.host = host
        self.app = app
        self.date = date
        self.limits = host.limits
        self.loop = host.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self._state = _IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._timer_state = _IDLE
        """The state `_timer` guards: it fires only if the connection is still in it."""
        self._refused = False
        self._closed = False
        self._header_bytes = 0
        """Bytes received since the current request began, while its headers are incomplete."""
        self._too_many_headers = False
        self._uri_too_long = False
        self._last_keep_alive = True
        """Whether the last request whose headers were read lets the connection go on."""
        self._discarding = False
        """Bytes after a request that closes the connection are not read (its answer still goes out)."""
        self._header_count = 0
        self._header_size = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._content_length: int | None = None
        self._chunked = False
        self._codings: bytes | None = None
        """A Transfer-Encoding other than chunked alone (answered 501)."""
        self._hosts = 0
        self._receiving: Request | None = None
        """The request whose body the parser is reading."""
        self._current: Request | None = None
        """The request being answered (its handler runs, or its answer waits for its body to end)."""
        self._current_mode = _KEEP_ALIVE
        self._current_done = False
        self._pipeline: collections.deque[tuple[Request, int]] = collections.deque()
        """Requests waiting behind the current one, each with how its answer ends (`_answer_mode`)."""
        self._write_paused = False
        self._write_paused_at = 0.0
        self._shed = False
        """Set by the port to move this connection to another worker: its next answer closes it."""

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
        host, limits = self.host, self.limits
        if not host.admit(self):
            self._refuse(503, f"server busy: {host.open} connections open (limit {limits.max_connections}); "
                              "retry later", retry=True)
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # an answer is one write: send it now
        self._arm(_IDLE, limits.idle_timeout_s)  # the first request must begin in time

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.host.lost(self)
        self._disarm()
        for request in (self._receiving, self._current):
            if request is not None:
                request.disconnect()
        self._pipeline.clear()

    def eof_received(self) -> bool | None:
        return None  # close our side too (after a refusal: the client has read the answer)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._write_paused_at = self.loop.time()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._current is None and self._pipeline:
            self._start_next()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._discarding:
            return  # lingering close: read and discard
        if self._timer is not None and self._timer_state == _IDLE:
            self._disarm()
        if self._state in (_IDLE, _HEADERS):
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no WebSocket here: the request was answered as plain HTTP
        except httptools.HttpParserError as exc:
            if self._refused:
                return
            if not self._last_keep_alive and self._state in (_IDLE, _WAITING):
                self._discarding = True  # more after `Connection: close` (or HTTP/1.0): answer, then close
                return
            if self._uri_too_long:
                self._refuse(414, f"request target longer than the limit of {self.limits.max_header_bytes} bytes")
            elif self._too_many_headers:
                if self._header_count > MAX_HEADERS:
                    self._refuse(431, f"more than {MAX_HEADERS} request headers")
                else:
                    self._refuse(431, f"request headers larger than the limit of {self.limits.max_header_bytes} bytes")
            else:
                reason = str(exc).strip().rstrip(".") or "unparseable request"
                self._refuse(400, f"malformed HTTP request: {reason}")
            return
        if self._refused:
            return
        state = self._state
        if state == _HEADERS:
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request headers larger than the limit of {self.limits.max_header_bytes} bytes")
            elif self._timer is None:  # armed only when a request spans several reads
                self._arm(_HEADERS, self.limits.header_timeout_s)
        elif state == _BODY and self._timer is None:
            self._arm(_BODY, self.limits.body_timeout_s)

    # -- parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._state = _HEADERS
        self._url = b""
        self._headers = []
        self._header_count = 0
        self._header_size = 0
        self._content_length = None
        self._chunked = False
        self._codings = None
        self._hosts = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_size += len(url)
        if self._header_size > self.limits.max_header_bytes:
            self._uri_too_long = True
            raise ValueError("request target too long")  # stops the parser; data_received answers 414

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_size += len(name) + len(value) + 4
        if self._header_count > MAX_HEADERS or self._header_size > self.limits.max_header_bytes:
            self._too_many_headers = True
            raise ValueError("headers too large")  # stops the parser; data_received answers 431
        name = name.lower()
        if name == b"content-length":
            self._content_length = int(value) if value.isdigit() else None
        elif name == b"transfer-encoding":
            codings = value.lower()
            self._chunked = b"chunked" in codings
            if codings.strip() != b"chunked":
                self._codings = value
        elif name == b"host":
            self._hosts += 1
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._timer is not None:
            self._disarm()
        self._header_bytes = 0
        limits = self.limits
        length = self._content_length
        if length is not None and length > limits.max_body_bytes:
            self._refuse(413, f"request body larger than the limit of {limits.max_body_bytes} bytes")
            raise ValueError("body too large")  # stops the parser
        http10 = self.parser.get_http_version() == "1.0"
        if self._hosts > 1 or (self._hosts == 0 and not http10):
            self._refuse(400, "a request needs exactly one Host header (RFC 9112 3.2)")
            raise ValueError("bad Host")
        if self._codings is not None:
            self._refuse(501, f"Transfer-Encoding {self._codings.decode('latin-1')!r} is not implemented: send the "
                              "body with Content-Length or Transfer-Encoding: chunked alone")
            raise ValueError("unknown coding")
        self.host.received += 1
        self.host.set_busy(self)
        raw_path, query = _split_target(self._url)
        request = Request(self.parser.get_method().decode("ascii"), raw_path, self._headers,
                          max_body=limits.max_body_bytes, query=query, client=self.client)
        keep_alive = self.parser.should_keep_alive()
        self._last_keep_alive = keep_alive
        mode = (_KEEP_ALIVE_10 if http10 else _KEEP_ALIVE) if keep_alive else _CLOSE
        has_body = self._chunked or bool(length)
        if has_body:
            self._receiving = request
            self._state = _BODY
            if not http10 and request.header(b"expect") == "100-continue":
                request._on_wait = self._send_continue
        else:
            request.finish()
            self._state = _WAITING
        if self._current is None:
            self._start(request, mode)
        else:
            self._pipeline.append((request, mode))
            if len(self._pipeline) >= MAX_PIPELINED:
                self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        request = self._receiving
        if request is None or self._refused:
            return
        request.feed(body)
        if self._chunked and request.received > self.limits.max_body_bytes:
            self._refuse(413, f"request body larger than the limit of {self.limits.max_body_bytes} bytes")
            raise ValueError("body too large")

    def on_message_complete(self) -> None:
        if self._refused:
            return
        if self._timer is not None:
            self._disarm()
        request = self._receiving
        self._receiving = None
        self._state = _WAITING if self._current is not None or self._pipeline else _IDLE
        if request is not None:
            request.finish()
            if self._current is request and self._current_done:
                self._finish_current()  # answered before its body ended (a 404, a 413)

    # -- answering -------------------------------------------------------------------------------

    def _start(self, request: Request, mode: int) -> None:
        self._current = request
        self._current_mode = mode
        self._current_done = False
        task = self.loop.create_task(self._answer(request, time.perf_counter()))
        self.host.track(task)

    def _start_next(self) -> None:
        request, mode = self._pipeline.popleft()
        if len(self._pipeline) < MAX_PIPELINED and not self._closed:
            self.transport.resume_reading()
        self._start(request, mode)

    async def _answer(self, request: Request, start: float) -> None:
        response = await self.app(request)
        if response is None or self._closed or self._refused:
            return
        mode = _CLOSE if self.host.draining or self._shed else self._current_mode
        self._write(response, request.head, mode)
        self.host.answered += 1
        self.app.answered(request, response.status, time.perf_counter() - start)
        if mode == _CLOSE:
            self._close_after_answer()
            return
        self._current_done = True
        if self._receiving is not request:  # its body has ended: the connection is free
            self._finish_current()

    def _write(self, response: Response, head_only: bool, mode: int) -> None:
        body = response.body
        parts = [STATUS_LINES.get(response.status) or f"HTTP/1.1 {response.status} \r\n".encode(),
                 self.date.header, b"content-type: ", response.content_type, b"\r\ncontent-length: ",
                 str(len(body)).encode(), b"\r\n"]
        for name, value in response.headers:
            parts += [name, b": ", value, b"\r\n"]
        parts.append(_ENDINGS[mode])
        if not head_only:
            parts.append(body)
        self.transport.write(b"".join(parts))

    def _finish_current(self) -> None:
        self._current = None
        self._current_done = False
        if self._pipeline:
            if not self._write_paused:
                self._start_next()
            return
        if self._state in (_WAITING, _IDLE) and self._receiving is None:
            self._state = _IDLE
            self.host.set_idle(self)
            self._arm(_IDLE, self.limits.idle_timeout_s)

    def _close_after_answer(self) -> None:
        if not self._discarding:
            self.transport.close()
            return
        # Unread bytes wait in the socket: closing it now would reset the connection and could
        # take the answer with it. Our side ends; what comes is discarded until the client closes.
        self._release()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _send_continue(self) -> None:
        if not self._closed and not self._refused:
            self.transport.write(CONTINUE)

    # -- what the port asks (serve.host.Hosted) --------------------------------------------------

    def evict(self) -> None:
        """Make room at the connection limit (the host picks the connection idle longest, at least
        EVICT_AFTER_S): one still sending its headers gets a 408, an idle one is closed."""
        if self._state == _HEADERS:
            self._refuse(408, "request headers not received in time (the server needed the connection)")
        else:
            self.transport.close()

    def _release(self) -> None:
        """Stop counting this connection against the limit (it is being closed)."""
        self.host.release(self)

    def drain(self) -> None:
        """Nothing to do at once: every answer from now on carries Connection: close (`host.draining`)."""

    def tick(self, now: float) -> None:
        """A client that leaves an answer unread for send_timeout_s is cut off."""
        if self._write_paused and now - self._write_paused_at > self.limits.send_timeout_s:
            self.host.report("send_timeout")
            self.host.warn("send_timeout", "%s: answer not read for %gs (--send-timeout): closed",
                           "%s:%d" % self.client if self.client else "client", self.limits.send_timeout_s)
            self.transport.abort()

    def shed(self) -> None:
        self._shed = True  # the next answer carries Connection: close

    def abort(self) -> None:
        self.transport.abort()

    # -- timers ----------------------------------------------------------------------------------

    def _arm(self, state: int, delay: float) -> None:
        self._disarm()
        self._timer_state = state
        self._timer = self.loop.call_later(delay, self._on_timeout, state)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timeout(self, state: int) -> None:
        self._timer = None
        if self._state != state or self._refused or self.transport.is_closing():
            return
        if state == _IDLE:
            self.transport.close()  # a connection that never sent a request, or an idle keep-alive one
        elif state == _HEADERS:
            self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g}s")
        elif state == _BODY:
            self._refuse(408, f"request body not received within {self.limits.body_timeout_s:g}s")

    # -- early answers and drain -----------------------------------------------------------------

    def _refuse(self, status: int, message: str, retry: bool = False) -> None:
        """Answer `status` with a JSON error now, then close gracefully (lingering close); the
        answer of a request in progress, if any, is dropped."""
        self._refused = True
        self._disarm()
        self._release()  # a lingering connection does not count against the limit
        for request in (self._receiving, self._current):
            if request is not None:
                request.disconnect()
        self._pipeline.clear()
        if self.transport.is_closing():
            return
        body = error_body(message)
        head = [STATUS_LINES[status], self.date.header,
                b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        if retry:
            head += [b"retry-after: ", str(RETRY_AFTER_S).encode(), b"\r\n"]
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)
        if status != 503:
            log.info("%s: %d %s", "%s:%d" % self.client if self.client else "client", status, message)

    def close_if_idle(self, now: float) -> None:
        """Close this connection if it has waited DRAIN_IDLE_S for a request that has not begun."""
        since = self.host.idle.get(self)
        if (since is not None and now - since >= DRAIN_IDLE_S and self._state == _IDLE and self._current is None
                and not self._refused and not self.transport.is_closing()):
            self.transport.close()


def _split_target(url: bytes) -> tuple[str, bytes]:
    """(raw path, query) of a request target; an absolute URL (`http://host/path`) keeps its path."""
    if url[:1] != b"/":
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            return url.decode("latin-1"), b""
        return (parsed.path or b"/").decode("latin-1"), parsed.query or b""
    path, _, query = url.partition(b"?")
    path = path.partition(b"#")[0]
    return path.decode("latin-1"), query


__all__ = ["DateHeader", "HttpConnection", "STATUS_LINES"]
