"""HTTP/2 frame layout (RFC 9113 section 4, 6): types, flags, error codes, settings, and the encoder."""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEAD = struct.Struct(">HBBBL")
"""A frame header: length (24 bits, as 16 + 8), type, flags, stream id (31 bits and a reserved bit)."""

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
FRAME_NAMES = ("DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING", "GOAWAY",
               "WINDOW_UPDATE", "CONTINUATION")

END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

(NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, FRAME_SIZE_ERROR,
 REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, CONNECT_ERROR, ENHANCE_YOUR_CALM, INADEQUATE_SECURITY,
 HTTP_1_1_REQUIRED) = range(14)
ERROR_NAMES = ("NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
               "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR", "CONNECT_ERROR",
               "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED")

(SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE,
 SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE) = range(1, 7)

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
DEFAULT_FRAME_SIZE = 16_384
MAX_FRAME_SIZE = 2**24 - 1


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    length = len(payload)
    return HEAD.pack(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


def error_name(code: int) -> str:
    return ERROR_NAMES[code] if 0 <= code < len(ERROR_NAMES) else f"0x{code:x}"


__all__ = [name for name in dir() if name.isupper()] + ["frame", "error_name"]
