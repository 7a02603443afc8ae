"""Header blocks: HPACK decoding (RFC 7541, by `hpack`) remembered per block, request headers held to
RFC 9113 section 8.2-8.3, and answers' header blocks encoded without touching any table.

A request whose headers break the rules is malformed (`Malformed`): the machine resets its stream
with PROTOCOL_ERROR. What a block decodes to depends only on its bytes and the decoder's dynamic
table, so a block seen again while the table is unchanged (a client repeating its request headers
call after call sends the same few bytes) is neither decoded nor validated again.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import hpack
from hpack.table import HeaderTable

Fields = Sequence[tuple[bytes, bytes]]

_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
"""A field name: token characters, lower case (RFC 9113 8.2.1, 8.2)."""
_BAD_VALUE = re.compile(rb"[\0\r\n]|\A[ \t]|[ \t]\Z")
"""A field value must not hold NUL, CR or LF, nor start or end with a space or a tab (RFC 9113 8.2.1)."""
_CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path"))


class Malformed(Exception):
    """A request (or its trailers) that RFC 9113 calls malformed; the message says why."""


class HeaderListTooLarge(Exception):
    """A header list past the limit: decoding stopped part-way, so the dynamic table is out of step
    with the client's and no later block of the connection can be read."""


class CompressionError(Exception):
    """A block HPACK cannot decode (a connection error, COMPRESSION_ERROR)."""


class RequestHead:
    """A request's validated headers. Shared by every request that sent the same block while the
    table was unchanged; `memo` is the application's to keep what it derives from them (so that
    it, too, is worked out once)."""

    __slots__ = ("method", "scheme", "authority", "path", "fields", "content_length", "memo")

    def __init__(self, method: bytes, scheme: bytes, authority: bytes, path: bytes,
                 fields: tuple[tuple[bytes, bytes], ...], content_length: int | None) -> None:
        self.method, self.scheme, self.authority, self.path = method, scheme, authority, path
        self.fields = fields
        """The regular (not pseudo) header fields, in the order sent."""
        self.content_length = content_length
        self.memo: Any = None

    def get(self, name: bytes, default: bytes | None = None) -> bytes | None:
        for key, value in self.fields:
            if key == name:
                return value
        return default


def request_head(fields: Fields) -> RequestHead:
    """The request in `fields`; Malformed if RFC 9113 8.2-8.3 forbid it."""
    pseudo: dict[bytes, bytes] = {}
    regular = []
    content_length = None
    for name, value in fields:
        if name[:1] == b":":
            if regular:
                raise Malformed(f"pseudo-header {_show(name)} after a regular header field")
            if name not in _REQUEST_PSEUDO:
                raise Malformed(f"pseudo-header {_show(name)} is not one of a request's")
            if name in pseudo:
                raise Malformed(f"pseudo-header {_show(name)} appears twice")
            pseudo[name] = value
            continue
        _check_field(name, value)
        if name == b"te" and value != b"trailers":
            raise Malformed("TE other than 'trailers'")
        if name == b"content-length":
            if not value.isdigit() or (content_length is not None and int(value) != content_length):
                raise Malformed("an invalid content-length")
            content_length = int(value)
        regular.append((name, value))
    method = pseudo.get(b":method")
    if not method:
        raise Malformed("no :method pseudo-header")
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or not pseudo.get(b":authority"):
            raise Malformed("CONNECT needs :authority and neither :scheme nor :path")
    else:
        if not pseudo.get(b":scheme"):
            raise Malformed("no :scheme pseudo-header")
        path = pseudo.get(b":path")
        if not path:
            raise Malformed("no :path pseudo-header" if path is None else "an empty :path")
    return RequestHead(method, pseudo.get(b":scheme", b""), pseudo.get(b":authority", b""),
                       pseudo.get(b":path", b""), tuple(regular), content_length)


def check_trailers(fields: Fields) -> None:
    """Malformed if `fields`, a request's trailers, hold a pseudo-header or a bad field."""
    for name, value in fields:
        if name[:1] == b":":
            raise Malformed(f"pseudo-header {_show(name)} in trailers")
        _check_field(name, value)


def _check_field(name: bytes, value: bytes) -> None:
    if not _NAME.match(name):
        if name.lower() != name:
            raise Malformed("a header field name with upper-case letters")
        raise Malformed("a header field name with characters a name cannot have")
    if name in _CONNECTION_SPECIFIC:
        raise Malformed(f"connection-specific header field {_show(name)}")
    if _BAD_VALUE.search(value):
        raise Malformed(f"header field {_show(name)} has a value with NUL, CR, LF or surrounding white space")


def _show(name: bytes) -> str:
    return repr(name[:40].decode("latin-1"))


class _CountedTable(HeaderTable):
    """hpack's dynamic table, counting its changes (an insertion, a resize)."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.generation += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, value: int) -> None:
        self.generation += 1
        HeaderTable.maxsize.fset(self, value)


class HeaderDecoder:
    """hpack's decoder, remembering what blocks decoded to while the table did not change."""

    REMEMBERED = 32

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._table = self._decoder.header_table = _CountedTable()
        self._known: dict[bytes, list] = {}
        """block -> [table generation, fields, RequestHead or Malformed or None (not yet asked)]."""

    def decode(self, block: bytes) -> list:
        """[generation, fields, head]: the block decoded (remembered if it left the table as it was)."""
        generation = self._table.generation
        known = self._known.get(block)
        if known is not None and known[0] == generation:
            return known
        try:
            fields = self._decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError:
            raise HeaderListTooLarge() from None
        except hpack.HPACKError as exc:
            raise CompressionError(str(exc)) from None
        entry = [generation, fields, None]
        if self._table.generation == generation:
            if len(self._known) >= self.REMEMBERED:
                self._known.clear()
            self._known[block] = entry
        return entry

    def request(self, block: bytes) -> RequestHead:
        """The request a block holds; Malformed if it breaks the rules (also remembered)."""
        entry = self.decode(block)
        head = entry[2]
        if head is None:
            try:
                head = request_head(entry[1])
            except Malformed as exc:
                head = exc
            entry[2] = head
        if isinstance(head, Malformed):
            raise head
        return head


# -- encoding ------------------------------------------------------------------------------------

_STATIC_FIELD = {field: i + 1 for i, field in reversed(list(enumerate(HeaderTable.STATIC_TABLE)))}
_STATIC_NAME = {field[0]: i + 1 for i, field in reversed(list(enumerate(HeaderTable.STATIC_TABLE)))}
_ENCODED: dict[Fields, bytes] = {}
_ENCODED_LIMIT = 256


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a `prefix_bits` prefix, the other bits of `first` kept."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_field(name: bytes, value: bytes) -> bytes:
    index = _STATIC_FIELD.get((name, value))
    if index is not None:
        return _integer(index, 7, 0x80)  # fully indexed from the static table
    index = _STATIC_NAME.get(name)
    head = _integer(index, 4) if index is not None else b"\x00" + _integer(len(name), 7) + name
    return head + _integer(len(value), 7) + value  # a literal without indexing


def encode(fields: Fields) -> bytes:
    """A header block of static-table references and literals that are never indexed: no table of
    the client's changes, so a block needs no state and the same fields always give the same bytes
    (remembered for tuples, which answers reuse)."""
    known = _ENCODED.get(fields) if isinstance(fields, tuple) else None
    if known is not None:
        return known
    block = b"".join([_encode_field(name, value) for name, value in fields])
    if isinstance(fields, tuple):
        if len(_ENCODED) >= _ENCODED_LIMIT:
            _ENCODED.clear()
        _ENCODED[fields] = block
    return block


__all__ = ["CompressionError", "HeaderDecoder", "HeaderListTooLarge", "Malformed", "RequestHead", "check_trailers",
           "encode", "request_head"]
