"""An in-process client for the server's ASGI app: requests go straight into the app (no sockets),
on an event loop of their own in a background thread, as uvicorn would run it."""

from __future__ import annotations

import asyncio
import json as jsonlib
import threading
import urllib.parse
from typing import Any


class LoopThread:
    """An asyncio event loop running in a daemon thread; `run(coro)` waits for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class Response:
    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status_code = status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        self.body = body

    @property
    def json(self) -> Any:
        return jsonlib.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")

    @property
    def is_json(self) -> bool:
        return self.headers.get("content-type", "").startswith("application/json")


class AsgiClient:
    def __init__(self, app, loop: LoopThread) -> None:
        self.app = app
        self.loop = loop

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> Response:
        return self.loop.run(self.send(method, path, json=json, data=data, headers=headers))

    async def send(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                   headers: dict[str, str] | None = None) -> Response:
        body = data if data is not None else (jsonlib.dumps(json).encode() if json is not None else b"")
        raw_path, _, query = path.partition("?")
        header_list = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        header_list.append((b"content-length", str(len(body)).encode()))
        scope = {
            "type": "http", "method": method, "path": urllib.parse.unquote(raw_path),
            "raw_path": raw_path.encode("latin-1"), "query_string": query.encode("latin-1"),
            "headers": header_list, "client": ("127.0.0.1", 1),
        }
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if sent_body:
                await asyncio.Event().wait()  # like a client that sends nothing more
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}

        messages: list[dict] = []

        async def send(message: dict) -> None:
            messages.append(message)

        await self.app(scope, receive, send)
        start = messages[0]
        return Response(start["status"], start.get("headers", []),
                        b"".join(m.get("body", b"") for m in messages[1:]))

    def get(self, path: str, **kwargs) -> Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs) -> Response:
        return self.request("POST", path, **kwargs)

    def options(self, path: str, **kwargs) -> Response:
        return self.request("OPTIONS", path, **kwargs)
