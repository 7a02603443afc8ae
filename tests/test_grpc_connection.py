"""The gRPC port's connections (`serve.grpc.connection`: the asyncio shell around the HTTP/2 machine)
without a model: real sockets, a real `ConnectionHost`, grpcio's own client for what clients do and a
raw HTTP/2 client (frames by hand, `hpack`) for what the protocol allows and abusers try. The methods
are test methods; the served ones are tested with the real server in test_grpc.py and
test_grpc_v2.py, the machine alone in test_http2_machine.py, floods against `python -m serve` in
test_grpc_abuse.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import logging
import socket
import struct
import threading
import time
from typing import Iterator

import grpc
import hpack
import pytest

from serve.core.errors import Code
from serve.grpc.calls import ECHO_LIMIT, Method, RpcError
from serve.grpc.connection import GrpcConnection, GrpcService
from serve.host import ConnectionHost, PortLimits
from serve.http2 import Limits
from serve.http2.frames import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
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
    WINDOW_UPDATE,
    frame,
)

LIMITS = PortLimits(max_connections=8, header_timeout_s=0.5, body_timeout_s=0.3, idle_timeout_s=30,
                    send_timeout_s=1.0, max_header_bytes=4096, max_body_bytes=4 << 20)


class _Port:
    """A gRPC port of test methods on a loop of its own: the host and service a worker's
    `serve.grpc.server.GrpcServer` would make."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: PortLimits, http2: Limits) -> None:
        self.loop = loop
        self.host = ConnectionHost("gRPC", limits)
        self.host.start()
        self.cancelled = 0
        methods = {
            "/test.T/Echo": Method(self.echo),
            "/test.T/Big": Method(self.big),
            "/test.T/Slow": Method(self.slow),
            "/test.T/Later": Method(self.later),
            "/test.T/Fail": Method(self.fail),
            "/test.T/Deadline": Method(self.deadline),
            "/test.T/Count": Method(self.count, streaming=True),
        }
        self.service = GrpcService(methods, http2, limits.max_body_bytes, limits.max_header_bytes)

    async def echo(self, raw: bytes, _call) -> bytes:  # noqa: ANN001
        return raw

    async def big(self, raw: bytes, _call) -> bytes:  # noqa: ANN001
        return bytes(range(256)) * (int(raw) // 256) + b"x" * (int(raw) % 256)

    async def slow(self, _raw: bytes, _call) -> bytes:  # noqa: ANN001
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return b""

    async def later(self, _raw: bytes, _call) -> bytes:  # noqa: ANN001
        await asyncio.sleep(0.3)
        return b"done"

    async def fail(self, _raw: bytes, _call) -> bytes:  # noqa: ANN001
        raise RpcError(Code.NOT_FOUND, "no model 'ünï' (100% missing)\nsecond line")

    async def deadline(self, _raw: bytes, call) -> bytes:  # noqa: ANN001
        return repr(call.time_remaining()).encode()

    async def count(self, raw: bytes, _call):  # noqa: ANN001, ANN201 - an async generator
        for i in range(int(raw)):
            yield str(i).encode()
            await asyncio.sleep(0)

    def protocol_factory(self) -> GrpcConnection:
        return GrpcConnection(self.host, self.service)


@contextlib.contextmanager
def _serving(limits: PortLimits = LIMITS, http2: Limits = Limits(max_header_list_bytes=4096)) -> Iterator[_Port]:
    loop = asyncio.new_event_loop()

    async def start() -> _Port:
        port = _Port(loop, limits, http2)
        listening = await loop.create_server(port.protocol_factory, "127.0.0.1", 0)
        port.number = listening.sockets[0].getsockname()[1]
        return port

    port = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield port
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture(scope="module")
def port() -> Iterator[_Port]:
    with _serving() as server:
        yield server


def _call(port: _Port, method: str, request: bytes, timeout: float = 10, **options) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port.number}", options=list(options.items())) as channel:
        return channel.unary_unary(method)(request, timeout=timeout)


def _wait(condition, timeout: float = 5.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    assert condition()


# -- grpcio's client ------------------------------------------------------------------------------

def test_large_messages_both_ways_pass_the_flow_control_windows(port):
    request = bytes(range(256)) * (3 << 12)  # 3 MiB: 190 DATA frames, past the stream window (1 MiB)
    assert _call(port, "/test.T/Echo", request) == request
    answer = _call(port, "/test.T/Big", b"3000000")  # past grpcio's initial 64 KiB window
    assert len(answer) == 3_000_000 and answer[:256] == bytes(range(256))


def test_errors_keep_their_code_and_message(port):
    with pytest.raises(grpc.RpcError) as info:
        _call(port, "/test.T/Fail", b"")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no model 'ünï' (100% missing)\nsecond line"


@pytest.mark.parametrize("code", list(Code)[1:])
def test_status_numbers_are_grpcs(code):
    assert grpc.StatusCode[code.name].value[0] == code.value


def test_unknown_methods_are_unimplemented(port, caplog):
    caplog.set_level(logging.INFO, logger="serve.host")
    with pytest.raises(grpc.RpcError) as info:
        _call(port, "/no.Such/Method", b"abc")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "/no.Such/Method" in info.value.details()
    assert "/no.Such/Method: not implemented by this server" in caplog.text  # one line, no traceback
    assert "Traceback" not in caplog.text


def test_an_error_repeats_little_of_what_was_sent(port):
    with pytest.raises(grpc.RpcError) as info:
        _call(port, "/no.Such/" + "M" * 3000, b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert len(info.value.details()) < ECHO_LIMIT + 100 and "MMMM..." in info.value.details()


def test_the_path_is_read_as_utf8(port):
    with pytest.raises(grpc.RpcError) as info:
        _call(port, "/no.Such/Méthode", b"")
    assert "/no.Such/Méthode" in info.value.details()


def test_the_deadline_reaches_the_handler(port):
    remaining = float(_call(port, "/test.T/Deadline", b"", timeout=5))
    assert 3 < remaining <= 5.1  # grpcio rounds its grpc-timeout up a little
    assert _call(port, "/test.T/Deadline", b"", timeout=None) == b"None"


def test_a_call_the_client_gives_up_on_is_cancelled_on_the_server(port):
    before = port.cancelled
    with pytest.raises(grpc.RpcError) as info:
        _call(port, "/test.T/Slow", b"", timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait(lambda: port.cancelled == before + 1 and not port.host.tasks)


def test_server_streaming(port):
    with grpc.insecure_channel(f"127.0.0.1:{port.number}") as channel:
        answers = list(channel.unary_stream("/test.T/Count")(b"5", timeout=10))
    assert answers == [b"0", b"1", b"2", b"3", b"4"]


def test_a_message_over_the_limit_is_resource_exhausted(port):
    with pytest.raises(grpc.RpcError) as info:
        _call(port, "/test.T/Echo", b"x" * ((4 << 20) + 1))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-body-bytes" in info.value.details()


def test_many_concurrent_calls_on_one_channel(port):
    with grpc.insecure_channel(f"127.0.0.1:{port.number}") as channel:
        echo = channel.unary_unary("/test.T/Echo")
        futures = [echo.future(str(i).encode() * 100, timeout=10) for i in range(300)]
        assert [f.result() for f in futures] == [str(i).encode() * 100 for i in range(300)]



def test_the_benchmarks_h2_adapter_still_speaks_the_machines_interface(monkeypatch):
    """bench/serve_bench.py --grpc-transports h2 swaps the machine for python-hyper's h2 through
    GrpcConnection.machine_class: a change to the interface the shell uses must not leave it behind."""
    pytest.importorskip("h2")
    from bench.h2_machine import H2Machine

    monkeypatch.setattr(GrpcConnection, "machine_class", H2Machine)
    with _serving() as h2_port:
        request = bytes(range(256)) * (3 << 12)
        assert _call(h2_port, "/test.T/Echo", request) == request
        assert len(_call(h2_port, "/test.T/Big", b"3000000")) == 3_000_000
        with pytest.raises(grpc.RpcError) as failed:
            _call(h2_port, "/test.T/Fail", b"")
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND

# -- a raw HTTP/2 client --------------------------------------------------------------------------

class Raw:
    """An HTTP/2 client written out by hand: frames in, frames out."""

    def __init__(self, port: _Port, settings: dict[int, int] | None = None, preface: bytes = PREFACE) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port.number), timeout=5)
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.buffer = b""
        payload = b"".join(struct.pack(">HL", k, v) for k, v in (settings or {}).items())
        self.sock.sendall(preface + (frame(SETTINGS, 0, 0, payload) if preface == PREFACE else b""))

    def call(self, stream_id: int, path: str, message: bytes | None, *, extra=(), flag: int = 0) -> None:  # noqa: ANN001
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "t"),
                   ("content-type", "application/grpc"), ("te", "trailers"), *extra]
        out = frame(HEADERS, END_HEADERS | (END_STREAM if message is None else 0), stream_id,
                    self.encoder.encode(headers))
        if message is not None:
            out += frame(DATA, END_STREAM, stream_id, bytes((flag,)) + struct.pack(">L", len(message)) + message)
        self.sock.sendall(out)

    def frame(self) -> tuple[int, int, int, bytes] | None:
        """The next frame (type, flags, stream, payload), or None once the server closed."""
        while len(self.buffer) < 9 or len(self.buffer) < 9 + int.from_bytes(self.buffer[:3], "big"):
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data
        length = int.from_bytes(self.buffer[:3], "big")
        head, self.buffer = self.buffer[:9 + length], self.buffer[9 + length:]
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, head[9:]

    def until(self, kind: int, stream_id: int | None = None) -> list[tuple[int, int, int, bytes]]:
        """Frames up to and including the first of `kind` (on `stream_id`); fails if the server closes first."""
        seen = []
        while True:
            f = self.frame()
            assert f is not None, f"closed before a frame of type {kind}: {seen}"
            seen.append(f)
            if f[0] == kind and (stream_id is None or f[2] == stream_id):
                return seen

    def headers(self, payload: bytes) -> dict[str, str]:
        return dict(self.decoder.decode(payload))

    def closed(self) -> bool:
        try:
            while (f := self.frame()) is not None:
                if f[0] not in (SETTINGS, WINDOW_UPDATE, GOAWAY):
                    return False
            return True
        except ConnectionResetError:
            return True


def _goaway(frames) -> tuple[int, int]:  # noqa: ANN001
    payload = next(f[3] for f in frames if f[0] == GOAWAY)
    return struct.unpack(">LL", payload[:8])


def test_not_http2_is_a_protocol_error(port):
    raw = Raw(port, preface=b"POST / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _goaway(raw.until(GOAWAY))[1] == PROTOCOL_ERROR
    assert raw.closed()


def test_a_client_that_sends_nothing_is_closed_after_the_header_timeout(port):
    sock = socket.create_connection(("127.0.0.1", port.number), timeout=5)
    start = time.monotonic()
    while sock.recv(65536):
        pass
    assert 0.4 < time.monotonic() - start < 3


def test_an_answer_waits_for_the_clients_window(port):
    raw = Raw(port, {SETTINGS_INITIAL_WINDOW_SIZE: 100})
    raw.call(1, "/test.T/Big", b"1000")
    frames = raw.until(DATA, 1)
    assert raw.headers(next(f[3] for f in frames if f[0] == HEADERS))[":status"] == "200"
    assert len(frames[-1][3]) == 100  # the stream window, not more
    raw.sock.settimeout(0.3)
    with pytest.raises(socket.timeout):
        raw.frame()
    raw.sock.settimeout(5)
    raw.sock.sendall(frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 2000)))
    rest = raw.until(HEADERS, 1)
    data = b"".join(f[3] for f in rest if f[0] == DATA)
    assert len(frames[-1][3]) + len(data) == 1005  # the 5-byte prefix and 1000 bytes
    assert rest[-1][1] & END_STREAM and raw.headers(rest[-1][3])["grpc-status"] == "0"


def test_trailers_carry_the_status(port):
    raw = Raw(port)
    raw.call(1, "/test.T/Echo", b"hi")
    frames = raw.until(HEADERS, 1)  # response headers
    assert raw.headers(frames[-1][3])[":status"] == "200"
    frames = raw.until(HEADERS, 1)  # trailers
    assert frames[-1][1] & END_STREAM and raw.headers(frames[-1][3])["grpc-status"] == "0"
    assert b"".join(f[3] for f in frames if f[0] == DATA) == b"\x00\x00\x00\x00\x02hi"


def test_calls_past_the_stream_limit_are_refused():
    with _serving(http2=Limits(max_concurrent_streams=3)) as port:
        raw = Raw(port)
        for stream_id in (1, 3, 5, 7):
            raw.call(stream_id, "/test.T/Slow", b"")
        frames = raw.until(RST_STREAM, 7)
        assert struct.unpack(">L", frames[-1][3])[0] == REFUSED_STREAM
        raw.sock.close()
        _wait(lambda: not port.host.tasks and port.cancelled == 3)


def test_a_flood_of_resets_closes_the_connection():
    with _serving(http2=Limits(resets_per_s=50)) as port:
        _rapid_reset(port)
        _wait(lambda: not port.host.tasks)


def _rapid_reset(port: _Port) -> None:
    raw = Raw(port)
    out = b""
    for i in range(51):
        stream_id = 2 * i + 1
        out += frame(HEADERS, END_HEADERS, stream_id, raw.encoder.encode([(":method", "POST"), (":path", "/test.T/Slow"),
                                                                          ("content-type", "application/grpc")]))
        out += frame(RST_STREAM, 0, stream_id, struct.pack(">L", 8))  # CANCEL
    raw.sock.sendall(out)
    assert _goaway(raw.until(GOAWAY))[1] == ENHANCE_YOUR_CALM
    assert raw.closed()


def test_headers_past_the_limit_are_resource_exhausted_then_goaway(port):
    raw = Raw(port)
    raw.call(1, "/test.T/Echo", b"x", extra=[("x-big", "y" * 5000)])
    frames = raw.until(HEADERS, 1)
    answer = raw.headers(frames[-1][3])  # trailers-only
    assert frames[-1][1] & END_STREAM and answer[":status"] == "200"
    assert answer["grpc-status"] == str(Code.RESOURCE_EXHAUSTED.value) and "--grpc-max-header-bytes" in answer["grpc-message"]
    assert _goaway(frames)[1] == ENHANCE_YOUR_CALM  # sent first: the header table is out of step
    assert raw.closed()


def test_compressed_requests_are_inflated_within_the_limit(port):
    request = b"a compressible request " * 1000
    assert _call_compressed(port, "/test.T/Echo", request) == request
    with pytest.raises(grpc.RpcError) as info:  # 5 MiB of zeros: 5 KB on the wire, past the 4 MiB limit inflated
        _call_compressed(port, "/test.T/Echo", bytes(5 << 20))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "decompressed" in info.value.details()


def _call_compressed(port: _Port, method: str, request: bytes) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port.number}", compression=grpc.Compression.Gzip) as channel:
        return channel.unary_unary(method)(request, timeout=10)


@pytest.mark.parametrize("encoding, payload, code, words", [
    ("br", b"\x1f\x8b", Code.UNIMPLEMENTED, "not supported"),
    ("gzip", b"not gzip at all", Code.INTERNAL, "not valid gzip"),
    ("gzip", gzip.compress(b"cut short")[:-12], Code.INTERNAL, "truncated"),
])
def test_unreadable_compressed_messages(port, encoding, payload, code, words):
    raw = Raw(port)
    raw.call(1, "/test.T/Echo", payload, extra=[("grpc-encoding", encoding)], flag=1)
    trailers = raw.headers(raw.until(HEADERS, 1)[-1][3])
    assert trailers["grpc-status"] == str(code.value) and words in trailers["grpc-message"], trailers


def test_ping_is_answered_and_settings_acknowledged(port):
    raw = Raw(port)
    raw.sock.sendall(frame(PING, 0, 0, b"12345678"))
    frames = raw.until(PING)
    assert frames[-1][1] & ACK and frames[-1][3] == b"12345678"
    assert any(f[0] == SETTINGS and f[1] & ACK for f in frames)


def test_goaway_on_drain_lets_the_running_call_finish(port):
    raw = Raw(port)
    raw.call(1, "/test.T/Later", b"")
    _wait(lambda: port.host.tasks)
    here = "%s:%d" % raw.sock.getsockname()
    connection = next(c for c in list(port.host.connections) if c.peer == here)
    port.loop.call_soon_threadsafe(connection.drain)
    assert _goaway(raw.until(GOAWAY)) == (1, NO_ERROR)
    raw.call(3, "/test.T/Echo", b"late")  # sent after GOAWAY: refused, never run
    frames = raw.until(RST_STREAM, 3)
    assert struct.unpack(">L", frames[-1][3])[0] == REFUSED_STREAM
    frames += raw.until(HEADERS, 1)
    frames += raw.until(HEADERS, 1)
    assert b"".join(f[3] for f in frames if f[0] == DATA and f[2] == 1) == b"\x00\x00\x00\x00\x04done"
    assert raw.closed()


def test_connections_past_the_limit_get_goaway():
    with _serving() as port:
        clients = [Raw(port) for _ in range(LIMITS.max_connections)]
        _wait(lambda: port.host.open == LIMITS.max_connections)
        refused = Raw(port)  # all the others are new: none is evicted
        assert _goaway(refused.until(GOAWAY))[1] == ENHANCE_YOUR_CALM
        assert refused.closed() and port.host.events["refused"] == 1
        clients.pop().sock.close()  # room for one more
        _wait(lambda: port.host.open == LIMITS.max_connections - 1)
        again = Raw(port)
        again.call(1, "/test.T/Echo", b"in")
        assert b"in" in b"".join(f[3] for f in again.until(HEADERS, 1) + again.until(HEADERS, 1) if f[0] == DATA)


def test_a_request_message_must_follow_its_headers_in_time(port):
    raw = Raw(port)
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/test.T/Echo"), ("content-type", "application/grpc")]
    raw.sock.sendall(frame(HEADERS, END_HEADERS, 1, raw.encoder.encode(headers)))  # and no message
    raw.sock.sendall(frame(HEADERS, END_HEADERS, 3, raw.encoder.encode(headers)))
    time.sleep(0.1)  # the message of call 3 comes later, in time
    raw.sock.sendall(frame(DATA, END_STREAM, 3, b"\x00\x00\x00\x00\x02ok"))
    start = time.monotonic()
    frames = raw.until(HEADERS, 1)
    assert 0.1 < time.monotonic() - start < 2
    answer = raw.headers(next(f[3] for f in frames if f[0] == HEADERS and f[2] == 1))
    assert answer["grpc-status"] == str(Code.DEADLINE_EXCEEDED.value) and "--body-timeout" in answer["grpc-message"]
    assert any(f[0] == DATA and f[2] == 3 and f[3].endswith(b"ok") for f in frames)  # call 3 was answered
    assert struct.unpack(">L", raw.until(RST_STREAM, 1)[-1][3])[0] == NO_ERROR  # stop sending


def test_a_request_that_is_not_grpc_gets_a_complete_http_answer(port):
    raw = Raw(port)
    raw.sock.sendall(frame(HEADERS, END_HEADERS | END_STREAM, 1, raw.encoder.encode(
        [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "t")])))
    frames = raw.until(DATA, 1)
    answer = raw.headers(next(f[3] for f in frames if f[0] == HEADERS))
    assert answer[":status"] == "405" and answer["allow"] == "POST"
    assert frames[-1][1] & END_STREAM and b"this port speaks gRPC" in frames[-1][3]


def test_an_unfinished_header_block_has_a_deadline(port):
    raw = Raw(port)
    raw.sock.sendall(frame(HEADERS, 0, 1, raw.encoder.encode([(":method", "POST")])))  # no END_HEADERS, ever
    start = time.monotonic()
    _, code = _goaway(raw.until(GOAWAY))
    assert code == ENHANCE_YOUR_CALM and 0.4 < time.monotonic() - start < 3
    assert raw.closed()


def test_a_connection_without_calls_is_closed_after_the_idle_timeout():
    with _serving(dataclasses.replace(LIMITS, idle_timeout_s=0.5)) as port:
        raw = Raw(port)
        raw.call(1, "/test.T/Echo", b"one")
        raw.until(HEADERS, 1), raw.until(HEADERS, 1)
        start = time.monotonic()
        assert _goaway(raw.until(GOAWAY)) == (1, NO_ERROR)  # clients reconnect after it
        assert 0.4 < time.monotonic() - start < 3 and raw.closed()
        assert port.host.events["idle_closed"] == 1


def test_an_answer_left_unread_closes_the_connection_after_the_send_timeout(port):
    raw = Raw(port, {SETTINGS_INITIAL_WINDOW_SIZE: 0})  # and no WINDOW_UPDATE will come
    raw.call(1, "/test.T/Big", b"1000")
    raw.until(HEADERS, 1)
    start = time.monotonic()
    assert raw.closed()  # aborted: nothing of the answer could go out
    assert 0.9 < time.monotonic() - start < 4 and port.host.events["send_timeout"] >= 1


def test_an_idle_connection_makes_room_at_the_limit():
    with _serving() as port:
        idle = [Raw(port) for _ in range(LIMITS.max_connections)]
        _wait(lambda: port.host.open == LIMITS.max_connections)
        time.sleep(1.1)  # idle for longer than serve.host.EVICT_AFTER_S
        newcomer = Raw(port)
        newcomer.call(1, "/test.T/Echo", b"in")
        assert b"in" in b"".join(f[3] for f in newcomer.until(HEADERS, 1) + newcomer.until(HEADERS, 1) if f[0] == DATA)
        assert _goaway(idle[0].until(GOAWAY))[1] == NO_ERROR and idle[0].closed()  # the oldest one made room
        assert port.host.events["evicted"] == 1 and port.host.open == LIMITS.max_connections
