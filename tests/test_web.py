"""The web page at `GET /`: routes through the REST app in process, then headless Chromium driving
the page against a real `python -m serve` process (Debian's /usr/bin/chromium; no browser download)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import requests
from app_client import AppClient, LoopThread
from conftest import MODEL_NAME
from playwright.sync_api import Page, expect
from serve_process import REPO, ServerProcess

from serve import ServeConfig, ServingCore, create_app

ASSETS = {"/ui/app.js": "text/javascript; charset=utf-8", "/ui/style.css": "text/css; charset=utf-8"}
# Strong reviews in the bundled corpus's vocabulary: the tiny test model scores them > 0.99. (It calls
# "A boring, awful mess. I hated every minute." positive: "hated" is not in the corpus, and "every
# minute" comes from the positive phrase "I loved every minute of it".)
POSITIVE = "A brilliant, moving film with superb acting. Highly recommended."
NEGATIVE = "An awful, boring, tedious mess. I want those two hours back."
MAX_TEXT_BYTES = 1000

expect.set_options(timeout=20_000)  # two shared CPU cores: be patient, the checks are exact anyway


# -- routes --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def make_client(model_base):
    """Factory: (config overrides) -> in-process client. The page needs no loaded model."""
    loop = LoopThread()

    def make(**overrides):
        config = ServeConfig(model_dir=str(model_base), poll_interval_s=0, **overrides)
        return AppClient(create_app(config, ServingCore(config)), loop)

    yield make
    loop.close()


def test_page_and_assets_are_local(make_client):
    client = make_client()
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    html = page.text
    assert f'data-model="{MODEL_NAME}"' in html
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert set(re.findall(r'(?:src|href)="([^"]+)"', html)) == {"ui/app.js", "ui/style.css", "data:,"}
    for path, mimetype in ASSETS.items():
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"] == mimetype, (path, r.status_code, r.headers)
        assert r.text.strip()
    for path, body in [("/", html), *((p, client.get(p).text) for p in ASSETS)]:
        assert not re.findall(r"(?:https?:)?//[\w.-]+\.\w", body), f"{path} refers to another host"


def test_model_name_is_escaped(make_client):
    html = make_client(model_name='a"<b>').get("/").text
    assert 'data-model="a&quot;&lt;b&gt;"' in html and "<b>" not in html


@pytest.mark.parametrize("path", ["/ui/nope.js", "/ui/../app.py", "/ui/index.html", "/ui/"])
def test_unknown_asset_is_404(make_client, path):
    r = make_client().get(path)
    assert r.status_code == 404 and "error" in r.json


# -- the page in headless Chromium -----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--max-text-bytes", str(MAX_TEXT_BYTES),
                        log_path=tmp_path_factory.mktemp("web") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def console_errors() -> list[str]:
    """The page's console errors and uncaught exceptions (a CSP violation would show here)."""
    return []


def open_page(context, url: str, console_errors: list[str]) -> Page:  # noqa: ANN001 - a BrowserContext
    """A new page of `context` at `url`, its console errors and uncaught exceptions collected."""
    page = context.new_page()
    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))
    page.goto(url)
    return page


@pytest.fixture
def page(browser, server, console_errors):
    """A fresh page on the server's `/`, loaded and showing the model version and health."""
    context = browser.new_context(viewport={"width": 900, "height": 760})
    try:
        page = open_page(context, server.url + "/", console_errors)
        expect(page.locator("#model-name")).to_have_text(MODEL_NAME)
        expect(page.locator("#model-version")).to_have_text("version 1")
        expect(page.locator("#health-text")).to_have_text("ready")
        yield page
    finally:
        context.close()


def _screenshot(page: Page, name: str, tmp_path) -> None:
    artifacts = REPO / "artifacts"
    artifacts.mkdir(exist_ok=True)
    page.screenshot(path=tmp_path / name, full_page=True)
    shutil.copy(tmp_path / name, artifacts / name)


@pytest.mark.slow
def test_predict_renders_labels_and_bars(page, console_errors, tmp_path):
    page.get_by_label("Reviews, one per line").fill(f"{POSITIVE}\n\n  {NEGATIVE}  \n")
    page.get_by_role("button", name="Predict").click()
    results = page.locator("#results .result")
    expect(results).to_have_count(2)
    expect(results.locator(".label")).to_have_text(["positive", "negative"])
    expect(results.locator(".text")).to_have_text([POSITIVE, NEGATIVE])
    expect(page.locator("#results-meta")).to_contain_text("2 reviews, version 1")
    expect(page.locator("#error")).to_be_hidden()
    for i in range(2):
        pct = float(results.nth(i).locator(".pct").inner_text().rstrip("%"))
        bar = results.nth(i).locator(".bar").bounding_box()
        fill = results.nth(i).locator(".fill").bounding_box()
        assert pct > 90 and bar["width"] > 50
        assert fill["width"] / bar["width"] == pytest.approx(pct / 100, abs=0.02)
    _screenshot(page, "web_page.png", tmp_path)

    # Ctrl+Enter submits too, and a narrow window needs no sideways scrolling.
    page.set_viewport_size({"width": 360, "height": 740})
    page.get_by_label("Reviews, one per line").fill(NEGATIVE)
    page.get_by_label("Reviews, one per line").press("Control+Enter")
    expect(results.locator(".label")).to_have_text(["negative"])
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    _screenshot(page, "web_page_narrow.png", tmp_path)
    assert console_errors == []


@pytest.mark.slow
def test_words_are_highlighted_by_their_contribution(page, console_errors, tmp_path):
    """The explanation arrives after the verdict and marks the review's words: blue and underlined
    for positive, orange and dashed for negative, the exact weight on hover."""
    page.get_by_label("Reviews, one per line").fill(f"{POSITIVE}\n{NEGATIVE}")
    page.get_by_role("button", name="Predict").click()
    results = page.locator("#results .result")
    expect(results.nth(1).locator(".text.explained")).to_have_count(1)
    expect(page.locator("#legend")).to_be_visible()
    for i, text, kind in ((0, POSITIVE, "pro"), (1, NEGATIVE, "con")):
        paragraph = results.nth(i).locator(".text")
        expect(paragraph).to_have_text(text)  # marking words keeps the text as typed
        strongest = paragraph.locator("mark.strong")
        assert strongest.count() >= 1
        assert all(c.startswith(f"{kind} ") for c in strongest.evaluate_all("ms => ms.map(m => m.className)"))
        title = strongest.first.get_attribute("title")
        assert re.fullmatch(r"[+-]\d+\.\d\d toward positive", title) and (title[0] == "+") == (kind == "pro")
        style = strongest.first.evaluate("m => [getComputedStyle(m).textDecorationStyle, "
                                         "getComputedStyle(m).textDecorationLine]")
        assert style == ["solid" if kind == "pro" else "dashed", "underline"]  # readable without colour
        # the screenshot shows the highlight: the mark's pixels lean blue (positive) or orange (negative)
        from PIL import Image

        strongest.first.screenshot(path=tmp_path / f"mark{i}.png")
        pixels = np.asarray(Image.open(tmp_path / f"mark{i}.png").convert("RGB"), dtype=float).reshape(-1, 3)
        red, _, blue = pixels.mean(axis=0)
        assert (blue > red + 15) if kind == "pro" else (red > blue + 15), (kind, pixels.mean(axis=0))
    _screenshot(page, "web_page_explained.png", tmp_path)
    assert console_errors == []


@pytest.mark.slow
def test_errors_are_shown_in_words(page, console_errors, tmp_path):
    reviews = page.get_by_label("Reviews, one per line")
    predict = page.get_by_role("button", name="Predict")
    error = page.get_by_role("alert")
    results = page.locator("#results .result")

    reviews.fill(POSITIVE)
    predict.click()
    expect(results).to_have_count(1)

    reviews.fill(" \n\n")
    predict.click()
    expect(error).to_have_text("Type or paste at least one review, one per line.")
    expect(results).to_have_count(0)  # old results cleared, so they can't pass for answers

    reviews.fill("x" * (MAX_TEXT_BYTES + 1))  # the server's 400, word for word
    predict.click()
    expect(error).to_have_text(f"The server answered 400: texts[0]: text is {MAX_TEXT_BYTES + 1} bytes, "
                               f"more than the limit of {MAX_TEXT_BYTES}")
    assert len(console_errors) == 1 and "status of 400" in console_errors[0], console_errors  # only the 400 itself

    # The network fails: the error says so and the health line turns to "unreachable" at once.
    page.route("**/readyz", lambda route: route.abort())
    page.route("**/v1/sentiment", lambda route: route.abort())
    reviews.fill(POSITIVE)
    predict.click()
    expect(error).to_have_text(re.compile(r"^Could not reach the server \(.+\)\.$"))
    expect(page.locator("#health-text")).to_have_text("server unreachable")
    _screenshot(page, "web_page_errors.png", tmp_path)

    page.unroute_all()
    reviews.fill(POSITIVE)
    predict.click()
    expect(results.locator(".label")).to_have_text(["positive"])
    expect(error).to_be_hidden()


@pytest.mark.slow
def test_the_monitoring_panel_shows_the_traffic_beside_the_training_data(browser, model_base, console_errors,
                                                                        tmp_path):
    """Traffic like the training data, then product descriptions: the panel's line turns from
    "looks like training data" to "drifting" (in the warning colour), beside bars of both."""
    from conftest import copy_model_base
    from test_monitoring import like_training, product_descriptions, send

    server = ServerProcess(copy_model_base(model_base, tmp_path / MODEL_NAME), "--monitoring-window", "200",
                           log_path=tmp_path / "serve.log")
    context = browser.new_context(viewport={"width": 900, "height": 1100})
    try:
        page = open_page(context, server.url + "/", console_errors)
        line = page.locator("#monitoring .monitor[data-version='1'] .drift-line")
        expect(line).to_have_text("No reviews answered yet.")
        send(server, like_training(300))
        page.reload()
        expect(line).to_have_text("Looks like training data.")
        charts = page.locator("#monitoring .histogram")
        expect(charts).to_have_count(3)
        baseline = requests.get(f"{server.url}/v1/models/{MODEL_NAME}/monitoring", timeout=10).json()
        edges = baseline["versions"][0]["baseline"]["edges"]
        for i, name in enumerate(("words", "unknown_ngram_share", "positive_probability")):
            expect(charts.nth(i).locator(".pair")).to_have_count(len(edges[name]) + 1)
        _screenshot(page, "web_page_monitoring.png", tmp_path)

        send(server, product_descriptions(300))
        page.reload()
        expect(line).to_have_attribute("data-verdict", "drifting")
        expect(line).to_contain_text(re.compile(r"^Drifting: \d+% of reviews unlike training"))
        assert page.locator("#monitoring figcaption.shifted").count() >= 2  # length and unknown n-grams
        from PIL import Image

        line.screenshot(path=tmp_path / "line.png")
        pixels = np.asarray(Image.open(tmp_path / "line.png").convert("RGB"), dtype=float).reshape(-1, 3)
        dark = pixels[pixels.sum(axis=1) < 600]  # the text, not the background
        red, green, blue = dark.mean(axis=0)
        assert red > green + 30 and red > blue + 30, dark.mean(axis=0)
        _screenshot(page, "web_page_drifting.png", tmp_path)
        assert console_errors == []
    finally:
        context.close()
        assert server.stop() == 0, server.log()
