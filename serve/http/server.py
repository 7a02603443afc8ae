"""The REST port of one worker: its app, its connections (kept by a `serve.host.ConnectionHost`),
their answers' Date header, and the drain.

Connections come from the worker's `serve.sockets.AcceptGate`, which calls `protocol_factory` for
each accepted socket.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import time

from serve.host import ConnectionHost
from serve.http.connection import HttpConnection
from serve.http.routing import App


class RestServer:
    """Create on the serving loop; `start()` before the first connection."""

    def __init__(self, app: App, host: ConnectionHost) -> None:
        self.app = app
        self.host = host
        self.header = b""
        """`date: ...\\r\\n`, refreshed every second (RFC 9110 asks an origin server for it)."""
        self.protocol_factory = functools.partial(HttpConnection, host, app, self)
        self._clock: asyncio.TimerHandle | None = None

    def start(self) -> "RestServer":
        self._tick()
        self.host.start()
        return self

    def _tick(self) -> None:
        now = time.time()
        self.header = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        self._clock = self.host.loop.call_later(1.0 - now % 1.0, self._tick)

    async def drain(self, gate, timeout_s: float) -> int:  # noqa: ANN001 - a serve.sockets.AcceptGate or None
        """Every request received or still arriving is answered, connections close once idle;
        returns how many requests were abandoned at `timeout_s`."""
        abandoned = await self.host.drain(gate, timeout_s)
        if self._clock is not None:
            self._clock.cancel()
        return abandoned


__all__ = ["RestServer"]
