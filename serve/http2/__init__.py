"""HTTP/2 (RFC 9113) for the gRPC port, as a sans-IO machine: `machine.ServerConnection` takes the
client's bytes and gives events and the bytes to answer with; `frames` and `headers` are its wire
format and its header rules. Nothing here knows gRPC, sockets or asyncio (`serve.grpc.connection` is
the shell that does)."""

from serve.http2.machine import Limits, ServerConnection

__all__ = ["Limits", "ServerConnection"]
