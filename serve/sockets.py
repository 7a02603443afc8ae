"""Listening sockets, and who takes a new connection when `--workers N` share one.

Every worker accepts from the one listening socket the supervisor bound, one connection at a time
and only while it holds no more open connections than the least loaded worker (`AcceptGate`), so
connections spread evenly and a worker that is busy with long requests takes fewer new ones. Why
not leave it to the kernel or to one SO_REUSEPORT socket per worker: docs/design/transports.md,
"The accept gate".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Callable

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048
RETRY_S = 0.002
"""How soon a worker that left a connection to a less loaded sibling looks at the queue again."""
PAUSE_ON_ERROR_S = 0.1
"""How long accepting pauses after an error such as too many open files (else it would spin)."""
MAX_DEFER_S = 0.02
"""How long a worker leaves queued connections to its siblings before taking one itself: a sibling
whose event loop is busy (or stuck) must not hold new connections back for longer."""
MAX_ACCEPTS_PER_WAKE = 32
"""Most connections one wake-up takes while this worker is still the least loaded: a busy worker
that fell behind catches up in one event-loop turn instead of one connection per turn (256 new
connections took over a second to spread over two busy workers that way)."""
REBALANCE_SLACK = 1
"""Connections a worker may hold beyond an even share before it sheds the rest (`AcceptGate.excess`)."""
PLAINTEXT_LOG_S = 60.0
"""A peer whose TLS handshake fails (or who speaks plaintext to a TLS port) is logged once per this."""


class StartupError(RuntimeError):
    """The server cannot start (port in use, bad address); the message names the flag."""


def bind_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A listening TCP socket; StartupError naming `flag` if the address cannot be used."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise StartupError(f"{flag} {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class AcceptGate:
    """Accepts connections from `sock` into `create_protocol` while this worker holds no more open
    connections than any sibling, deferring to the sibling workers while one of them holds fewer.

    `loads` is shared memory (the supervisor's `multiprocessing.Array`): each worker's open
    connections, -1 for a worker that is not accepting (starting, restarting, draining). Every
    worker is woken for each new connection (the socket is shared), so the least loaded one takes
    it; ties go to whoever is first."""

    def __init__(self, sock: socket.socket, create_protocol: Callable[[], asyncio.Protocol],
                 open_connections: Callable[[], int], *,
                 loads=None, index: int = 0, tls=None,  # noqa: ANN001 - a multiprocessing.Array of int
                 handshake_timeout_s: float = 10.0, plaintext_answer: bytes = b"") -> None:
        """`open_connections()`: the connections this worker's protocols hold open (call `publish`
        when it changes); `tls`: the port's `serve.tls.TlsContexts` (None: plaintext), with the
        handshake's time limit and what a plaintext client is told before the connection closes."""
        self.sock, self.create_protocol, self.loads, self.index = sock, create_protocol, loads, index
        self.tls, self._handshake_timeout_s, self._plaintext_answer = tls, handshake_timeout_s, plaintext_answer
        self._plaintext_logged: dict[str, float] = {}
        self._open_connections = open_connections
        self._loop = asyncio.get_running_loop()
        self._accepting = False
        self._retry: asyncio.TimerHandle | None = None
        self._deferring_since: float | None = None
        """When this worker began leaving the queued connection(s) to a sibling."""
        self._resumed_at = float("-inf")
        self._connecting: set[asyncio.Task] = set()

    def start(self) -> None:
        self.sock.setblocking(False)
        self._accepting = True
        self.publish()
        self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def stop(self) -> None:
        """Stop accepting (the socket stays open: the drain takes what is left in its queue)."""
        if self._accepting:
            self._accepting = False
            self._loop.remove_reader(self.sock.fileno())
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self.loads is not None:
            self.loads[self.index] = -1

    def load(self) -> int:
        """Open connections, counting those accepted whose protocol does not exist yet."""
        return self._open_connections() + len(self._connecting)

    def publish(self) -> None:
        """Tell the siblings this worker's load (after a connection opened or closed)."""
        if self.loads is not None and self._accepting:
            self.loads[self.index] = self.load()

    def excess(self, own: int) -> int:
        """How many of this worker's `own` connections are beyond an even share with the siblings
        that accept now (0 for a single worker). Keep-alive connections stay where they land, so a
        burst that came while a sibling was still joining the port would stay on one worker: the
        port sheds the excess (REST: Connection: close on the next answer; gRPC: GOAWAY), and the
        clients' new connections land on the sibling."""
        if self.loads is None or not self._accepting:
            return 0
        others = [load for i, load in enumerate(self.loads) if i != self.index and load >= 0]
        if not others:
            return 0
        share = -(-(own + sum(others)) // (len(others) + 1))
        return max(0, own - share - REBALANCE_SLACK)

    def _my_turn(self) -> bool:
        if self.loads is None:
            return True
        others = [load for i, load in enumerate(self.loads) if i != self.index and load >= 0]
        return not others or self.load() <= min(others)

    def _on_readable(self) -> None:
        if not self._my_turn():
            now = self._loop.time()
            if self._deferring_since is None or now - self._resumed_at > RETRY_S:
                self._deferring_since = now  # not the same connection still waiting: a new one
            if now - self._deferring_since < MAX_DEFER_S:
                self._pause(RETRY_S)  # level-triggered: it would wake again at once
                return
        self._deferring_since = None
        for _ in range(MAX_ACCEPTS_PER_WAKE):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # the queue is empty (or a sibling took it)
            except OSError as exc:  # EMFILE and the like: the connection waits in the queue meanwhile
                log.warning("cannot accept a connection: %s; trying again in %gs", exc, PAUSE_ON_ERROR_S)
                self._pause(PAUSE_ON_ERROR_S)
                return
            self.take(conn)
            if not self._my_turn():
                return  # the next one is a sibling's (or this worker's next wake-up's)

    def _pause(self, seconds: float) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self._retry = self._loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if self._accepting:
            self._resumed_at = self._loop.time()
            self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def take(self, conn: socket.socket) -> None:
        """Serve an accepted connection on this loop."""
        conn.setblocking(False)
        if self.tls is None:
            task = self._loop.create_task(self._loop.connect_accepted_socket(self.create_protocol, conn))
        else:
            task = self._loop.create_task(self._tls_connection(conn))
        self._connecting.add(task)  # counted now, before the protocol exists, so the next wake-up sees it
        task.add_done_callback(self._connected)
        self.publish()

    async def _tls_connection(self, conn: socket.socket) -> None:
        """The TLS handshake (bounded by the header timeout), after a look at the first bytes: a
        client speaking plaintext gets `plaintext_answer` and a clean close, logged at most once
        per peer address and PLAINTEXT_LOG_S."""
        loop = self._loop
        try:
            first = await asyncio.wait_for(self._peek(conn), self._handshake_timeout_s)
        except (asyncio.TimeoutError, OSError):
            conn.close()
            return
        if not first:  # gone before a word
            conn.close()
            return
        if first[:1] != b"\x16":  # not a TLS handshake record
            self._refuse_plaintext(conn)
            return
        try:
            await loop.connect_accepted_socket(self.create_protocol, conn, ssl=self.tls.current(),
                                               ssl_handshake_timeout=self._handshake_timeout_s)
        except (ssl.SSLError, OSError, asyncio.TimeoutError, ConnectionError) as exc:
            self._log_peer(conn, "TLS handshake failed: %s", getattr(exc, "reason", None) or exc.__class__.__name__)
            conn.close()

    async def _peek(self, conn: socket.socket) -> bytes:
        ready = self._loop.create_future()
        self._loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self._loop.remove_reader(conn.fileno())
        return conn.recv(16, socket.MSG_PEEK)

    def _refuse_plaintext(self, conn: socket.socket) -> None:
        self._log_peer(conn, "plaintext request on a TLS port: %s", "answered and closed")
        with contextlib.suppress(OSError):
            if self._plaintext_answer:
                conn.send(self._plaintext_answer)
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(65536):  # what it sent, unread, would make the close a reset
                pass
        conn.close()

    def _log_peer(self, conn: socket.socket, message: str, detail: object) -> None:
        try:
            peer = conn.getpeername()[0]
        except OSError:
            peer = "client"
        now = self._loop.time()
        if now - self._plaintext_logged.get(peer, float("-inf")) < PLAINTEXT_LOG_S:
            return
        if len(self._plaintext_logged) >= 4096:
            self._plaintext_logged.clear()
        self._plaintext_logged[peer] = now
        log.warning("%s: " + message + " (logged once per %gs for this address)", peer, detail, PLAINTEXT_LOG_S)

    async def settle(self) -> None:
        """Wait until every accepted connection has its protocol (so the server counts it)."""
        while self._connecting:
            await asyncio.wait(list(self._connecting))

    def _connected(self, task: asyncio.Task) -> None:
        self._connecting.discard(task)  # its protocol counts it from here, or it failed
        if not task.cancelled() and task.exception() is not None:
            log.warning("cannot serve an accepted connection: %s", task.exception())
        self.publish()

    async def close(self) -> None:
        """Stop accepting, take every connection already queued (closing the socket would reset
        them), close the socket, and wait until each taken connection has its protocol."""
        self.stop()
        taken = self.take_queue()
        self.sock.close()
        if taken:
            log.info("drain: %d connection(s) taken from the listening queue", taken)
        await self.settle()

    def take_queue(self) -> int:
        """Accept every connection already queued on the socket (at drain: closing a listening socket
        resets them, and clients that connected just before would see a reset, not an answer)."""
        taken = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return taken
            except OSError as exc:
                log.warning("drain: accepting queued connections failed: %s", exc)
                return taken
            self.take(conn)
            taken += 1


__all__ = ["AcceptGate", "LISTEN_BACKLOG", "StartupError", "bind_socket"]
