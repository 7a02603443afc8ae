"""MkDocs hooks: the pages, or parts of them, that are generated from the repository at build time.

- `<!-- config: MODULE.CLASS -->`: a table of a config dataclass's fields with their flags, defaults
  and help (the metadata `common.cli.option` gives each field, from which `--help` is made too);
- `<!-- cli: NAME -->`: what `python -m NAME --help` prints (instant: `--help` imports no TensorFlow);
- `<!-- openapi -->`: the server's OpenAPI document for one model named `sentiment`, a table of its
  routes and the whole JSON;
- `<!-- bench: NAME -->`: the table a benchmark last wrote to bench/results/NAME.json
  (`bench/results.py`), with where and when it was measured once above it;
- `<!-- include: FILE -->`: that file of the repository (the CHANGELOG), its links into `docs/` made
  relative to the site.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the code the reference pages are generated from
CLI = re.compile(r"<!-- cli: (\w+) -->")
CONFIG = re.compile(r"<!-- config: ([\w.]+)\.(\w+) -->")
BENCH = re.compile(r"<!-- bench: (\w+) -->")
INCLUDE = re.compile(r"<!-- include: ([\w./-]+) -->")


def _help(command: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", command, "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return f"```text\n{done.stdout.rstrip()}\n```"


def _openapi() -> str:
    from serve.config import ServeConfig
    from serve.http.openapi import openapi_spec

    document = openapi_spec(["sentiment"], ServeConfig().max_rows_per_request)
    rows = ["| method | path | what |", "|---|---|---|"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if isinstance(operation, dict) and "summary" in operation:
                rows.append(f"| {method.upper()} | `{path}` | {operation['summary']} |")
    whole = json.dumps(document, indent=2)
    return "\n".join(rows) + f'\n\n??? note "The whole document"\n    ```json\n' + \
        "\n".join("    " + line for line in whole.splitlines()) + "\n    ```\n"


def _config(module: str, name: str) -> str:
    from common.cli import flag_of

    config = getattr(importlib.import_module(module), name)
    rows = [f"`{module}.{name}`: {config.__doc__.strip()}", "",
            "| field | flag | default | what |", "|---|---|---|---|"]
    for field in dataclasses.fields(config):
        meta = field.metadata
        if meta.get("group"):
            rows.append(f"| **{meta['group']}** | | | |")
        if meta.get("hidden") or "help" not in meta:
            continue
        default = meta.get("shown_default") or repr(field.default)
        cells = (f"`{field.name}`", f"`{flag_of(field)}`", f"`{default}`", meta["help"].replace("|", "\\|"))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _bench(name: str) -> str:
    path = REPO / "bench" / "results" / f"{name}.json"
    if not path.exists():
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{path.relative_to(REPO)} is missing: run the benchmark the page names above "
                          f"<!-- bench: {name} --> (it writes that file)")
    result = json.loads(path.read_text())
    host = result["host"]
    settings = ", ".join(f"{key} {value}" for key, value in result["settings"].items()
                         if value is not None)
    lines = [f"Last run {result['date']} on {host['cpu']} ({host['cores']} cores), commit {result['commit']}: "
             f"`{result['command']}`" + (f"; {settings}." if settings else "."), "",
             "| " + " | ".join(result["columns"]) + " |", "|" + "---|" * len(result["columns"])]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in result["rows"]]
    return "\n".join(lines + [""] + [f"{note[0].upper()}{note[1:]}." for note in result["notes"]])


def _include(name: str) -> str:
    return (REPO / name).read_text().replace("](docs/", "](")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001, ARG001 - MkDocs' hook signature
    markdown = INCLUDE.sub(lambda match: _include(match.group(1)), markdown)
    markdown = BENCH.sub(lambda match: _bench(match.group(1)), markdown)
    markdown = CONFIG.sub(lambda match: _config(match.group(1), match.group(2)), markdown)
    markdown = CLI.sub(lambda match: _help(match.group(1)), markdown)
    if "<!-- openapi -->" in markdown:
        markdown = markdown.replace("<!-- openapi -->", _openapi())
    return markdown
