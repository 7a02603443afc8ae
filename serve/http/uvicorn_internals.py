"""Every part of uvicorn that is not its public API, in one place, with a check that they are still
there (a fast-tier test runs `problems()`).

The hardened protocol (`serve.http.connection`) subclasses uvicorn's httptools protocol and the
worker (`serve.worker`) subclasses `uvicorn.Server` for its drain; both reach into attributes
uvicorn does not document. uvicorn is pinned in pyproject.toml for that reason. To move to a new
release: bump the pin and `PINNED`, run `python -m pytest tests/test_architecture.py`, and read the
names it reports. What the hardening is for, and what a proxy in front can do instead, is in the
README ("Serving").
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
from typing import Callable

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

PINNED = "0.55.0"

PROTOCOL_METHODS = ("connection_made", "connection_lost", "eof_received", "data_received", "send_400_response",
                    "on_message_begin", "on_url", "on_header", "on_headers_complete", "on_body",
                    "on_message_complete", "on_response_complete", "shutdown", "_unset_keepalive_if_required")
"""HttpToolsProtocol methods the hardened protocol overrides or calls."""
PROTOCOL_ATTRIBUTES = ("parser", "cycle", "server_state", "transport", "client", "pipeline", "loop", "headers")
CYCLE_ATTRIBUTES = ("keep_alive", "response_complete", "disconnected", "message_event")
SERVER_STATE_ATTRIBUTES = ("connections", "tasks", "total_requests", "default_headers")
SERVER_METHODS = ("capture_signals", "startup", "shutdown", "serve")
"""uvicorn.Server methods the worker overrides (signals, drain) or calls."""
SERVER_ATTRIBUTES = ("servers", "server_state", "force_exit", "should_exit", "config", "lifespan")


def protocol_factory(server: uvicorn.Server) -> Callable[[], asyncio.Protocol]:
    """What `uvicorn.Server.startup` hands to `loop.create_server`: a new connection's protocol. The
    worker accepts connections itself (`serve.sockets.AcceptGate`) and hands them to this."""
    config = server.config

    def create_protocol() -> asyncio.Protocol:
        return config.http_protocol_class(config=config, server_state=server.server_state,
                                          app_state=server.lifespan.state)

    return create_protocol


def _assigned(cls: type, names: tuple[str, ...]) -> list[str]:
    """Names of `names` that `cls`'s source never assigns as `self.NAME`."""
    source = inspect.getsource(cls)
    return [n for n in names if f"self.{n} =" not in source and f"self.{n}: " not in source]


def problems() -> list[str]:
    """What no longer matches the uvicorn this code was written against; [] when all is well."""
    found = []
    installed = importlib.metadata.version("uvicorn")
    if installed != PINNED:
        found.append(f"uvicorn {installed} is installed, the code was checked against {PINNED}")
    found += [f"HttpToolsProtocol.{n}() is gone" for n in PROTOCOL_METHODS if not hasattr(HttpToolsProtocol, n)]
    found += [f"HttpToolsProtocol.{n} is no longer set" for n in _assigned(HttpToolsProtocol, PROTOCOL_ATTRIBUTES)]
    found += [f"RequestResponseCycle.{n} is no longer set" for n in _assigned(RequestResponseCycle, CYCLE_ATTRIBUTES)]
    state = ServerState()
    found += [f"ServerState.{n} is gone" for n in SERVER_STATE_ATTRIBUTES if not hasattr(state, n)]
    found += [f"uvicorn.Server.{n}() is gone" for n in SERVER_METHODS if not hasattr(uvicorn.Server, n)]
    found += [f"uvicorn.Server.{n} is no longer set" for n in _assigned(uvicorn.Server, SERVER_ATTRIBUTES)]
    parameters = inspect.signature(HttpToolsProtocol.__init__).parameters
    found += [f"HttpToolsProtocol() no longer takes {n}=" for n in ("config", "server_state", "app_state")
              if n not in parameters]
    if 200 not in STATUS_LINE or not STATUS_LINE[200].startswith(b"HTTP/1.1 200"):
        found.append("STATUS_LINE no longer maps status codes to HTTP/1.1 status lines")
    return found


__all__ = ["STATUS_LINE", "HttpToolsProtocol", "PINNED", "problems", "protocol_factory"]
