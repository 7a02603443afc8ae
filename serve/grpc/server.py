"""The gRPC port of one worker: its connections (`serve.grpc.http2`), the methods they call
(`serve.grpc.servicer`), and the drain.

The listening socket is bound once by `python -m serve` (as the REST one); with `--workers N`
every worker accepts from it through an `AcceptGate`, so gRPC connections, which clients keep
for as long as they run, spread over the workers as evenly as REST's.

    server = await GrpcServer(config, core, sock).start()
    ...
    abandoned = await server.stop(grace_s)   # GOAWAY: new calls refused, running ones finish
"""

from __future__ import annotations

import asyncio
import logging
import socket

from serve.config import ServeConfig
from serve.core.dataplane import ServingCore
from serve.grpc.http2 import GrpcConnection, GrpcLimits, Method
from serve.grpc.servicer import HEALTH_FAREWELL_S, GrpcApi, Health
from serve.sockets import AcceptGate

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02


class GrpcServer:
    """TF Serving's two services, V2's and `grpc.health.v1.Health` (SERVING once every model has
    a live version; Kubernetes gRPC probes) on `sock`. Create on the serving loop."""

    def __init__(self, config: ServeConfig, core: ServingCore, sock: socket.socket, *,
                 loads=None, index: int = 0) -> None:  # noqa: ANN001 - a multiprocessing.Array of int
        self.config = config
        self.core = core
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.api = GrpcApi(config, core)
        self.health = Health(core)
        self.methods: dict[str, Method] = {**self.health.methods(), **self.api.methods()}
        self.limits = GrpcLimits(max_connections=config.max_connections, header_timeout_s=config.header_timeout_s,
                                 max_header_bytes=config.max_header_bytes, max_message_bytes=config.max_body_bytes,
                                 body_timeout_s=config.body_timeout_s)
        self.connections: set[GrpcConnection] = set()
        self.tasks: set[asyncio.Task] = set()
        """Calls being answered (each a task running its method)."""
        self.gate = AcceptGate(sock, self.protocol_factory, lambda: self.limits.open, loads=loads, index=index)
        self.port = sock.getsockname()[1]

    def protocol_factory(self) -> GrpcConnection:
        return GrpcConnection(self)

    def publish(self) -> None:
        """A connection opened or closed: tell the sibling workers."""
        self.gate.publish()

    def track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def start(self) -> "GrpcServer":
        self.gate.start()
        log.info("gRPC on %s:%d (PredictionService, ModelService, GRPCInferenceService, Health)",
                 self.config.host, self.port)
        return self

    async def stop(self, grace_s: float) -> int:
        """Health says NOT_SERVING to every watcher, the port closes (connections already queued on
        it are taken first), every connection gets GOAWAY, calls in progress finish for up to
        `grace_s`; returns how many had to be abandoned."""
        await self.health.close(min(grace_s, HEALTH_FAREWELL_S))
        await self.gate.close()
        for connection in list(self.connections):
            connection.goaway()
        deadline = self.loop.time() + grace_s
        while (self.tasks or self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        abandoned = len(self.tasks)
        for task in list(self.tasks):
            task.cancel()
        for connection in list(self.connections):
            connection.transport.close()
        return abandoned


__all__ = ["GrpcServer"]
