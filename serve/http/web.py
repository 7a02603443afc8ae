"""The web page at `GET /`: type reviews, see label and confidence, model version and health.

Plain HTML/CSS/JS from `serve/http/static/` (no build step, nothing from a CDN), read once at start.
The page calls the server's own JSON API (`/v1/sentiment`, `/v1/models/{name}`, `/readyz`) with
relative URLs, so it also works behind a reverse proxy that mounts the server under a prefix.
"""

from __future__ import annotations

import html
from importlib import resources

from serve.http.routing import HttpError, Request, Response, Route

# Only the server's own assets; `data:` for the empty favicon that stops a /favicon.ico request.
CSP = b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
_TYPES = {".js": b"text/javascript; charset=utf-8", ".css": b"text/css; charset=utf-8"}


class WebPage:
    def __init__(self, model_name: str) -> None:
        static = resources.files("serve.http").joinpath("static")
        page = static.joinpath("index.html").read_text("utf-8")
        self._index = page.replace("{{model_name}}", html.escape(model_name, quote=True)).encode("utf-8")
        self._assets = {
            entry.name: (entry.read_bytes(), _TYPES[suffix])
            for entry in static.iterdir()
            for suffix in [entry.name[entry.name.rfind("."):]]
            if suffix in _TYPES
        }

    async def index(self, _request: Request) -> Response:
        """index.html with the model name put in (the page needs it for /v1/models/NAME)."""
        return Response(self._index, 200, b"text/html; charset=utf-8",
                        [(b"content-security-policy", CSP), (b"cache-control", b"no-cache")])

    async def asset(self, request: Request) -> Response:
        name = request.match["asset"]
        if name not in self._assets:
            raise HttpError(404, f"Not Found: no asset {name!r}")
        body, content_type = self._assets[name]
        return Response(body, 200, content_type, [(b"cache-control", b"no-cache")])


def routes(page: WebPage) -> list[Route]:
    return [
        Route.of("web", "GET", r"/", page.index, scope="open"),
        Route.of("web", "GET", r"/ui/(?P<asset>[^/]+)", page.asset, scope="open"),
    ]
