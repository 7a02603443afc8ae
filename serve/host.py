"""One port's connections, whatever their protocol: the REST port's HTTP/1.1 and the gRPC port's
HTTP/2 connections are both kept by a `ConnectionHost`, which is all they see of the server.

The host holds what the whole port shares: the open connections and the slot count the accept
gate reads, the requests being answered (the drain waits for them), which connections are idle
(the longest idle makes room for a new one at the limit), counters, a periodic tick on which each
connection checks its own deadlines, rate-limited logging of client misbehaviour and the drain
itself. Limits are frozen (`PortLimits`); what changes lives in the host.

A connection implements `Hosted`; it is handed the host when made and never sees the server.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Callable, Protocol

from serve.config import ServeConfig

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02
EVICT_AFTER_S = 1.0
"""At the connection limit, a connection idle this long is closed to make room for a new one (a flood
of new connections, whose requests may not have been read yet, is refused rather than cut off)."""
LOG_PERIOD_S = 10.0
LOG_LINES = 5
"""Client misbehaviour is logged at most LOG_LINES times per kind and LOG_PERIOD_S (then one line
says how many more there were): a flood of bad requests must not become a flood of log lines."""


@dataclass(frozen=True, slots=True)
class PortLimits:
    """What one port allows each connection."""

    max_connections: int
    header_timeout_s: float
    """A request's headers (HTTP/1.1), the connection preface and any header block (HTTP/2)."""
    body_timeout_s: float
    """A request's body after its headers."""
    idle_timeout_s: float
    """A connection without a request in progress."""
    send_timeout_s: float
    """An answer the client does not read (its socket not read, or its HTTP/2 window left closed)."""
    max_header_bytes: int
    max_body_bytes: int

    @classmethod
    def of(cls, config: ServeConfig, grpc: bool = False) -> "PortLimits":
        """The REST port's limits, or with `grpc` the gRPC port's (its own header limit)."""
        return cls(max_connections=config.max_connections, header_timeout_s=config.header_timeout_s,
                   body_timeout_s=config.body_timeout_s, idle_timeout_s=config.keepalive_timeout_s,
                   send_timeout_s=config.send_timeout_s,
                   max_header_bytes=config.grpc_max_header_bytes if grpc else config.max_header_bytes,
                   max_body_bytes=config.max_body_bytes)


class Hosted(Protocol):
    """What the host asks of a connection."""

    def evict(self) -> None:
        """Close now to make room (the host only picks a connection that is idle)."""

    def drain(self) -> None:
        """The server is stopping: finish what is in progress, take nothing new."""

    def close_if_idle(self, now: float) -> None:
        """During the drain: close if nothing is in progress."""

    def tick(self, now: float) -> None:
        """Check this connection's deadlines."""

    def shed(self) -> None:
        """Close once what is in progress is answered, so the client reconnects (to a less loaded worker)."""

    def abort(self) -> None:
        """Close at once (the drain timed out)."""


class ConnectionHost:
    """One port's connections and the requests they are answering. Create on the serving loop."""

    def __init__(self, name: str, limits: PortLimits, report: Callable[[str], None] | None = None) -> None:
        """`name`: the port as logs and metrics say it (rest, grpc); `report(event)` counts an event
        of the port (a refused connection, a protocol error...) in the server's metrics."""
        self.name = name
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.connections: set[Hosted] = set()
        """Every connection with a transport, refused ones still being closed included."""
        self._counted: set[Hosted] = set()
        self.idle: dict[Hosted, float] = {}
        """Counted connections with nothing in progress, oldest first, with the loop time they became idle."""
        self.tasks: set[asyncio.Task] = set()
        """Requests being answered."""
        self.events: collections.Counter[str] = collections.Counter()
        """Events of the port by kind (refused and evicted connections, protocol errors...)."""
        self.received = 0
        """Requests whose headers were read and handed on."""
        self.answered = 0
        self.draining = False
        """Set when the drain begins (REST answers then carry Connection: close)."""
        self.force_exit = False
        """Set by a second signal: the drain stops waiting."""
        self.on_change: Callable[[], None] | None = None
        """Called after the open count changed (the accept gate tells the sibling workers)."""
        self.excess: Callable[[int], int] | None = None
        """Given the connections this port keeps, how many are beyond its share among the workers
        (the accept gate's `excess`): shed on the next tick."""
        self._shedding: set[Hosted] = set()
        self._report = report
        self._logged: dict[str, list] = {}
        self._tick: asyncio.TimerHandle | None = None
        shortest = min(limits.header_timeout_s, limits.body_timeout_s, limits.idle_timeout_s, limits.send_timeout_s)
        self.tick_s = min(1.0, max(0.02, shortest / 4))
        """How often every connection checks its deadlines (a deadline is kept within this)."""

    # -- slots -----------------------------------------------------------------------------------

    @property
    def open(self) -> int:
        """Connections counted against the limit."""
        return len(self._counted)

    def admit(self, connection: Hosted) -> bool:
        """A new connection: counted, after evicting an idle one if the port is full; False if it
        must be refused (the caller answers and closes it; it stays in `connections` until lost)."""
        self.connections.add(connection)
        if len(self._counted) >= self.limits.max_connections:
            self._evict_an_idle_connection()
        if len(self._counted) >= self.limits.max_connections:
            self.report("refused")
            return False
        self._counted.add(connection)
        self.idle[connection] = self.loop.time()
        self._changed()
        return True

    def release(self, connection: Hosted) -> None:
        """Stop counting `connection` against the limit (it is closing)."""
        self.idle.pop(connection, None)
        if connection in self._counted:
            self._counted.discard(connection)
            self._changed()

    def lost(self, connection: Hosted) -> None:
        """The connection's transport is gone."""
        self.release(connection)
        self.connections.discard(connection)
        self._shedding.discard(connection)

    def _rebalance(self) -> None:
        kept = self._counted - self._shedding
        surplus = self.excess(len(kept)) if self.excess is not None and not self.draining else 0
        for connection in list(kept)[:surplus]:
            self._shedding.add(connection)
            self.report("rebalanced")
            connection.shed()

    def set_idle(self, connection: Hosted) -> None:
        if connection in self._counted:
            self.idle[connection] = self.loop.time()

    def set_busy(self, connection: Hosted) -> None:
        self.idle.pop(connection, None)

    def _evict_an_idle_connection(self) -> None:
        if not self.idle:
            return
        oldest, since = next(iter(self.idle.items()))
        if self.loop.time() - since < EVICT_AFTER_S:
            return
        self.release(oldest)
        self.report("evicted")
        oldest.evict()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- requests, events, logs ------------------------------------------------------------------

    def track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("answering a request failed", exc_info=task.exception())

    def report(self, event: str) -> None:
        """Count `event` (in `events` and the server's metrics)."""
        self.events[event] += 1
        if self._report is not None:
            self._report(event)

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log client misbehaviour of `kind` at INFO, at most LOG_LINES times per LOG_PERIOD_S."""
        now = self.loop.time()
        seen = self._logged.get(kind)
        if seen is None or now - seen[0] >= LOG_PERIOD_S:
            if seen is not None and seen[2]:
                log.info("%s: %d more like the last (%s) in %gs, not logged", self.name, seen[2], kind, LOG_PERIOD_S)
            seen = self._logged[kind] = [now, 0, 0]
        if seen[1] < LOG_LINES:
            seen[1] += 1
            log.info("%s " + message, self.name, *args)
        else:
            seen[2] += 1

    # -- deadlines and drain ---------------------------------------------------------------------

    def start(self) -> None:
        self._tick = self.loop.call_later(self.tick_s, self._on_tick)

    def _on_tick(self) -> None:
        now = self.loop.time()
        for connection in list(self.connections):
            connection.tick(now)
        self._rebalance()
        self._tick = self.loop.call_later(self.tick_s, self._on_tick)

    def begin_drain(self) -> None:
        self.draining = True

    async def drain(self, gate, timeout_s: float) -> int:  # noqa: ANN001 - a serve.sockets.AcceptGate or None
        """Stop accepting (the connections already queued are taken first: closing the socket would
        reset them), let every connection finish what it has in progress and close once idle; after
        `timeout_s`, cancel what still runs and close the rest. Returns how many requests were abandoned."""
        self.begin_drain()
        if gate is not None:
            await gate.close()  # each taken connection is in self.connections before the wait below
        for connection in list(self.connections):
            connection.drain()
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
            connection.abort()
        if self._tick is not None:
            self._tick.cancel()
        return abandoned


__all__ = ["ConnectionHost", "Hosted", "PortLimits"]
