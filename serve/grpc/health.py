"""`grpc.health.v1.Health` on the gRPC port (Kubernetes' gRPC probes, grpc-health-probe)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from google.protobuf.message import DecodeError

from serve.core.dataplane import ServingCore
from serve.core.errors import Code
from serve.grpc import v2
from serve.grpc.calls import CallContext, Method, RpcError
from serve.grpc.tf_serving import MODEL_SERVICE, PREDICTION_SERVICE

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
HEALTH_SERVICES = ("", PREDICTION_SERVICE, MODEL_SERVICE, v2.SERVICE)
"""Names the Health service answers for ("" is the whole server, what Kubernetes asks by default)."""
HEALTH_POLL_S = 0.25
HEALTH_FAREWELL_S = 1.0
"""On drain, how long Watch streams get to send their last NOT_SERVING before the server stops."""


class Health:
    """`grpc.health.v1.Health` answered from the core's readiness (the same answer as /readyz at
    every moment): SERVING once the models are ready, NOT_SERVING while loading or draining.
    Requests are parsed here, so undecodable bytes are an INVALID_ARGUMENT like on every other
    method; Watch streams end with NOT_SERVING when the server drains."""

    def __init__(self, core: ServingCore) -> None:
        from grpc_health.v1 import health_pb2

        self.core = core
        self.pb = health_pb2
        self.closing = asyncio.Event()
        self.watching = 0
        """Watch streams open now: on drain each sends NOT_SERVING and ends before the server stops."""

    async def close(self, timeout_s: float) -> None:
        """NOT_SERVING to every checker and watcher; waits (up to `timeout_s`) until each Watch
        stream has sent it and ended, so that stopping the server cannot cut the last message off."""
        self.closing.set()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.watching and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    def _status(self, service: str) -> int:
        status = self.pb.HealthCheckResponse
        if service not in HEALTH_SERVICES:
            return status.SERVICE_UNKNOWN
        return status.SERVING if self.core.ready and not self.closing.is_set() else status.NOT_SERVING

    def _request(self, raw: bytes):  # noqa: ANN202
        try:
            return self.pb.HealthCheckRequest.FromString(raw)
        except DecodeError:
            log.info("gRPC health: undecodable request (%d bytes)", len(raw))
            raise RpcError(Code.INVALID_ARGUMENT, "request is not a valid grpc.health.v1.HealthCheckRequest") from None

    async def check(self, raw: bytes, _context: CallContext) -> bytes:
        request = self._request(raw)
        if request.service not in HEALTH_SERVICES:
            raise RpcError(Code.NOT_FOUND, f"unknown service {request.service!r}")
        return self.pb.HealthCheckResponse(status=self._status(request.service)).SerializeToString()

    async def watch(self, raw: bytes, _context: CallContext) -> AsyncIterator[bytes]:
        request = self._request(raw)
        last = None
        self.watching += 1
        try:
            while True:
                status = self._status(request.service)
                if status != last:
                    yield self.pb.HealthCheckResponse(status=status).SerializeToString()
                    last = status
                    continue  # the send took time: the drain may have begun meanwhile, say so first
                if self.closing.is_set():
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.closing.wait(), HEALTH_POLL_S)
        finally:
            self.watching -= 1

    def methods(self) -> dict[str, Method]:
        return {f"/{HEALTH_SERVICE}/Check": Method(self.check),
                f"/{HEALTH_SERVICE}/Watch": Method(self.watch, streaming=True)}


__all__ = ["HEALTH_FAREWELL_S", "Health"]
