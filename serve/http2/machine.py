"""The server side of one HTTP/2 connection (RFC 9113) as a sans-IO machine: bytes in, events out,
bytes to send. No sockets, no event loop, no clock but the one it is given: it is tested by
feeding it bytes, and any shell (`serve.grpc.connection`) can drive it.

    machine = ServerConnection(Limits())
    machine.initiate()                       # our SETTINGS
    events = machine.receive(data)           # RequestReceived, DataReceived, StreamReset, ...
    machine.respond(stream_id, headers, body, trailers)
    transport.write(machine.data_to_send())

It answers what needs no application (SETTINGS, PING, flow control, every protocol error) and holds
the client to the protocol: stream states and id order, header validation, content-length, frame
sizes, receive windows (a client past one gets FLOW_CONTROL_ERROR, so what it can make the server
hold is bounded by the windows the application credits). Answers larger than the client's windows
wait inside the machine and go out as WINDOW_UPDATEs arrive.

Floods are bounded here too (the denial-of-service classes of CVE-2019-9512/9515/9518 and
CVE-2023-44487): frames that ask the server for work without carrying a request (PING, SETTINGS,
PRIORITY, unknown types) draw on a budget refilled over time and by each request; stream resets
are counted per second; empty DATA and CONTINUATION frames in a row, and CONTINUATION frames per
header block, are counted: past any of them the connection ends with GOAWAY ENHANCE_YOUR_CALM.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Callable

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
from serve.http2.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEAD,
    HEADERS,
    MAX_FRAME_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    COMPRESSION_ERROR,
    frame,
)
from serve.http2.headers import (
    CompressionError,
    Fields,
    HeaderDecoder,
    HeaderListTooLarge,
    Malformed,
    check_trailers,
    encode,
)

_U32 = struct.Struct(">L")
_GOAWAY = struct.Struct(">LL")
_SETTING = struct.Struct(">HL")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection may ask of the server."""

    max_concurrent_streams: int = 256
    """Streams open at once (advertised); past it a new one is refused (REFUSED_STREAM, which clients retry)."""
    stream_window: int = 1 << 20
    """Each stream's receive window (advertised as SETTINGS_INITIAL_WINDOW_SIZE)."""
    connection_window: int = 1 << 23
    """The connection's receive window: the most body bytes the client may send before credit comes back."""
    max_header_list_bytes: int = 16_384
    """Decoded header list size (advertised as SETTINGS_MAX_HEADER_LIST_SIZE); the encoded block may
    be at most this plus one frame."""
    control_burst: int = 1000
    control_per_s: float = 100.0
    """Frames without a request (PING, SETTINGS, PRIORITY, unknown types): `control_burst` at once,
    refilled at `control_per_s` and by one for each request."""
    resets_per_s: int = 1000
    """Stream resets from the client in any one second (at most max_concurrent_streams can be
    running, so cancelling all of them at once stays well below it)."""
    empty_frames: int = 16
    """Empty DATA or CONTINUATION frames (without END_STREAM or END_HEADERS) in a row."""
    continuations: int = 32
    """CONTINUATION frames in one header block (a client splits a block at 16 KiB frames)."""


class _Stream:
    __slots__ = ("id", "remote_open", "local_open", "ending", "send_window", "recv_window", "recv_unacked",
                 "out", "trailers", "content_length", "received")

    def __init__(self, stream_id: int, send_window: int, recv_window: int, content_length: int | None) -> None:
        self.id = stream_id
        self.remote_open = True
        """The client has not ended its side (no END_STREAM yet)."""
        self.local_open = True
        """This side has not sent END_STREAM."""
        self.ending = False
        """The application has ended its side: END_STREAM goes out once `out` (then `trailers`) are sent."""
        self.send_window = send_window
        self.recv_window = recv_window
        self.recv_unacked = 0
        self.out = b""
        """Answer bytes waiting for the client's flow-control windows."""
        self.trailers: bytes | None = None
        self.content_length = content_length
        self.received = 0


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class _StreamError(Exception):
    def __init__(self, stream_id: int, code: int, reason: str) -> None:
        super().__init__(reason)
        self.stream_id, self.code, self.reason = stream_id, code, reason


class ServerConnection:
    """One connection's HTTP/2 state, server side."""

    CLOSED_MEMORY = 512
    """Recently closed streams remembered (to tell a frame on a closed stream from one on a stream
    that never existed, and frames in flight after our reset from a client's error)."""

    def __init__(self, limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._decoder = HeaderDecoder(limits.max_header_list_bytes)
        self._out: list[bytes] = []
        self._events: list = []
        self._buffer = b""
        self._backlogged = False
        self._preface = False
        self._settings_seen = False
        self.streams: dict[int, _Stream] = {}
        """Open and half-closed streams, by id."""
        self._closed: dict[int, bool] = {}
        """Recently closed stream ids -> closed by our reset (frames still in flight are ignored)."""
        self.last_stream = 0
        """The highest stream id the client has opened."""
        self._block: bytearray | None = None
        """A header block waiting for its CONTINUATION frames (with `_block_*`)."""
        self._block_stream = self._block_flags = self._block_frames = 0
        self._block_self_dependent = False
        self.send_window = DEFAULT_WINDOW
        self._peer_window = DEFAULT_WINDOW
        self._peer_frame = DEFAULT_FRAME_SIZE
        self.recv_window = limits.connection_window
        self._recv_unacked = 0
        self._blocked: dict[int, _Stream] = {}
        self.goaway_sent = False
        self.peer_goaway = False
        self.terminated = False
        """After a connection error: GOAWAY queued, nothing more is read."""
        self._table_broken = False
        self._tokens = float(limits.control_burst)
        self._tokens_at = clock()
        self._resets = 0
        self._resets_since = 0.0
        self._empty = 0
        self.data_sent = 0
        """DATA payload bytes sent so far (a shell tells a slow reader from a stuck one by it)."""

    # -- state the shell reads -------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """The client's connection preface has arrived."""
        return self._preface

    @property
    def header_block_open(self) -> bool:
        """A header block has begun and its CONTINUATION frames are still awaited."""
        return self._block is not None

    @property
    def output_blocked(self) -> bool:
        """Some answer waits for the client's flow-control windows."""
        return bool(self._blocked)

    def data_to_send(self) -> bytes:
        out, self._out = self._out, []
        return b"".join(out) if len(out) != 1 else out[0]

    # -- input -----------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue this side's connection preface: SETTINGS and the connection window's first credit."""
        limits = self.limits
        settings = b"".join(_SETTING.pack(key, value) for key, value in (
            (SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
            (SETTINGS_INITIAL_WINDOW_SIZE, limits.stream_window),
            (SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list_bytes)))
        self._out.append(frame(SETTINGS, 0, 0, settings))
        if limits.connection_window > DEFAULT_WINDOW:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(limits.connection_window - DEFAULT_WINDOW)))

    @property
    def backlogged(self) -> bool:
        """The last `receive` stopped at its frame budget: whole frames wait for the next one."""
        return self._backlogged

    def receive(self, data: bytes, max_frames: int | None = None) -> list:
        """Take bytes from the client; returns the events they make (see `serve.http2.events`).
        With `max_frames`, at most that many frames are read and the rest is kept (`backlogged`):
        a shell bounds each connection's share of its event loop by frames, since a frame's cost
        does not depend on its size (a tiny HEADERS frame opens a call)."""
        events = self._events = []
        self._backlogged = False
        if self.terminated:
            return events
        buffer = self._buffer + data if self._buffer else data
        used = 0
        try:
            if not self._preface:
                if len(buffer) < len(PREFACE) or not buffer.startswith(PREFACE):
                    if not PREFACE.startswith(buffer[:len(PREFACE)]):
                        raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    self._buffer = buffer
                    return events
                self._preface = True
                used = len(PREFACE)
            used = self._read_frames(buffer, used, max_frames)
        except _ConnectionError as exc:
            self._fail(exc.code, exc.reason)
            used = len(buffer)
        self._buffer = buffer[used:] if used else buffer
        return events

    def _read_frames(self, buffer: bytes, pos: int, max_frames: int | None) -> int:
        end = len(buffer)
        left = -1 if max_frames is None else max_frames
        while end - pos >= 9 and not self.terminated:
            if left == 0:
                self._backlogged = True
                break
            left -= 1
            high, low, kind, flags, stream_id = HEAD.unpack_from(buffer, pos)
            length = high << 8 | low
            if length > DEFAULT_FRAME_SIZE:
                raise _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {length} bytes (the limit is {DEFAULT_FRAME_SIZE})")
            if end - pos - 9 < length:
                break
            payload = buffer[pos + 9:pos + 9 + length]
            pos += 9 + length
            try:
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
            except _StreamError as exc:
                self._stream_error(exc.stream_id, exc.code, exc.reason)
        return end if self.terminated else pos

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and (kind != CONTINUATION or stream_id != self._block_stream):
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if not self._settings_seen:
            if kind != SETTINGS or flags & ACK:
                raise _ConnectionError(PROTOCOL_ERROR, "the connection preface must end with a SETTINGS frame")
            self._settings_seen = True
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == RST_STREAM:
            self._on_reset(stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            self._on_ping(flags, stream_id, payload)
        elif kind == PRIORITY:
            self._on_priority(stream_id, payload)
        elif kind == GOAWAY:
            self._on_goaway(stream_id, payload)
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not send PUSH_PROMISE")
        else:
            self._charge("unknown-type")  # extension frames are ignored (RFC 9113 5.5), not for free

    # -- budgets ---------------------------------------------------------------------------------

    def _charge(self, what: str) -> None:
        now = self._clock()
        limits = self.limits
        tokens = min(limits.control_burst, self._tokens + (now - self._tokens_at) * limits.control_per_s) - 1
        self._tokens, self._tokens_at = tokens, now
        if tokens < 0:
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"too many {what} frames")

    def _empty_frame(self, kind: str) -> None:
        self._empty += 1
        if self._empty > self.limits.empty_frames:
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"more than {self.limits.empty_frames} empty {kind} frames in a row")

    # -- DATA ------------------------------------------------------------------------------------

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        if length > self.recv_window:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA past the connection's flow-control window")
        self.recv_window -= length
        data = _unpad(payload, flags) if flags & PADDED else payload
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:
            self.credit_connection(length)  # these bytes never reach the application
            if stream_id > self.last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, "DATA on a stream that was never opened")
            if stream is None and self._closed.get(stream_id):
                return  # in flight when we reset the stream
            raise _StreamError(stream_id, STREAM_CLOSED, "DATA after the end of the stream")
        if length > stream.recv_window:
            self.credit_connection(length)
            raise _StreamError(stream_id, FLOW_CONTROL_ERROR, "DATA past the stream's flow-control window")
        stream.recv_window -= length
        if length != len(data):
            self.credit_connection(length - len(data))  # padding
            self.credit_stream(stream_id, length - len(data))
        end = flags & END_STREAM
        if data:
            self._empty = 0
        elif not end:
            self._empty_frame("DATA")
        stream.received += len(data)
        expected = stream.content_length
        if expected is not None and (stream.received > expected or (end and stream.received != expected)):
            self.credit_connection(len(data))
            raise _StreamError(stream_id, PROTOCOL_ERROR, "the body's length differs from its content-length")
        if end:
            stream.remote_open = False
        self._events.append(DataReceived(stream_id, data, bool(end)))
        if end and not stream.local_open:
            self._forget(stream, by_us=False)

    def credit_connection(self, size: int) -> None:
        """The application no longer holds `size` body bytes: the client may send that many more
        (WINDOW_UPDATE once half the connection window is due)."""
        self._recv_unacked += size
        if self._recv_unacked >= self.limits.connection_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked)))
            self.recv_window += self._recv_unacked
            self._recv_unacked = 0

    def credit_stream(self, stream_id: int, size: int) -> None:
        """The application takes `size` more bytes on this stream (WINDOW_UPDATE once half its window is due)."""
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:
            return
        stream.recv_unacked += size
        if stream.recv_unacked >= self.limits.stream_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.recv_unacked)))
            stream.recv_window += stream.recv_unacked
            stream.recv_unacked = 0

    # -- HEADERS and CONTINUATION ----------------------------------------------------------------

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id % 2:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0" if not stream_id else
                                   "a client stream with an even id")
        block = _unpad(payload, flags) if flags & PADDED else payload
        self_dependent = False
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
            self_dependent = _U32.unpack_from(block)[0] & 0x7FFFFFFF == stream_id
            block = block[5:]
        if flags & END_HEADERS:
            if block:
                self._empty = 0
            self._header_block(stream_id, flags, block, self_dependent)
            return
        if block:
            self._empty = 0
        else:
            self._empty_frame("HEADERS")
        self._block, self._block_stream, self._block_flags = bytearray(block), stream_id, flags
        self._block_frames, self._block_self_dependent = 0, self_dependent

    def _on_continuation(self, flags: int, payload: bytes) -> None:
        if self._block is None:
            raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
        if payload:
            self._empty = 0
        elif not flags & END_HEADERS:
            self._empty_frame("CONTINUATION")
        self._block_frames += 1
        if self._block_frames > self.limits.continuations:
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"more than {self.limits.continuations} CONTINUATION frames "
                                                      "in one header block")
        self._block += payload
        if len(self._block) > self.limits.max_header_list_bytes + DEFAULT_FRAME_SIZE:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "a header block larger than the header list limit")
        if flags & END_HEADERS:
            block, self._block = bytes(self._block), None
            self._header_block(self._block_stream, self._block_flags, block, self._block_self_dependent)

    def _header_block(self, stream_id: int, flags: int, block: bytes, self_dependent: bool) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._trailers(stream, flags, block)
        elif stream_id <= self.last_stream:
            if stream_id in self._closed:
                raise _ConnectionError(STREAM_CLOSED, "HEADERS on a closed stream")
            raise _ConnectionError(PROTOCOL_ERROR, "a new stream's id must be above every earlier one's")
        else:
            self._new_stream(stream_id, flags, block, self_dependent)

    def _decode(self, block: bytes) -> list:
        try:
            return self._decoder.decode(block)
        except CompressionError as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"undecodable header block ({exc})") from None

    def _trailers(self, stream: _Stream, flags: int, block: bytes) -> None:
        if self._table_broken:
            raise _StreamError(stream.id, REFUSED_STREAM, "header blocks are no longer read on this connection")
        try:
            fields = self._decode(block)[1]
        except HeaderListTooLarge:
            self._table_broken = True
            self.goaway(ENHANCE_YOUR_CALM, "header list larger than the limit")
            raise _StreamError(stream.id, PROTOCOL_ERROR, "trailers larger than the header list limit") from None
        if not stream.remote_open:
            raise _StreamError(stream.id, STREAM_CLOSED, "HEADERS after the end of the stream")
        if not flags & END_STREAM:
            raise _StreamError(stream.id, PROTOCOL_ERROR, "a second HEADERS frame without END_STREAM")
        try:
            check_trailers(fields)
        except Malformed as exc:
            raise _StreamError(stream.id, PROTOCOL_ERROR, f"malformed trailers: {exc}") from None
        if stream.content_length is not None and stream.received != stream.content_length:
            raise _StreamError(stream.id, PROTOCOL_ERROR, "the body's length differs from its content-length")
        stream.remote_open = False
        self._events.append(TrailersReceived(stream.id))
        if not stream.local_open:
            self._forget(stream, by_us=False)

    def _new_stream(self, stream_id: int, flags: int, block: bytes, self_dependent: bool) -> None:
        self.last_stream = stream_id
        self._tokens = min(self.limits.control_burst, self._tokens + 1)
        if self._table_broken:
            self._refuse(stream_id, REFUSED_STREAM, "header blocks are no longer read on this connection")
            return
        end = bool(flags & END_STREAM)
        try:
            head = self._decoder.request(block)
        except CompressionError as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"undecodable header block ({exc})") from None
        except HeaderListTooLarge:
            self._table_broken = True
            self._open(stream_id, None, end)
            self._events.append(HeadersTooLarge(stream_id, end))
            self.goaway(ENHANCE_YOUR_CALM, "header list larger than the limit")
            return
        except Malformed as exc:
            self._refuse(stream_id, PROTOCOL_ERROR, f"malformed request: {exc}")
            return
        if self_dependent:
            self._refuse(stream_id, PROTOCOL_ERROR, "a stream cannot depend on itself")
        elif self.goaway_sent:
            self._refuse(stream_id, REFUSED_STREAM, "the connection is closing (GOAWAY sent)")
        elif len(self.streams) >= self.limits.max_concurrent_streams:
            self._refuse(stream_id, REFUSED_STREAM, f"more than {self.limits.max_concurrent_streams} streams at once")
        elif end and head.content_length:
            self._refuse(stream_id, PROTOCOL_ERROR, "a content-length without a body")
        else:
            self._open(stream_id, head.content_length, end)
            self._events.append(RequestReceived(stream_id, head, end))

    def _open(self, stream_id: int, content_length: int | None, end: bool) -> None:
        stream = _Stream(stream_id, self._peer_window, self.limits.stream_window, content_length)
        stream.remote_open = not end
        self.streams[stream_id] = stream

    def _refuse(self, stream_id: int, code: int, reason: str) -> None:
        self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(code)))
        self._remember(stream_id, by_us=True)
        self._events.append(RequestRefused(stream_id, code, reason))

    # -- control frames --------------------------------------------------------------------------

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame must be 4 bytes")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise _ConnectionError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            if self.send_window + increment > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection window past 2^31-1")
            self.send_window += increment
            self._flush_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE on a stream that was never opened")
            return  # closed: a late update (RFC 9113 6.9)
        if not increment:
            raise _StreamError(stream_id, PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
        if stream.send_window + increment > MAX_WINDOW:
            raise _StreamError(stream_id, FLOW_CONTROL_ERROR, "a stream window past 2^31-1")
        stream.send_window += increment
        if stream.out or stream.ending:
            self._flush(stream)

    def _on_reset(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a RST_STREAM frame must be 4 bytes")
        if not stream_id or stream_id > self.last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, "RST_STREAM on stream 0" if not stream_id else
                                   "RST_STREAM on a stream that was never opened")
        now = self._clock()
        if now - self._resets_since > 1.0:
            self._resets, self._resets_since = 0, now
        self._resets += 1
        if self._resets > self.limits.resets_per_s:
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"more than {self.limits.resets_per_s} stream resets in a second")
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._forget(stream, by_us=False)
            self._events.append(StreamReset(stream_id, _U32.unpack(payload)[0], True))

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS frame's length must be a multiple of 6")
        self._charge("SETTINGS")
        for key, value in _SETTING.iter_unpack(payload):
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                self._new_initial_window(value)
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= MAX_FRAME_SIZE:
                    raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self._peer_frame = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH other than 0 or 1")
        self._out.append(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _new_initial_window(self, value: int) -> None:
        if value > MAX_WINDOW:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
        delta, self._peer_window = value - self._peer_window, value
        for stream in self.streams.values():
            stream.send_window += delta
            if stream.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE takes a stream window past 2^31-1")

    def _on_ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a PING frame must be 8 bytes")
        if not flags & ACK:
            self._charge("PING")
            self._out.append(frame(PING, ACK, 0, payload))

    def _on_priority(self, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a PRIORITY frame must be 5 bytes")
        self._charge("PRIORITY")
        if _U32.unpack_from(payload)[0] & 0x7FFFFFFF == stream_id:
            if stream_id in self.streams:
                raise _StreamError(stream_id, PROTOCOL_ERROR, "a stream cannot depend on itself")
            raise _ConnectionError(PROTOCOL_ERROR, "a stream cannot depend on itself")

    def _on_goaway(self, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a GOAWAY frame needs at least 8 bytes")
        last, code = _GOAWAY.unpack_from(payload)
        self.peer_goaway = True
        self._events.append(ConnectionTerminated(code, last & 0x7FFFFFFF, payload[8:]))

    # -- output ----------------------------------------------------------------------------------

    def send_headers(self, stream_id: int, fields: Fields, end_stream: bool = False) -> None:
        """Response headers (or, with `end_stream`, a complete answer without a body)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ending:
            return  # reset meanwhile (or already ended): nothing to send
        self._header_frames(stream_id, encode(fields), end_stream)
        if end_stream:
            stream.ending = True
            self._end_local(stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """Body bytes; they go out as the client's windows allow, the rest as they open."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ending:
            return
        stream.out = stream.out + data if stream.out else data
        stream.ending = end_stream
        self._flush(stream)

    def send_trailers(self, stream_id: int, fields: Fields) -> None:
        """End the answer with trailers, after every body byte already given."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ending:
            return
        stream.trailers = encode(fields)
        stream.ending = True
        self._flush(stream)

    def respond(self, stream_id: int, headers: Fields, body: bytes, trailers: Fields) -> None:
        """A whole answer: headers, body, trailers (one write when the windows allow the body)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ending:
            return
        size = len(body)
        if stream.out or size > self.send_window or size > stream.send_window or size > self._peer_frame:
            self.send_headers(stream_id, headers)
            self.send_data(stream_id, body)
            self.send_trailers(stream_id, trailers)
            return
        self.send_window -= size
        stream.send_window -= size
        self.data_sent += size
        self._out.append(frame(HEADERS, END_HEADERS, stream_id, encode(headers)) + frame(DATA, 0, stream_id, body)
                         + frame(HEADERS, END_HEADERS | END_STREAM, stream_id, encode(trailers)))
        stream.ending = True
        self._end_local(stream)

    def reset_stream(self, stream_id: int, code: int = NO_ERROR) -> None:
        """RST_STREAM: e.g. NO_ERROR once an answer is complete and the rest of the request is not wanted."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(code)))
            self._forget(stream, by_us=True)

    def goaway(self, code: int = NO_ERROR, debug: str = "") -> None:
        """GOAWAY: no new streams (a client's new one is refused), those open go on."""
        self.goaway_sent = True
        self._out.append(frame(GOAWAY, 0, 0, _GOAWAY.pack(self.last_stream, code) + debug.encode()[:256]))

    def _header_frames(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        flags = END_STREAM if end_stream else 0
        limit = self._peer_frame
        if len(block) <= limit:
            self._out.append(frame(HEADERS, flags | END_HEADERS, stream_id, block))
            return
        parts = [block[i:i + limit] for i in range(0, len(block), limit)]
        self._out.append(frame(HEADERS, flags, stream_id, parts[0]))
        for part in parts[1:-1]:
            self._out.append(frame(CONTINUATION, 0, stream_id, part))
        self._out.append(frame(CONTINUATION, END_HEADERS, stream_id, parts[-1]))

    def _flush(self, stream: _Stream) -> None:
        """Send what the windows allow of `stream`'s body; its end once nothing is left."""
        out, sent, total = stream.out, 0, len(stream.out)
        frames = self._out
        last_flags = 0
        while sent < total:
            size = min(total - sent, self.send_window, stream.send_window, self._peer_frame)
            if size <= 0:
                break
            last_flags = END_STREAM if sent + size == total and stream.ending and stream.trailers is None else 0
            frames.append(frame(DATA, last_flags, stream.id, out[sent:sent + size]))
            sent += size
            self.send_window -= size
            stream.send_window -= size
        self.data_sent += sent
        if sent < total:
            stream.out = out[sent:]
            self._blocked[stream.id] = stream
            return
        stream.out = b""
        self._blocked.pop(stream.id, None)
        if not stream.ending:
            return
        if stream.trailers is not None:
            self._header_frames(stream.id, stream.trailers, True)
        elif not last_flags:
            frames.append(frame(DATA, END_STREAM, stream.id))
        self._end_local(stream)

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self.send_window <= 0:
                return
            self._flush(stream)

    def _end_local(self, stream: _Stream) -> None:
        stream.local_open = False
        if not stream.remote_open:
            self._forget(stream, by_us=False)

    # -- closing ---------------------------------------------------------------------------------

    def _forget(self, stream: _Stream, by_us: bool) -> None:
        del self.streams[stream.id]
        self._blocked.pop(stream.id, None)
        self._remember(stream.id, by_us)

    def _remember(self, stream_id: int, by_us: bool) -> None:
        closed = self._closed
        closed[stream_id] = by_us
        if len(closed) > self.CLOSED_MEMORY:
            del closed[next(iter(closed))]

    def _stream_error(self, stream_id: int, code: int, reason: str) -> None:
        self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(code)))
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._forget(stream, by_us=True)
            self._events.append(StreamReset(stream_id, code, False, reason))
        else:
            self._remember(stream_id, by_us=True)

    def _fail(self, code: int, reason: str) -> None:
        self.goaway(code, reason)
        self.terminated = True
        self._block = None
        self.streams.clear()
        self._blocked.clear()
        self._events.append(ConnectionFailed(code, reason))


def _unpad(payload: bytes, flags: int) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise _ConnectionError(PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1:len(payload) - payload[0]]


__all__ = ["Limits", "ServerConnection"]
