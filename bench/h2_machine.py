"""python-hyper's `h2` (the sans-IO HTTP/2 library of hypercorn and httpx) behind the interface of
`serve.http2.machine.ServerConnection`, so the gRPC port can run on it unchanged: what
`bench/serve_bench.py --grpc-transports` measures against the server's own machine.

Only what a benchmark needs: requests, bodies, answers within the client's windows (the rest
queued until WINDOW_UPDATE), resets, GOAWAY (sent as a frame of our own, because h2's
`close_connection` ends every open stream and the drain answers them after it). The server's own
flood budgets, the per-turn frame budget included, are not reproduced: h2 has none, so a speed
figure is all this can show.
"""

from __future__ import annotations

import collections

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import GoAwayFrame

from serve.http2 import events as ours
from serve.http2.frames import DEFAULT_WINDOW, REFUSED_STREAM
from serve.http2.headers import RequestHead
from serve.http2.machine import Limits


class H2Machine:
    """One server connection on `h2.connection.H2Connection`, speaking `ServerConnection`'s interface."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self._conn = h2.connection.H2Connection(config=config)
        self._out: list[bytes] = []
        self._pending: dict[int, list] = {}
        """Answers waiting for the client's windows: stream id -> [body bytes, end_stream, trailers]."""
        self._uncredited: collections.deque = collections.deque()
        """(stream id, bytes) the shell credited on the stream but not yet on the connection."""
        self._connection_credit = 0
        self._received = 0
        self._known: set[int] = set()
        self._goaway_last: int | None = None
        self.started = self.goaway_sent = self.peer_goaway = self.terminated = False
        self.header_block_open = False
        self.data_sent = 0
        self.last_stream = 0

    @property
    def output_blocked(self) -> bool:
        return bool(self._pending)

    def data_to_send(self) -> bytes:
        self._out.append(self._conn.data_to_send())
        out, self._out = b"".join(self._out), []
        return out

    def _drain_h2(self) -> None:
        data = self._conn.data_to_send()
        if data:
            self._out.append(data)

    # -- input -----------------------------------------------------------------------------------

    def initiate(self) -> None:
        settings = h2.settings.SettingCodes
        limits = self.limits
        self._conn.local_settings = h2.settings.Settings(client=False, initial_values={
            settings.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            settings.INITIAL_WINDOW_SIZE: limits.stream_window,
            settings.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
        })
        self._conn.initiate_connection()
        if limits.connection_window > DEFAULT_WINDOW:
            self._conn.increment_flow_control_window(limits.connection_window - DEFAULT_WINDOW)

    @property
    def backlogged(self) -> bool:
        """Never: h2 parses every frame it is given (no per-turn frame budget)."""
        return False

    def receive(self, data: bytes, max_frames: int | None = None) -> list:  # noqa: ARG002 - see backlogged
        if self.terminated:
            return []
        self._received += len(data)
        self.started = self.started or self._received >= 24
        try:
            raw = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 has queued GOAWAY already
            self.terminated = True
            return [ours.ConnectionFailed(int(getattr(exc, "error_code", 1)), str(exc))]
        self.header_block_open = bool(getattr(self._conn, "_header_frames", None))
        events = []
        for event in raw:
            kind = type(event)
            if kind is h2.events.RequestReceived:
                events.append(self._request(event))
            elif kind is h2.events.DataReceived:
                events.append(ours.DataReceived(event.stream_id, event.data, event.stream_ended is not None))
            elif kind is h2.events.TrailersReceived:
                events.append(ours.TrailersReceived(event.stream_id))
            elif kind is h2.events.StreamReset:
                self._forget(event.stream_id)
                events.append(ours.StreamReset(event.stream_id, event.error_code, event.remote_reset))
            elif kind is h2.events.ConnectionTerminated:
                self.peer_goaway = True
                events.append(ours.ConnectionTerminated(event.error_code, event.last_stream_id or 0,
                                                        event.additional_data or b""))
            elif kind in (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged):
                self._flush_pending()
        return [e for e in events if e is not None]

    def _request(self, event: h2.events.RequestReceived):  # noqa: ANN202 - one of our events or None
        stream_id = event.stream_id
        self.last_stream = max(self.last_stream, stream_id)
        if self._goaway_last is not None and stream_id > self._goaway_last:
            self._conn.reset_stream(stream_id, REFUSED_STREAM)
            return ours.RequestRefused(stream_id, REFUSED_STREAM, "after GOAWAY")
        pseudo, fields, length = {}, [], None
        for name, value in event.headers:
            if name[:1] == b":":
                pseudo[name] = value
            else:
                fields.append((name, value))
                if name == b"content-length":
                    length = int(value)
        head = RequestHead(pseudo.get(b":method", b""), pseudo.get(b":scheme", b""),
                           pseudo.get(b":authority", b""), pseudo.get(b":path", b""), tuple(fields), length)
        self._known.add(stream_id)
        return ours.RequestReceived(stream_id, head, event.stream_ended is not None)

    def credit_stream(self, stream_id: int, size: int) -> None:
        if size:
            self._uncredited.append([stream_id, size])

    def credit_connection(self, size: int) -> None:
        while size and self._uncredited:
            entry = self._uncredited[0]
            take = min(size, entry[1])
            self._conn.acknowledge_received_data(take, entry[0])  # the stream's and the connection's window
            size -= take
            entry[1] -= take
            if not entry[1]:
                self._uncredited.popleft()
        self._connection_credit += size
        if self._connection_credit >= self.limits.connection_window // 2:
            self._conn.increment_flow_control_window(self._connection_credit)
            self._connection_credit = 0

    # -- output ----------------------------------------------------------------------------------

    def send_headers(self, stream_id: int, fields, end_stream: bool = False) -> None:  # noqa: ANN001
        if stream_id in self._known:
            self._conn.send_headers(stream_id, list(fields), end_stream=end_stream)
            if end_stream:
                self._forget(stream_id)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        if stream_id in self._known:
            pending = self._pending.setdefault(stream_id, [b"", False, None])
            pending[0] += data
            pending[1] = end_stream
            self._flush(stream_id)

    def send_trailers(self, stream_id: int, fields) -> None:  # noqa: ANN001
        if stream_id in self._known:
            pending = self._pending.setdefault(stream_id, [b"", False, None])
            pending[2] = list(fields)
            self._flush(stream_id)

    def respond(self, stream_id: int, headers, body: bytes, trailers) -> None:  # noqa: ANN001
        self.send_headers(stream_id, headers)
        self.send_data(stream_id, body)
        self.send_trailers(stream_id, trailers)

    def reset_stream(self, stream_id: int, code: int = 0) -> None:
        if stream_id in self._known:
            self._conn.reset_stream(stream_id, code)
            self._forget(stream_id)

    def goaway(self, code: int = 0, debug: str = "") -> None:
        self.goaway_sent = True
        self._goaway_last = self.last_stream
        self._drain_h2()  # keep the frames in order
        frame = GoAwayFrame(stream_id=0)
        frame.last_stream_id, frame.error_code, frame.additional_data = self.last_stream, code, debug.encode()[:256]
        self._out.append(frame.serialize())

    def _flush(self, stream_id: int) -> None:
        body, end_stream, trailers = self._pending[stream_id]
        conn = self._conn
        ended = False
        while body:
            room = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size, len(body))
            if room <= 0:
                self._pending[stream_id][0] = body
                return
            ended = room == len(body) and end_stream and trailers is None
            conn.send_data(stream_id, body[:room], end_stream=ended)
            self.data_sent += room
            body = body[room:]
        if trailers is not None:
            conn.send_headers(stream_id, trailers, end_stream=True)
        elif end_stream and not ended:
            conn.end_stream(stream_id)
        elif not end_stream:
            self._pending[stream_id][0] = b""
            return
        self._forget(stream_id)

    def _flush_pending(self) -> None:
        for stream_id in list(self._pending):
            if stream_id in self._pending:
                self._flush(stream_id)

    def _forget(self, stream_id: int) -> None:
        self._known.discard(stream_id)
        self._pending.pop(stream_id, None)
