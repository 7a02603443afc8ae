"""uvicorn's httptools protocol, hardened for a server facing hostile clients and load balancers.

What uvicorn (0.55) leaves open, and what this subclass adds:
- a new connection that never sends anything stays open forever: it now gets the keep-alive
  timeout; a request's headers must arrive within `header_timeout_s` (slowloris) and its body
  within `body_timeout_s`, else 408;
- no bound on header size: past `max_header_bytes` the answer is 431;
- a too-large Content-Length is refused with 413 before the body is read;
- past `max_connections` open connections a new one gets an immediate 503 with Retry-After
  instead of waiting unserved (uvicorn's `limit_concurrency` answers only after reading a request);
- parser errors (garbage request line, bad Content-Length, bad chunking) are answered as JSON
  `{"error": ...}`, like every other error of this server, not text/plain;
- every early answer ends with a lingering close (FIN after the response, then read and discard
  until the client closes) so the client reads the answer instead of a connection reset;
- on drain (SIGTERM), every answer carries `Connection: close`, and a keep-alive connection is closed
  by the server only once it has been idle for DRAIN_IDLE_S: a client that sends its next request
  right after an answer gets it answered (with `Connection: close`) instead of a closed socket.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from typing import Callable

import httptools

from serve.http.asgi import RETRY_AFTER_S, error_body
from serve.http.uvicorn_internals import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger(__name__)

LINGER_S = 2.0
"""How long a refused connection is read (and discarded) after its answer before it is closed."""
DRAIN_IDLE_S = 1.0
"""On drain, how long a keep-alive connection may stay idle before the server closes it. Closing a
connection whose client is sending at that moment loses the request (the client sees a reset): a
client that keeps sending sends well within this, one that stopped is not sending now."""
MAX_HEADERS = 256
EVICT_AFTER_S = 1.0
"""At the connection limit, a connection waiting this long without a complete request (an idle
keep-alive one, or a slow client still sending headers) is closed to make room for a new one."""

_IDLE, _HEADERS, _BODY, _WAITING = range(4)


@dataclass
class ConnectionLimits:
    """Limits and counters shared by every connection of one server (one worker process)."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    max_header_bytes: int
    max_body_bytes: int
    open: int = 0
    """Accepted connections now open (refused ones are not counted)."""
    waiting: dict = field(default_factory=dict)
    """Open connections without a request in progress (idle keep-alive, or headers still coming),
    oldest first, with the loop time they started waiting: who makes room for a new connection."""
    received: int = 0
    """Requests whose headers were read and handed to the application."""
    refused: int = 0
    draining: bool = False
    on_open_change: Callable[[], None] | None = None
    """Called after `open` changed (the worker's AcceptGate tells the sibling workers)."""

    def count(self, delta: int) -> None:
        self.open += delta
        if self.on_open_change is not None:
            self.on_open_change()


def protocol_class(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """A protocol class bound to `limits`, for `uvicorn.Config(http=...)`."""
    return type("SentimentHttpProtocol", (HardenedHttpProtocol,), {"limits": limits})


class HardenedHttpProtocol(HttpToolsProtocol):
    limits: ConnectionLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = _IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._timer_state = _IDLE
        """The state `_timer` guards: it fires only if the connection is still in it."""
        self._header_bytes = 0
        self._header_count = 0
        self._counted = False
        self._refused = False
        self._too_many_headers = False
        self._header_size = 0

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        if limits.open >= limits.max_connections:
            self._evict_a_waiting_connection()
        if limits.open >= limits.max_connections:
            limits.refused += 1
            self._refuse(503, f"server busy: {limits.open} connections open (limit {limits.max_connections}); "
                              "retry later", retry=True)
            return
        limits.count(+1)
        self._counted = True
        limits.waiting[self] = self.loop.time()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # uvicorn writes a response's head and body separately: without this, Nagle's algorithm
            # holds the body until the client ACKs the head (a delayed ACK: milliseconds per request).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm(_IDLE, limits.keepalive_timeout_s)  # the first request must begin in time

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self.limits.count(-1)
            self._counted = False
        self.limits.waiting.pop(self, None)
        self._disarm()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        return None  # close our side too (after a refusal: the client has read the answer)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering close: read and discard
        self._unset_keepalive_if_required()
        if self._timer is not None and self._timer_state == _IDLE:
            self._disarm()
        if self._state in (_IDLE, _HEADERS):
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no WebSocket here: the request was answered as plain HTTP
        except httptools.HttpParserError as exc:
            if self._too_many_headers:
                if self._header_count > MAX_HEADERS:
                    self._refuse(431, f"more than {MAX_HEADERS} request headers")
                else:
                    self._refuse(431, f"request headers larger than the limit of {self.limits.max_header_bytes} bytes")
            elif not self._refused:
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

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"malformed HTTP request: {msg.rstrip('.')}")

    # -- parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._state = _HEADERS
        self._header_count = 0
        self._header_size = 0

    def on_url(self, url: bytes) -> None:
        self._header_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_size += len(name) + len(value) + 4
        if self._header_count > MAX_HEADERS or self._header_size > self.limits.max_header_bytes:
            self._too_many_headers = True
            raise ValueError("headers too large")  # stops the parser; data_received answers 431
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._timer is not None:
            self._disarm()
        self._header_bytes = 0
        limits = self.limits
        length, chunked = _body_framing(self.headers)
        if length is not None and length > limits.max_body_bytes:
            self._refuse(413, f"request body larger than the limit of {limits.max_body_bytes} bytes")
            return
        limits.received += 1
        limits.waiting.pop(self, None)
        super().on_headers_complete()
        if limits.draining and self.cycle is not None:
            self.cycle.keep_alive = False
        self._state = _BODY if chunked or length else _WAITING

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        if self._timer is not None:
            self._disarm()
        answered = self.cycle is not None and self.cycle.response_complete
        self._state = _IDLE if answered else _WAITING  # answered early (e.g. 404 before the body)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._state == _WAITING:
            self._state = _IDLE
            if self._counted:
                self.limits.waiting[self] = self.loop.time()
        super().on_response_complete()

    def _evict_a_waiting_connection(self) -> None:
        """Make room by closing the connection that has waited longest without sending a complete
        request, if it has waited at least EVICT_AFTER_S (so a flood of new connections, whose
        requests may not have been read yet, is answered 503 rather than cut off)."""
        waiting = self.limits.waiting
        if not waiting:
            return
        oldest, since = next(iter(waiting.items()))
        if self.loop.time() - since < EVICT_AFTER_S:
            return
        waiting.pop(oldest)
        oldest._release()
        if oldest._state == _HEADERS:
            oldest._refuse(408, "request headers not received in time (the server needed the connection)")
        else:
            oldest.transport.close()

    def _release(self) -> None:
        """Stop counting this connection against the limit (it is being closed)."""
        if self._counted:
            self.limits.count(-1)
            self._counted = False

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
            self.transport.close()  # a connection that never sent a request
        elif state == _HEADERS:
            self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g}s")
        elif state == _BODY:
            self._refuse(408, f"request body not received within {self.limits.body_timeout_s:g}s")

    # -- early answers and drain -----------------------------------------------------------------

    def _refuse(self, status: int, message: str, retry: bool = False) -> None:
        """Answer `status` with a JSON error now, then close gracefully (lingering close)."""
        self._refused = True
        self._disarm()
        self._release()  # a lingering connection does not count against the limit
        self.limits.waiting.pop(self, None)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's answer, if any, is dropped
            cycle.message_event.set()
        if self.transport.is_closing():
            return
        body = error_body(message)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        if retry:
            head += [b"retry-after: ", str(RETRY_AFTER_S).encode(), b"\r\n"]
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)
        if status != 503:
            log.info("%s: %d %s", "%s:%d" % self.client if self.client else "client", status, message)

    def shutdown(self) -> None:
        """Drain begins: a request in progress is answered with Connection: close (so are later ones:
        `limits.draining`). An idle connection stays open for its client's next request; the
        server closes it with `close_if_idle` once it has been idle for DRAIN_IDLE_S."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False

    def close_if_idle(self, now: float) -> None:
        """Close this connection if it has waited DRAIN_IDLE_S for a request that has not begun."""
        since = self.limits.waiting.get(self)
        if (since is not None and now - since >= DRAIN_IDLE_S and self._state == _IDLE and not self.pipeline
                and not self._refused and not self.transport.is_closing()):
            self.transport.close()


def _body_framing(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """(Content-Length or None, chunked) of a request; the parser has already rejected bad values."""
    length, chunked = None, False
    for name, value in headers:
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = None
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return length, chunked
