"""The REST port of one worker: its connections, their answers' Date header, and the drain.

Connections come from the worker's `serve.sockets.AcceptGate`, which calls `protocol_factory` for
each accepted socket; this object keeps what the drain needs (the open connections, the requests
being answered) and the one header that changes over time.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time

from serve.http.connection import ConnectionLimits, HttpConnection
from serve.http.routing import App
from serve.sockets import AcceptGate

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02


class RestServer:
    """Create on the serving loop; `start()` before the first connection."""

    def __init__(self, app: App, limits: ConnectionLimits) -> None:
        self.app = app
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpConnection] = set()
        self.tasks: set[asyncio.Task] = set()
        """Requests being answered (each a task running the app)."""
        self.date_header = b""
        """`date: ...\\r\\n`, refreshed every second (RFC 9110 asks an origin server for it)."""
        self.force_exit = False
        """Set by a second signal: the drain stops waiting."""
        self._clock: asyncio.TimerHandle | None = None

    def start(self) -> "RestServer":
        self._tick()
        return self

    def _tick(self) -> None:
        now = time.time()
        self.date_header = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        self._clock = self.loop.call_later(1.0 - now % 1.0, self._tick)

    def protocol_factory(self) -> HttpConnection:
        return HttpConnection(self)

    def track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("answering a request failed", exc_info=task.exception())

    def begin_drain(self) -> None:
        """Every answer from now on carries Connection: close, the one in progress included (each
        connection looks at `limits.draining` when it writes an answer); an idle keep-alive
        connection is closed by `drain` once it has been idle for DRAIN_IDLE_S."""
        self.limits.draining = True

    async def drain(self, gate: AcceptGate | None, timeout_s: float) -> int:
        """Stop accepting (the connections already queued on the socket are taken first: closing it
        would reset them), answer every request received or still arriving, close connections once
        idle; after `timeout_s`, cancel what still runs. Returns how many requests were abandoned."""
        self.begin_drain()
        if gate is not None:
            await gate.close()  # each taken connection is in self.connections before the wait below
        loop = self.loop
        deadline = loop.time() + timeout_s
        while (self.connections or self.tasks) and loop.time() < deadline and not self.force_exit:
            now = loop.time()
            for connection in list(self.connections):
                connection.close_if_idle(now)
            await asyncio.sleep(DRAIN_POLL_S)
        abandoned = len(self.tasks)
        for task in list(self.tasks):
            task.cancel()
        for connection in list(self.connections):
            connection.transport.close()
        if self._clock is not None:
            self._clock.cancel()
        return abandoned
