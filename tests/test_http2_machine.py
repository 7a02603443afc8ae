"""The sans-IO HTTP/2 machine (`serve.http2`) by feeding it bytes: no socket, no loop, a clock of
the test's own. What h2spec checks of the protocol runs in test_h2spec.py against the real port;
these pin the limits and the events the gRPC shell relies on."""

from __future__ import annotations

import struct

import hpack
import pytest

from serve.http2 import Limits, ServerConnection
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
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    frame,
)
from serve.http2.headers import HeaderDecoder, request_head

GRPC = [(":method", "POST"), (":scheme", "http"), (":path", "/p.S/M"), (":authority", "h"),
        ("content-type", "application/grpc"), ("te", "trailers")]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Peer:
    """A client in front of one machine: frames in, the machine's frames and events out."""

    def __init__(self, limits: Limits = Limits(), settings: bytes = b"") -> None:
        self.clock = Clock()
        self.machine = ServerConnection(limits, clock=self.clock)
        self.machine.initiate()
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.send(PREFACE + frame(SETTINGS, 0, 0, settings))
        assert self.kinds() == [SETTINGS, WINDOW_UPDATE, SETTINGS]  # ours, the window, the ACK of theirs

    def send(self, data: bytes) -> list:
        events = self.machine.receive(data)
        out = self.machine.data_to_send()
        while out:
            length = int.from_bytes(out[:3], "big")
            self.frames.append((out[3], out[4], int.from_bytes(out[5:9], "big"), out[9:9 + length]))
            out = out[9 + length:]
        return events

    def headers(self, stream_id: int, fields=GRPC, end_stream: bool = False) -> list:  # noqa: ANN001
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        return self.send(frame(HEADERS, flags, stream_id, self.encoder.encode(fields)))

    def kinds(self) -> list[int]:
        kinds = [f[0] for f in self.frames]
        self.frames.clear()
        return kinds

    def goaway(self) -> tuple[int, bytes]:
        payload = next(f[3] for f in self.frames if f[0] == GOAWAY)
        return struct.unpack(">L", payload[4:8])[0], payload[8:]

    def reset_code(self, stream_id: int) -> int:
        return struct.unpack(">L", next(f[3] for f in self.frames if f[0] == RST_STREAM and f[2] == stream_id))[0]


def test_a_request_becomes_events_and_its_answer_frames():
    peer = Peer()
    events = peer.headers(1)
    assert [type(e) for e in events] == [RequestReceived] and not events[0].end_stream
    head = events[0].head
    assert head.path == b"/p.S/M" and head.get(b"content-type") == b"application/grpc"
    assert peer.send(frame(DATA, END_STREAM, 1, b"\0\0\0\0\1x")) == [DataReceived(1, b"\0\0\0\0\1x", True)]
    peer.machine.respond(1, [(b":status", b"200")], b"answer", [(b"grpc-status", b"0")])
    peer.send(b"")
    assert [(k, f & END_STREAM) for k, f, _, _ in peer.frames] == [(HEADERS, 0), (DATA, 0), (HEADERS, END_STREAM)]
    assert peer.decoder.decode(peer.frames[2][3]) == [("grpc-status", "0")]


def test_the_path_is_read_as_utf8():
    peer = Peer()
    [event] = peer.headers(1, [*GRPC[:2], (":path", "/é"), *GRPC[3:]], end_stream=True)
    assert event.head.path.decode() == "/é"


@pytest.mark.parametrize("fields, words", [
    ([*GRPC, ("Upper", "x")], "upper-case"),
    ([f for f in GRPC if f[0] != ":path"], ":path"),
    ([*GRPC, ("connection", "close")], "connection"),
    ([*GRPC[:5], ("te", "gzip")], "te"),
    ([("content-type", "application/grpc"), *GRPC[:5]], "pseudo"),
])
def test_malformed_requests_are_refused_with_protocol_error(fields, words):
    peer = Peer()
    [event] = peer.headers(1, fields, end_stream=True)
    assert type(event) is RequestRefused and event.code == PROTOCOL_ERROR and words in event.reason.lower()
    assert peer.reset_code(1) == PROTOCOL_ERROR
    assert type(peer.headers(3, end_stream=True)[0]) is RequestReceived  # the connection goes on


def test_content_length_must_match_the_data():
    peer = Peer()
    peer.headers(1, [*GRPC, ("content-length", "3")])
    [event] = peer.send(frame(DATA, END_STREAM, 1, b"four"))
    assert type(event) is StreamReset and event.code == PROTOCOL_ERROR and not event.remote


def test_stream_ids_must_grow():
    peer = Peer()
    peer.headers(5, end_stream=True)
    [event] = peer.headers(3, end_stream=True)
    assert type(event) is ConnectionFailed and peer.goaway()[0] == PROTOCOL_ERROR
    assert peer.machine.terminated and peer.headers(7) == []  # nothing more is read


def test_frames_on_a_stream_closed_by_the_client_are_stream_closed():
    peer = Peer()
    peer.headers(1, end_stream=True)
    peer.frames.clear()
    assert peer.send(frame(DATA, 0, 1, b"late")) == [StreamReset(1, STREAM_CLOSED, False, "DATA after the end of the stream")]
    assert peer.reset_code(1) == STREAM_CLOSED


def test_no_reset_for_a_stream_that_is_already_closed():
    peer = Peer()
    peer.headers(1, end_stream=True)
    peer.machine.respond(1, [(b":status", b"200")], b"", [(b"grpc-status", b"0")])
    peer.machine.reset_stream(1, NO_ERROR)  # both sides have ended it: nothing to reset
    peer.send(b"")
    assert RST_STREAM not in peer.kinds()


def test_a_client_past_its_window_gets_flow_control_error():
    peer = Peer(Limits(stream_window=1000, connection_window=1 << 20))
    peer.headers(1)
    [event] = peer.send(frame(DATA, 0, 1, b"x" * 1000))
    assert type(event) is DataReceived
    events = peer.send(frame(DATA, 0, 1, b"x"))  # never credited: one byte past the stream's window
    assert [(type(e), e.code) for e in events] == [(StreamReset, FLOW_CONTROL_ERROR)]
    peer = Peer(Limits(stream_window=1 << 20, connection_window=1 << 17))
    peer.headers(1)
    sent = 0
    while not peer.machine.terminated:
        events = peer.send(frame(DATA, 0, 1, b"y" * 16384))
        peer.machine.credit_stream(1, 16384)  # the stream is credited, the connection never
        sent += 16384
    assert sent == 9 * 16384 and type(events[-1]) is ConnectionFailed  # 8 fill its 128 KiB
    assert peer.goaway()[0] == FLOW_CONTROL_ERROR


def test_credited_data_reopens_the_window():
    peer = Peer(Limits(stream_window=1000, connection_window=1 << 20))
    peer.headers(1)
    for _ in range(5):
        assert type(peer.send(frame(DATA, 0, 1, b"x" * 1000))[0]) is DataReceived
        peer.machine.credit_stream(1, 1000)
        peer.machine.credit_connection(1000)
        peer.send(b"")
    assert WINDOW_UPDATE in peer.kinds()


def test_an_answer_waits_for_the_clients_window():
    peer = Peer(settings=struct.pack(">HL", SETTINGS_INITIAL_WINDOW_SIZE, 10))
    peer.headers(1, end_stream=True)
    peer.machine.respond(1, [(b":status", b"200")], b"y" * 25, [(b"grpc-status", b"0")])
    peer.send(b"")
    assert [len(f[3]) for f in peer.frames if f[0] == DATA] == [10] and peer.machine.output_blocked
    peer.frames.clear()
    peer.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 100)))
    assert [len(f[3]) for f in peer.frames if f[0] == DATA] == [15] and peer.frames[-1][1] & END_STREAM
    assert not peer.machine.output_blocked and peer.machine.data_sent == 25


def test_a_window_past_2_31_is_a_flow_control_error():
    peer = Peer()
    peer.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1)))
    assert type(peer.send(b"")) is list and peer.goaway()[0] == FLOW_CONTROL_ERROR


def test_a_ping_flood_that_is_never_read_ends_with_enhance_your_calm():
    limits = Limits(control_burst=50, control_per_s=10)
    peer = Peer(limits)
    pings = frame(PING, 0, 0, b"12345678") * 49  # the budget less the client's SETTINGS
    assert peer.send(pings) == [] and peer.kinds().count(PING) == 49  # a burst is answered
    peer.clock.now += 1  # ten more refilled
    assert peer.send(frame(PING, 0, 0, b"12345678") * 10) == []
    assert [type(e) for e in peer.send(frame(PING, 0, 0, b"12345678"))] == [ConnectionFailed]
    assert peer.goaway() == (ENHANCE_YOUR_CALM, b"too many PING frames")


def test_requests_refill_the_control_budget():
    peer = Peer(Limits(control_burst=10, control_per_s=0))
    for stream_id in range(1, 40, 2):
        peer.send(frame(PING, 0, 0, b"12345678"))
        peer.headers(stream_id, end_stream=True)
        peer.machine.respond(stream_id, [(b":status", b"200")], b"", [(b"grpc-status", b"0")])
    assert not peer.machine.terminated


def test_a_ping_on_a_stream_is_a_protocol_error():
    peer = Peer()
    peer.send(frame(PING, 0, 1, b"12345678"))
    assert peer.goaway()[0] == PROTOCOL_ERROR


def test_settings_acks_are_bounded_like_pings():
    peer = Peer(Limits(control_burst=20, control_per_s=0))
    peer.send(frame(SETTINGS, 0, 0) * 25)
    assert peer.machine.terminated and peer.goaway()[0] == ENHANCE_YOUR_CALM


def test_empty_data_frames_in_a_row_are_bounded():
    peer = Peer(Limits(empty_frames=16))
    peer.headers(1)
    assert len(peer.send(frame(DATA, 0, 1) * 16)) == 16
    peer.send(frame(DATA, 0, 1, b"x") + frame(DATA, 0, 1) * 16)  # a non-empty frame starts the count again
    assert not peer.machine.terminated
    peer.send(frame(DATA, 0, 1))
    assert peer.goaway() == (ENHANCE_YOUR_CALM, b"more than 16 empty DATA frames in a row")


def test_continuation_frames_are_counted_per_header_block():
    peer = Peer(Limits(continuations=32))
    peer.send(frame(HEADERS, 0, 1, peer.encoder.encode(GRPC)))
    assert peer.machine.header_block_open
    peer.send(frame(CONTINUATION, 0, 1, b"") * 16)
    assert not peer.machine.terminated
    peer.send(frame(CONTINUATION, 0, 1, b""))
    assert peer.machine.terminated and peer.goaway()[0] == ENHANCE_YOUR_CALM  # empty ones: the empty-frame run
    peer = Peer(Limits(continuations=32))
    peer.send(frame(HEADERS, 0, 1, b""))
    peer.send(b"".join(frame(CONTINUATION, 0, 1, b"\x80" if i % 2 else b"\x20") for i in range(33)))
    assert peer.machine.terminated and peer.goaway()[0] == ENHANCE_YOUR_CALM


def test_a_header_list_past_the_limit_opens_the_stream_then_goaway():
    peer = Peer(Limits(max_header_list_bytes=1024))
    [event] = peer.headers(1, [*GRPC, ("x-big", "y" * 2000)], end_stream=True)
    assert event == HeadersTooLarge(1, True)
    assert peer.goaway()[0] == ENHANCE_YOUR_CALM and peer.machine.goaway_sent
    [event] = peer.headers(3, end_stream=True)  # after our GOAWAY: refused, never run
    assert type(event) is RequestRefused and event.code == REFUSED_STREAM


def test_a_flood_of_resets_ends_the_connection():
    peer = Peer(Limits(resets_per_s=100))
    for stream_id in range(1, 2 * 101, 2):
        events = peer.headers(stream_id) + peer.send(frame(RST_STREAM, 0, stream_id, struct.pack(">L", 8)))
    assert type(events[-1]) is ConnectionFailed and peer.goaway()[0] == ENHANCE_YOUR_CALM


def test_streams_past_the_limit_are_refused():
    peer = Peer(Limits(max_concurrent_streams=2))
    assert [type(peer.headers(i)[0]) for i in (1, 3, 5)] == [RequestReceived, RequestReceived, RequestRefused]
    assert peer.reset_code(5) == REFUSED_STREAM


def test_a_frame_budget_keeps_the_rest_for_the_next_receive():
    peer = Peer()
    block = peer.encoder.encode(GRPC)
    burst = b"".join(frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * i, block) for i in range(10))
    seen = []
    for data in (burst, b"", b""):
        events = peer.machine.receive(data, max_frames=4)
        seen.append(([e.stream_id for e in events], peer.machine.backlogged))
    assert seen == [([1, 3, 5, 7], True), ([9, 11, 13, 15], True), ([17, 19], False)]


def test_trailers_end_the_request_and_the_clients_goaway_is_an_event():
    peer = Peer()
    peer.headers(1)
    peer.send(frame(DATA, 0, 1, b"body"))
    assert peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, peer.encoder.encode([("x-t", "1")]))) == [
        TrailersReceived(1)]
    [event] = peer.send(frame(GOAWAY, 0, 0, struct.pack(">LL", 1, NO_ERROR) + b"bye"))
    assert event == ConnectionTerminated(NO_ERROR, 1, b"bye") and peer.machine.peer_goaway


def test_a_ping_ack_is_not_answered():
    peer = Peer()
    peer.send(frame(PING, ACK, 0, b"12345678"))
    assert peer.kinds() == []


def test_not_http2_is_a_protocol_error():
    machine = ServerConnection()
    machine.initiate()
    [event] = machine.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert type(event) is ConnectionFailed and event.code == PROTOCOL_ERROR


def test_remembered_header_blocks_follow_the_header_table():
    """The same bytes mean other headers once the table changed: the decoder's memory must not
    answer from before the change."""
    decoder, encoder = HeaderDecoder(4096), hpack.Encoder()
    assert decoder.decode(encoder.encode([(":path", "/a")]))[1] == [(b":path", b"/a")]  # inserted: dynamic entry 62
    assert decoder.decode(b"\xbe") is decoder.decode(b"\xbe")  # indexed 62, remembered
    assert decoder.decode(b"\xbe")[1] == [(b":path", b"/a")]
    decoder.decode(encoder.encode([("x-other", "1")]))  # inserted: now entry 62
    assert decoder.decode(b"\xbe")[1] == [(b"x-other", b"1")]
    decoder.decode(b"\x20")  # a table size update to 0 empties the table: entry 62 no longer exists
    with pytest.raises(Exception):  # noqa: B017, PT011 - hpack's error, whichever
        decoder.decode(b"\xbe")


def test_request_head_reads_the_fields_once():
    head = request_head([(k.encode(), v.encode()) for k, v in GRPC])
    assert (head.method, head.scheme, head.authority, head.path) == (b"POST", b"http", b"h", b"/p.S/M")
    assert head.get(b"te") == b"trailers" and head.get(b"absent", b"-") == b"-"
