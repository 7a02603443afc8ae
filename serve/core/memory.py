"""Give memory back to the OS after large requests.

Decoding a multi-megabyte request builds many small objects; once they are freed, glibc keeps the
pages in its arenas, and a server that answered a few large requests would stay gigabytes large.
`after_request(size)` asks glibc to return free pages (`malloc_trim`) after a large request, at
most once a second, on a worker thread (ctypes releases the GIL during the call).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time

LARGE_REQUEST_BYTES = 512 * 1024
MIN_INTERVAL_S = 1.0


def _load_trim():  # noqa: ANN202
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc: nothing to do
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_trim = _load_trim()
_last = 0.0


def after_request(size: int) -> None:
    """Call on the event loop once a request of `size` bytes is answered."""
    global _last
    if _trim is None or size < LARGE_REQUEST_BYTES:
        return
    now = time.monotonic()
    if now - _last < MIN_INTERVAL_S:
        return
    _last = now
    asyncio.get_running_loop().run_in_executor(None, _trim, 0)
