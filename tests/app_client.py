"""An in-process client for the REST port's app: requests go straight into the app (no sockets),
on an event loop of their own in a background thread, as the server's connections run it."""

from __future__ import annotations

import asyncio
import json as jsonlib
import threading
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


class AppClient:
    def __init__(self, app, loop: LoopThread) -> None:
        self.app = app
        self.loop = loop

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> Response:
        return self.loop.run(self.send(method, path, json=json, data=data, headers=headers))

    async def send(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                   headers: dict[str, str] | None = None) -> Response:
        from serve.http.routing import Request

        body = data if data is not None else (jsonlib.dumps(json).encode() if json is not None else b"")
        raw_path, _, query = path.partition("?")
        header_list = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        header_list.append((b"content-length", str(len(body)).encode()))
        request = Request(method, raw_path, header_list, max_body=self.app.max_body_bytes,
                          query=query.encode("latin-1"), client=("127.0.0.1", 1))
        request.feed(body)  # all of it at once, as a connection does for a body that came with its head
        request.finish()
        response = await self.app(request)
        self.app.answered(request, response.status, 0.001)  # what the connection does once it has written it
        content = [(b"content-type", response.content_type), (b"content-length", str(len(response.body)).encode())]
        return Response(response.status, content + response.headers, b"" if method == "HEAD" else response.body)

    def get(self, path: str, **kwargs) -> Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs) -> Response:
        return self.request("POST", path, **kwargs)

    def options(self, path: str, **kwargs) -> Response:
        return self.request("OPTIONS", path, **kwargs)
