"""The web page at `GET /`: type reviews, see label and confidence, model version and health.

Plain HTML/CSS/JS from `serve/static/` (no build step, nothing from a CDN). The page calls the
server's own JSON API (`/v1/sentiment`, `/v1/models/{name}`, `/readyz`) with relative URLs, so it
also works behind a reverse proxy that mounts the server under a path prefix.
"""

from __future__ import annotations

from importlib import resources

from flask import Blueprint, Response, current_app, g
from markupsafe import escape

web = Blueprint("web", __name__, static_folder="static", static_url_path="/ui")

# Only the server's own assets; `data:` for the empty favicon that stops a /favicon.ico request.
CSP = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"


@web.before_request
def _route() -> None:
    g.route = "web"  # the metrics label for the page and its assets


@web.route("/", methods=["GET"])
def index() -> Response:
    """index.html with the configured model name put in (the page needs it for /v1/models/NAME)."""
    page = resources.files("serve").joinpath("static/index.html").read_text("utf-8")
    page = page.replace("{{model_name}}", str(escape(current_app.extensions["serve"].config.model_name)))
    return Response(page, mimetype="text/html", headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})
