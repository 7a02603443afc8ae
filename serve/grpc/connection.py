"""One connection of the gRPC port: the asyncio shell around the HTTP/2 machine
(`serve.http2.ServerConnection`), turning its events into gRPC calls (`serve.grpc.calls`) and the
calls' answers into its output. Cleartext with prior knowledge, which is what gRPC clients use
without TLS.

Calls: unary and server-streaming methods from a table (`Method`), `grpc-timeout` as the call's
deadline (`Call.time_remaining`), one length-prefixed request message (gzip or deflate ones are
inflated, never past the message limit), each answer headers + DATA + trailers in one write (errors
before any message: one trailers-only HEADERS frame). A request that is not gRPC gets a plain HTTP
4xx with one line saying what this port speaks.

What one client cannot do to the others (the machine bounds floods and holds the protocol; the
shell bounds time and memory):
- take more than its share of the event loop: at most TURN_FRAMES of its frames are read per
  loop turn, the rest waits with reading paused;
- make the server queue answers it does not read: while the transport's write buffer is over its
  high-water mark nothing more of the connection is read, and an answer that makes no progress for
  `send_timeout_s` (socket not read, or its flow-control window left shut) closes the connection;
- hold memory: one buffer per request message; past BUFFER_LIMIT largest messages of incomplete
  requests the connection window is not credited (a client that sends anyway breaks the window
  and gets FLOW_CONTROL_ERROR);
- hold a slot: no preface or an unfinished header block within `header_timeout_s`, a message not
  complete within `body_timeout_s` of its headers (DEADLINE_EXCEEDED), a connection without a call
  for `idle_timeout_s` (GOAWAY, which clients reconnect after); at the port's connection limit the
  longest idle connection makes room (`serve.host.ConnectionHost`);
- flood the log: client misbehaviour is logged at a bounded rate and counted in the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Mapping

from serve.core.errors import Code
from serve.grpc.calls import (
    OK_TRAILERS,
    RESPONSE_HEADERS,
    Method,
    RpcError,
    call_head,
    echo,
    message,
    request_message,
    status_fields,
)
from serve.host import ConnectionHost
from serve.http2.events import (
    ConnectionFailed,
    ConnectionTerminated,
    DataReceived,
    HeadersTooLarge,
    RequestReceived,
    RequestRefused,
    StreamReset,
    TrailersReceived,
)
from serve.http2.frames import ENHANCE_YOUR_CALM, GOAWAY, NO_ERROR, REFUSED_STREAM, SETTINGS, error_name, frame
from serve.http2.machine import Limits, ServerConnection

log = logging.getLogger(__name__)

TURN_FRAMES = 64
"""Frames of one connection read per event-loop turn. Counted in frames, not bytes: a frame's cost is
about the same whatever its size, and a HEADERS frame of a few bytes opens a call
(docs/design/transports.md)."""
BUFFER_LIMIT = 4
"""Incomplete request messages one connection may hold, in largest messages, before its window is
no longer credited."""
GOAWAY_LINGER_S = 0.5
"""After GOAWAY with no call left, how long the client gets to close first (closing a socket with
unread data in it resets the connection, which could cut off the last answer)."""
WRITE_BUFFER_HIGH = 1 << 18
"""The transport's write buffer past which the connection is not read (its client is not reading)."""


@dataclass(frozen=True, slots=True)
class GrpcService:
    """What every connection of the port serves, and how."""

    methods: Mapping[str, Method]
    http2: Limits
    max_message_bytes: int
    max_header_bytes: int


class Call:
    """One gRPC call (an HTTP/2 stream); handlers get it as their context."""

    __slots__ = ("id", "method", "deadline", "encoding", "body", "size", "receiving", "task", "headers_sent",
                 "closed", "problem", "opened", "authorization", "_loop")

    def __init__(self, stream_id: int, method: str, deadline: float | None, loop: asyncio.AbstractEventLoop) -> None:
        self.id = stream_id
        self.method = method
        self.deadline = deadline
        """Loop time by which the client wants its answer (its grpc-timeout), or None."""
        self.encoding = b""
        self.body: bytes | bytearray | None = None
        self.size = 0
        self.receiving = True
        self.task: asyncio.Task | None = None
        self.headers_sent = False
        self.closed = False
        self.problem: tuple[int, str] | None = None
        """For a request that is not gRPC: the HTTP status and line it is answered with."""
        self.opened = loop.time()
        self.authorization: bytes | None = None
        """Its `authorization` metadata (--auth-token-file)."""
        self._loop = loop

    def time_remaining(self) -> float | None:
        """Seconds left before the client's deadline, or None if it set none."""
        return None if self.deadline is None else max(0.0, self.deadline - self._loop.time())


class GrpcConnection(asyncio.Protocol):
    """One client connection of the gRPC port."""

    machine_class: Callable[[Limits], ServerConnection] = ServerConnection
    """The HTTP/2 machine (bench/serve_bench.py measures another one through this)."""

    def __init__(self, host: ConnectionHost, service: GrpcService) -> None:
        self.host = host
        self.limits = host.limits
        self.service = service
        self.methods = service.methods
        self.loop = host.loop
        self.transport: asyncio.Transport | None = None
        self.peer = "client"
        self.machine: ServerConnection | None = None
        self.calls: dict[int, Call] = {}
        self.incomplete: list[Call] = []
        """Calls whose request was still arriving after the read that opened them (the body timeout's watch list)."""
        self._new: list[Call] = []
        self.buffered = 0
        """Bytes of incomplete request messages held."""
        self._owed = 0
        """Connection-window credit held back while `buffered` is past the limit."""
        self._buffer_limit = BUFFER_LIMIT * (service.max_message_bytes + 5)
        self.opened_at = self.idle_since = 0.0
        self.block_since: float | None = None
        self.stall_since: float | None = None
        self._sent_mark = 0
        self._resumed = False
        self._paused: set[str] = set()
        self._write_paused = False
        self._close_timer: asyncio.TimerHandle | None = None
        self.draining = False
        self.closed = False

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        host = self.host
        if not host.admit(self):
            busy = f"server busy: {host.open} gRPC connections open (limit {self.limits.max_connections})"
            transport.write(frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, struct.pack(">LL", 0, ENHANCE_YOUR_CALM)
                                                          + busy.encode()))
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self.machine = self.machine_class(self.service.http2)
        self.machine.initiate()
        self.opened_at = self.idle_since = self.loop.time()
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.host.lost(self)
        if self._close_timer is not None:
            self._close_timer.cancel()
        for call in list(self.calls.values()):
            self._drop(call)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause("write")

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resumed = True
        self._resume("write")
        if self.machine is not None and self.machine.backlogged and not self.closed:
            self.loop.call_soon(self._next_turn)

    def _pause(self, reason: str) -> None:
        if not self._paused and not self.transport.is_closing():
            self.transport.pause_reading()
        self._paused.add(reason)

    def _resume(self, reason: str) -> None:
        self._paused.discard(reason)
        if not self._paused and not self.closed and not self.transport.is_closing():
            self.transport.resume_reading()

    def _send(self) -> None:
        data = self.machine.data_to_send()
        if data and not self.closed:
            self.transport.write(data)

    # -- input ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.machine is None or self.closed:
            return  # refused: its bytes are not read
        self._feed(data)

    def _next_turn(self) -> None:
        if self.closed or self.machine.terminated or self._write_paused:
            return  # closed, or resume_writing takes the backlog up
        self._feed(b"")

    def _turn_over(self) -> None:
        """What the turn's budget left waits, with reading paused, for the loop's next turn."""
        if self.machine.backlogged:
            self._pause("turn")
            self.loop.call_soon(self._next_turn)
        elif "turn" in self._paused:
            self._resume("turn")

    def _feed(self, data: bytes) -> None:
        machine = self.machine
        for event in machine.receive(data, TURN_FRAMES):
            kind = type(event)
            if kind is RequestReceived:
                self._on_request(event)
            elif kind is DataReceived:
                self._on_data(event)
            else:
                self._on_other(event)
        if self._new:
            self.incomplete += [call for call in self._new if call.receiving]
            self._new.clear()
        if machine.header_block_open:
            if self.block_since is None:
                self.block_since = self.loop.time()
        else:
            self.block_since = None
        self._send()
        if machine.terminated:
            self._shut()
        else:
            self._turn_over()

    def _on_request(self, event: RequestReceived) -> None:
        head = call_head(event.head)
        deadline = None if head.timeout_s is None else self.loop.time() + head.timeout_s
        call = Call(event.stream_id, head.path, deadline, self.loop)
        call.encoding = head.encoding
        call.authorization = head.authorization
        self._opened(call)
        call.receiving = not event.end_stream
        if head.problem is not None:
            call.problem = head.problem
            if event.end_stream:
                self._answer_http(call)
            else:
                self._new.append(call)
        elif call.method not in self.methods:
            self.host.report("unimplemented")
            shown = echo(call.method)
            self.host.warn("unimplemented", "%s %s: not implemented by this server", self.peer, shown)
            self._finish(call, Code.UNIMPLEMENTED, f"method {shown} is not implemented by this server")
        elif event.end_stream:
            self._end_of_request(call)
        else:
            self._new.append(call)

    def _opened(self, call: Call) -> None:
        if not self.calls:
            self.host.set_busy(self)
        self.calls[call.id] = call
        self.host.received += 1

    def _on_data(self, event: DataReceived) -> None:
        machine = self.machine
        data = event.data
        size = len(data)
        call = self.calls.get(event.stream_id)
        machine.credit_stream(event.stream_id, size)  # a call holds at most one message: the stream may go on
        if call is None or not call.receiving or call.problem is not None:
            machine.credit_connection(size)  # discarded
            if call is not None and event.end_stream and call.receiving:
                call.receiving = False
                self._answer_http(call)
            return
        if call.body is None:
            call.body = data
        else:
            if type(call.body) is bytes:
                call.body = bytearray(call.body)
            call.body += data
        call.size += size
        self.buffered += size
        if self.buffered <= self._buffer_limit:
            machine.credit_connection(size + self._owed)
            self._owed = 0
        else:
            self._owed += size
        limit = self.service.max_message_bytes
        if call.size > limit + 5:
            self._finish(call, Code.RESOURCE_EXHAUSTED,
                         f"request message larger than the limit of {limit} bytes (--max-body-bytes)")
        elif event.end_stream:
            self._end_of_request(call)

    def _on_other(self, event) -> None:  # noqa: ANN001 - any other event of serve.http2.events
        kind = type(event)
        host = self.host
        if kind is TrailersReceived:
            call = self.calls.get(event.stream_id)
            if call is not None and call.receiving:
                if call.problem is not None:
                    call.receiving = False
                    self._answer_http(call)
                else:
                    self._end_of_request(call)
        elif kind is StreamReset:
            call = self.calls.get(event.stream_id)
            if call is not None:
                self._drop(call)
            if not event.remote:
                host.report("stream_error")
                host.warn("stream_error", "%s: stream %d reset with %s: %s", self.peer, event.stream_id,
                          error_name(event.code), event.reason)
        elif kind is RequestRefused:
            if event.code == REFUSED_STREAM:
                host.report("refused_stream")
            else:
                host.report("malformed")
                host.warn("malformed", "%s: stream %d reset with %s: %s", self.peer, event.stream_id,
                          error_name(event.code), event.reason)
        elif kind is HeadersTooLarge:
            call = Call(event.stream_id, "", None, self.loop)
            call.receiving = not event.end_stream
            self._opened(call)
            host.report("headers_too_large")
            limit = self.service.max_header_bytes
            host.warn("headers_too_large", "%s: request headers larger than %d bytes: GOAWAY", self.peer, limit)
            self._finish(call, Code.RESOURCE_EXHAUSTED,
                         f"request headers larger than the limit of {limit} bytes (--grpc-max-header-bytes)")
        elif kind is ConnectionTerminated:
            self._close_when_idle()
        elif kind is ConnectionFailed:
            host.report(error_name(event.code).lower())
            host.warn("connection_error", "%s: %s: GOAWAY %s, connection closed", self.peer, event.reason,
                      error_name(event.code))
            for call in list(self.calls.values()):
                self._drop(call)

    def _end_of_request(self, call: Call) -> None:
        call.receiving = False
        body = call.body or b""
        call.body = None
        self._free(call.size)
        try:
            request = request_message(body if type(body) is bytes else bytes(body), call.encoding,
                                      self.service.max_message_bytes)
        except RpcError as exc:
            self._finish(call, exc.code, exc.message)
            return
        call.task = self.loop.create_task(self._run(call, self.methods[call.method], request))
        self.host.track(call.task)

    def _free(self, size: int) -> None:
        self.buffered -= size
        if self._owed and self.buffered <= self._buffer_limit:
            self.machine.credit_connection(self._owed)
            self._owed = 0

    # -- answers -------------------------------------------------------------------------------

    async def _run(self, call: Call, method: Method, request: bytes) -> None:
        try:
            if method.streaming:
                async for reply in method.handler(request, call):
                    self._send_message(call, reply)
                code, text = Code.OK, ""
            else:
                reply = await method.handler(request, call)
                if not call.closed:
                    self.machine.respond(call.id, RESPONSE_HEADERS, message(reply), OK_TRAILERS)
                    self._done(call)
                    self._send()
                return
        except RpcError as exc:
            code, text = exc.code, exc.message
        except Exception:  # noqa: BLE001 - a bug: logged, never sent
            log.exception("unhandled error in gRPC %s", call.method)
            code, text = Code.INTERNAL, "internal error"
        self._finish(call, code, text)

    def _send_message(self, call: Call, reply: bytes) -> None:
        if call.closed:
            return
        if not call.headers_sent:
            call.headers_sent = True
            self.machine.send_headers(call.id, RESPONSE_HEADERS)
        self.machine.send_data(call.id, message(reply))
        self._send()

    def _finish(self, call: Call, code: Code, text: str) -> None:
        """End `call` with a status: in trailers after its messages, or trailers-only."""
        if call.closed:
            return
        if call.headers_sent:
            self.machine.send_trailers(call.id, status_fields(code, text))
        else:
            self.machine.send_headers(call.id, RESPONSE_HEADERS + status_fields(code, text), end_stream=True)
        self._done(call)
        self._send()

    def _answer_http(self, call: Call) -> None:
        """A request that is not gRPC: its HTTP status and one line of text."""
        status, text = call.problem
        headers = ((b":status", str(status).encode()), (b"content-type", b"text/plain; charset=utf-8"),
                   *(((b"allow", b"POST"),) if status == 405 else ()))
        self.machine.send_headers(call.id, headers)
        self.machine.send_data(call.id, text.encode() + b"\n", end_stream=True)
        self._done(call)
        self._send()

    def _done(self, call: Call) -> None:
        """Our side of `call` is done; a request still arriving is stopped (RST_STREAM NO_ERROR)."""
        self.host.answered += 1
        if self._release(call):
            self.machine.reset_stream(call.id, NO_ERROR)

    def _drop(self, call: Call) -> None:
        """The client reset `call` (or the connection is gone): stop its handler, send nothing."""
        self._release(call)
        if call.task is not None and not call.task.done():
            call.task.cancel()

    def _release(self, call: Call) -> bool:
        """Forget `call` (its slot, its buffered request); True if its request was still arriving."""
        call.closed = True
        self.calls.pop(call.id, None)
        receiving, call.receiving = call.receiving, False
        if receiving:
            self._free(call.size)
            call.body = None
        if not self.calls:
            self.idle_since = self.loop.time()
            self.host.set_idle(self)
            machine = self.machine
            if machine is not None and (machine.goaway_sent or machine.peer_goaway or self.draining):
                self._close_when_idle()
        return receiving

    # -- deadlines (the host's tick) -------------------------------------------------------------

    def tick(self, now: float) -> None:
        machine = self.machine
        if machine is None or self.closed or machine.terminated:
            return
        limits = self.limits
        if not machine.started:
            if now - self.opened_at > limits.header_timeout_s:
                self._calm("preface_timeout", f"no HTTP/2 preface within {limits.header_timeout_s:g}s")
            return
        if self.block_since is not None and now - self.block_since > limits.header_timeout_s:
            self._calm("header_timeout", f"a header block not completed within {limits.header_timeout_s:g}s "
                                         "(--header-timeout)")
            return
        if self.incomplete:
            self._expire_requests(now)
        if not self.calls and not machine.goaway_sent and now - self.idle_since > limits.idle_timeout_s:
            self.host.report("idle_closed")
            machine.goaway(NO_ERROR, f"idle for {limits.idle_timeout_s:g}s")
            self._send()
            self._close_when_idle()
        self._check_stall(now)

    def _expire_requests(self, now: float) -> None:
        timeout = self.limits.body_timeout_s
        waiting = []
        for call in self.incomplete:
            if not call.receiving or call.closed:
                continue
            if now - call.opened <= timeout:
                waiting.append(call)
                continue
            self.host.report("body_timeout")
            self.host.warn("body_timeout", "%s %s: request message not received within %gs", self.peer,
                           echo(call.method), timeout)
            if call.problem is not None:
                self._answer_http(call)
            else:
                self._finish(call, Code.DEADLINE_EXCEEDED, f"request message not received within {timeout:g}s "
                                                           "(--body-timeout)")
        self.incomplete = waiting

    def _check_stall(self, now: float) -> None:
        """An answer that makes no progress for send_timeout_s (the client reads nothing, or keeps
        its window shut) closes the connection."""
        machine = self.machine
        stalled = machine.output_blocked or self._write_paused
        progress = machine.data_sent != self._sent_mark or self._resumed
        self._sent_mark, self._resumed = machine.data_sent, False
        if not stalled:
            self.stall_since = None
        elif progress or self.stall_since is None:
            self.stall_since = now
        elif now - self.stall_since > self.limits.send_timeout_s:
            self.host.report("send_timeout")
            self.host.warn("send_timeout", "%s: answers not taken for %gs (--send-timeout): closed", self.peer,
                           self.limits.send_timeout_s)
            self.abort()

    def _calm(self, event: str, reason: str) -> None:
        self.host.report(event)
        self.host.warn(event, "%s: %s: closed", self.peer, reason)
        self.machine.goaway(ENHANCE_YOUR_CALM, reason)
        self._send()
        self._shut()

    # -- closing ---------------------------------------------------------------------------------

    def _close_when_idle(self) -> None:
        if not self.calls and not self.closed and self._close_timer is None:
            self._close_timer = self.loop.call_later(GOAWAY_LINGER_S, self._close)

    def _close(self) -> None:
        if not self.closed:
            self.transport.close()

    def _shut(self) -> None:
        """Close after a connection error: what is buffered goes out if it can at once, else it is dropped."""
        if self.closed:
            return
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def drain(self) -> None:
        """No new calls on this connection (the client opens none after GOAWAY; one it sent
        meanwhile is refused, which clients retry); those in progress finish."""
        self.draining = True
        machine = self.machine
        if machine is None or self.closed:
            return
        if not machine.goaway_sent and not machine.terminated:
            machine.goaway(NO_ERROR, "server shutting down")
            self._send()
        self._close_when_idle()

    def close_if_idle(self, now: float) -> None:
        self._close_when_idle()

    def evict(self) -> None:
        if self.machine is not None and not self.closed:
            self.machine.goaway(NO_ERROR, "idle connection closed to make room for a new one")
            self._send()
        self._close()

    def shed(self) -> None:
        if self.machine is not None and not self.closed and not self.machine.goaway_sent:
            self.machine.goaway(NO_ERROR, "moving connections to a less loaded worker")
            self._send()
        self._close_when_idle()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()


__all__ = ["Call", "GrpcConnection", "GrpcService"]
