"""The front door: the README stays short and free of run diaries, the documentation site builds
with `mkdocs build --strict` (a broken link or anchor, a page left out of the nav, a renamed symbol
in a reference page fail it), the reference pages hold what the code defines, the versions agree,
and the built site renders in Chromium without reaching beyond the machine."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import os
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
    released = re.findall(r"^## \[(.+?)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert [v for v in released if v != "Unreleased"][0] == ours  # the newest release is this version
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


GUIDE_PAGES = ["getting-started.md", *(f"guides/{p.name}" for p in sorted((REPO / "docs" / "guides").glob("*.md")))]
STAGES = ("train", "export", "serve", "client")
PARSE_ONLY = """
import json, sys
stage, cases = sys.argv[1], json.loads(sys.argv[2])
if stage == "train":
    from train.__main__ import _config, _parser

    def parse(argv):
        parser = _parser()
        args = parser.parse_args(argv)
        return args if args.launch_local else _config(parser, args)
else:
    parse = __import__(f"{stage}.__main__", fromlist=["parse_args"]).parse_args
for page, argv in cases:
    try:
        parse(argv)
    except (SystemExit, ValueError) as exc:
        print(f"{page}: python -m {stage} {' '.join(argv)}: {exc}", file=sys.stderr)
        sys.exit(1)
"""


def guide_commands() -> dict[str, list[tuple[str, list[str]]]]:
    """Every `python -m STAGE ...` line of the guides' shell blocks, by stage: (page, argv)."""
    import shlex

    commands: dict[str, list[tuple[str, list[str]]]] = {stage: [] for stage in STAGES}
    for page in GUIDE_PAGES:
        for block in code_blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line.split("  #")[0], comments=True)
                while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the command
                    words.pop(0)
                if words[:2] in (["python", "-m"], ["python3", "-m"]) and len(words) > 2 and words[2] in STAGES:
                    commands[words[2]].append((page, words[3:]))
    return commands


def test_every_command_line_in_the_guides_parses_with_the_flags_it_has(tmp_path):
    """The guides' `python -m ...` lines, parsed (not run) by their command's own parser and config
    checks, in a directory that holds the input files they name: a renamed or removed flag,
    or a value the command refuses, fails here."""
    commands = guide_commands()
    assert all(commands[stage] for stage in STAGES), {stage: len(found) for stage, found in commands.items()}
    for word in {word for cases in commands.values() for _, argv in cases for word in argv}:
        if re.fullmatch(r"[\w-]+\.(txt|pem|crt|key)|tokens?", word):
            (tmp_path / word).write_text("a fine film\n" if word.endswith(".txt") else "t0ken\n")
    for stage, cases in commands.items():
        done = subprocess.run([sys.executable, "-c", PARSE_ONLY, stage, json.dumps(cases)], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_client_guide_runs_as_written(model_base, tmp_path):
    """The client guide's Python session and its command lines, REST and both gRPC transports,
    against a real server of the test model (its addresses in place of localhost:8501 and :8500);
    the lines that need a certificate or a token are covered by the security tests."""
    from serve_process import ServerProcess

    server = ServerProcess(model_base, grpc=True, log_path=tmp_path / "serve.log")
    rest, grpc = server.url.removeprefix("http://"), server.grpc_target

    def here(text: str) -> str:
        return text.replace("localhost:8501", rest).replace("localhost:8500", grpc)

    try:
        session = code_blocks("guides/client.md", "python")[0].split("\n\n")
        program = here("\n\n".join(part for part in session if "ca_file" not in part))
        done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(done.stdout.splitlines()) == 2 and all(line.split()[0] in ("positive", "negative")
                                                           for line in done.stdout.splitlines()), done.stdout
        (tmp_path / "reviews.txt").write_text("great movie\nawful plot\n")
        lines = [line.split("  #")[0].strip() for block in code_blocks("guides/client.md", "bash")
                 for line in block.splitlines() if line.startswith("python -m client") and "--ca-file" not in line]
        assert len(lines) >= 4, lines
        for line in lines:
            command = here(line).replace("python -m client", f"{sys.executable} -m client", 1)
            if "--url" not in command:
                command += f" --url {server.url}"
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            assert done.returncode == 0 and re.search(r"positive|negative", done.stdout), \
                (command, done.stdout, done.stderr)
        [stock] = [block for block in code_blocks("guides/client.md", "python") if "tensorflow_serving" in block]
        done = subprocess.run([sys.executable, "-c", here(stock)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and "string_val" in done.stdout, done.stderr[-3000:]
    finally:
        assert server.stop() == 0
