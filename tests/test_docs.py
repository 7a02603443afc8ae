"""The front door: the README stays short and free of run diaries, the documentation site builds
with `mkdocs build --strict` (a broken link or anchor, a page left out of the nav, a renamed symbol
in a reference page fail it), the reference pages hold what the code defines, the versions agree,
and the built site renders in Chromium without reaching beyond the machine."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from serve_process import REPO

README_WORDS = 1200
DATE_OR_TIME = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b[0-2]?\d:[0-5]\d\b|\btoday\b|\btonight\b", re.I)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def test_the_readme_is_short_and_undated():
    text = (REPO / "README.md").read_text()
    words = len(re.sub(r"```.*?```", "", text, flags=re.S).split())
    assert words <= README_WORDS, f"README.md has {words} words outside code blocks (at most {README_WORDS})"
    assert not DATE_OR_TIME.findall(text), DATE_OR_TIME.findall(text)


def test_the_readme_and_changelog_link_to_files_that_exist():
    """GitHub renders them outside the site, so mkdocs' link check does not cover them."""
    for page in ("README.md", "CHANGELOG.md"):
        targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (REPO / page).read_text())
        assert targets, f"{page} links to no file"
        for target in targets:
            assert (REPO / target).exists(), f"{page} links to {target}, which does not exist"


def test_the_guides_and_design_pages_are_undated():
    """Dates belong to the CHANGELOG and to the benchmark tables (once above each), not to prose."""
    for page in (REPO / "docs").rglob("*.md"):
        if "benchmarks" not in page.parts:
            assert not DATE_OR_TIME.findall(page.read_text()), (page, DATE_OR_TIME.findall(page.read_text()))


def test_both_distributions_the_changelog_and_the_deploy_images_carry_one_version():
    def version(pyproject: Path) -> str:
        return re.search(r'^version = "(.+)"', pyproject.read_text(), re.M).group(1)

    ours = version(REPO / "pyproject.toml")
    assert version(REPO / "client" / "pyproject.toml") == ours
    assert re.search(r"^## \[(.+?)\]", (REPO / "CHANGELOG.md").read_text(), re.M).group(1) == ours
    for manifest in (REPO / "deploy").rglob("*.yaml"):
        for image in re.findall(r"image: localhost/sentiment-dtensor:(\S+)", manifest.read_text()):
            assert image == ours, (manifest, image)


def test_the_site_builds_strictly_with_the_reference_generated_from_the_code(site):
    from client import SentimentClient
    from serve.config import ServeConfig

    client_page = (site / "reference" / "client" / "index.html").read_text()
    public = [name for name, member in vars(SentimentClient).items() if not name.startswith("_") and callable(member)]
    assert public and all(f'id="client.SentimentClient.{name}"' in client_page for name in public), public
    config_page = (site / "reference" / "config" / "index.html").read_text()
    assert all(f"<code>{f.name}</code>" in config_page for f in dataclasses.fields(ServeConfig)
               if not f.metadata.get("hidden"))
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    assert all(f"usage: python -m {stage}" in cli_page for stage in ("train", "export", "serve", "client"))
    assert "/v1/models/{model}:predict" in (site / "reference" / "openapi" / "index.html").read_text()
    assert "Needs a re-export or a retrain" in (site / "changelog" / "index.html").read_text()
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    for result in sorted((REPO / "bench" / "results").glob("*.json")):  # each bench's last run, rendered
        assert f"<!-- bench: {result.stem} -->" in (REPO / "docs" / "benchmarks" / "index.md").read_text(), result
        assert json.loads(result.read_text())["rows"][0][1] in benchmarks, result


@pytest.mark.slow
def test_the_site_renders_in_chromium_offline(site, browser):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        root = f"http://127.0.0.1:{httpd.server_address[1]}/"
        context = browser.new_context()
        outside: list[str] = []
        context.route("**/*", lambda route: (route.continue_() if route.request.url.startswith(root)
                                             else (outside.append(route.request.url), route.abort())))
        try:
            page = context.new_page()
            page.goto(root)
            assert page.title() == "sentiment-dtensor"
            page.get_by_role("link", name="Client API").first.click()
            predict = page.locator('[id="client.SentimentClient.predict"]')
            predict.wait_for()
            assert "predict" in predict.inner_text()
            assert "texts" in page.locator('[id="client.SentimentClient.predict"] + div').inner_text()
        finally:
            context.close()
            httpd.shutdown()
    assert not outside, outside


def code_blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (REPO / "docs" / page).read_text(), re.S)


@pytest.mark.slow
def test_the_getting_started_queries_run_as_written(model_base, tmp_path):
    """Getting started's `curl`, `python -m client` and Python examples, against a real server of the
    test model (its address in place of localhost:8501; the client is already installed here)."""
    from serve_process import ServerProcess

    server = ServerProcess(model_base, log_path=tmp_path / "serve.log")
    address = server.url.removeprefix("http://")
    try:
        shell = next(block for block in code_blocks("getting-started.md", "bash") if "curl" in block)
        for line in shell.splitlines():
            command = line.split("  #")[0].strip()
            if not command or command.startswith("pip install"):
                continue
            command = command.replace("localhost:8501", address)
            if command.startswith("python -m client"):
                command = command.replace("python -m client", f"{sys.executable} -m client --url {server.url}", 1)
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and re.search(r"positive|negative", done.stdout), \
                (command, done.stdout, done.stderr)
        [program] = code_blocks("getting-started.md", "python")
        done = subprocess.run([sys.executable, "-c", program.replace("http://localhost:8501", server.url)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        answers = [line.split() for line in done.stdout.splitlines()]
        assert len(answers) == 2 and all(label in ("positive", "negative") and 0.5 <= float(score) <= 1
                                         for label, score in answers), done.stdout
    finally:
        assert server.stop() == 0
