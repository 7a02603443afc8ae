"""The gRPC port of one worker: its method table (`tf_serving`, `v2`, `health`), its connections
(`serve.grpc.connection`, kept by a `serve.host.ConnectionHost`) and the drain.

The listening socket is bound once by `python -m serve` (as the REST one); with `--workers N`
every worker accepts from it through an `AcceptGate`, so gRPC connections, which clients keep
for as long as they run, spread over the workers as evenly as REST's.

    server = await GrpcServer(config, core, sock).start()
    ...
    abandoned = await server.stop(grace_s)   # GOAWAY: new calls refused, running ones finish
"""

from __future__ import annotations

import functools
import logging
import socket
import struct

from serve.config import ServeConfig
from serve.core.dataplane import ServingCore
from serve.grpc.connection import GrpcConnection, GrpcService
from serve.grpc.health import HEALTH_FAREWELL_S, Health
from serve.grpc.tf_serving import GrpcApi
from serve.host import ConnectionHost, PortLimits
from serve.http2.frames import GOAWAY, PROTOCOL_ERROR, frame
from serve.http2.machine import Limits
from serve.sockets import AcceptGate
from serve.tls import tls_for

log = logging.getLogger(__name__)

PLAINTEXT_ANSWER = frame(GOAWAY, 0, 0, struct.pack(">LL", 0, PROTOCOL_ERROR)
                                                  + b"this port speaks TLS: use a secure channel")
"""What a plaintext HTTP/2 client gets on a TLS gRPC port before the connection closes: a GOAWAY
without the SETTINGS a server must send first, so that grpcio fails the call at once (UNAVAILABLE,
"Expected SETTINGS frame") instead of reconnecting in a tight loop, as it does after a GOAWAY that
follows SETTINGS."""
STREAM_WINDOW = 1 << 20
"""Each call's receive window; a message larger than it is credited as it arrives."""


def http2_limits(config: ServeConfig) -> Limits:
    """The HTTP/2 limits of the gRPC port: room for two largest messages in the connection window."""
    return Limits(stream_window=STREAM_WINDOW, connection_window=max(2 * (config.max_body_bytes + 5), STREAM_WINDOW),
                  max_header_list_bytes=config.grpc_max_header_bytes)


class GrpcServer:
    """TF Serving's two services, V2's and `grpc.health.v1.Health` (SERVING once every model has
    a live version; Kubernetes gRPC probes) on `sock`. Create on the serving loop."""

    def __init__(self, config: ServeConfig, core: ServingCore, sock: socket.socket, *,
                 loads=None, index: int = 0) -> None:  # noqa: ANN001 - a multiprocessing.Array of int
        self.config = config
        self.health = Health(core)
        methods = {**self.health.methods(), **GrpcApi(config, core).methods()}
        self.host = ConnectionHost("gRPC", PortLimits.of(config, grpc=True),
                                   report=functools.partial(core.metrics.connection_event, "grpc"))
        service = GrpcService(methods, http2_limits(config), config.max_body_bytes, config.grpc_max_header_bytes)
        self.tls = tls_for(config, "grpc")
        self.gate = AcceptGate(sock, functools.partial(GrpcConnection, self.host, service), lambda: self.host.open,
                               loads=loads, index=index, tls=self.tls, handshake_timeout_s=config.header_timeout_s,
                               plaintext_answer=PLAINTEXT_ANSWER)
        self.host.on_change = self.gate.publish
        self.host.excess = self.gate.excess
        self.port = sock.getsockname()[1]

    async def start(self) -> "GrpcServer":
        self.host.start()
        self.gate.start()
        log.info("gRPC on %s:%d%s (PredictionService, ModelService, GRPCInferenceService, Health)",
                 self.config.host, self.port, " over TLS" if self.tls else "")
        return self

    async def stop(self, grace_s: float) -> int:
        """Health says NOT_SERVING to every watcher, the port closes (connections already queued on
        it are taken first), every connection gets GOAWAY, calls in progress finish for up to
        `grace_s`; returns how many had to be abandoned."""
        await self.health.close(min(grace_s, HEALTH_FAREWELL_S))
        return await self.host.drain(self.gate, grace_s)


__all__ = ["GrpcServer", "http2_limits"]
