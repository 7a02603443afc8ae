"""Model versions that never leave the server empty, against a real `python -m serve` process: a
corrupt newest version (also across a restart), empty and half-copied version directories, retired
versions, status texts without server paths, REST input edge cases, and all of it under load."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import MODEL_NAME, add_model_version, copy_model_base
from serve_process import ServerProcess

pytestmark = pytest.mark.slow

POLL = "0.2"


def status_of(srv: ServerProcess) -> list[tuple[str, str, str, str]]:
    body = requests.get(f"{srv.url}/v1/models/{MODEL_NAME}", timeout=10).json()
    return [(s["version"], s["state"], s["status"]["error_code"], s["status"]["error_message"])
            for s in body["model_version_status"]]


def wait_for(condition, timeout: float = 60.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def copy_version(base: Path, src: int, dst: int) -> Path:
    """A finished copy of version `src` as `dst`, renamed into place (atomic)."""
    tmp = base / f".tmp-{dst}"
    shutil.copytree(base / str(src), tmp)
    os.rename(tmp, base / str(dst))
    return base / str(dst)


def truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def broken_version(base: Path, version: int, part: str) -> Path:
    target = copy_version(base, 1, version)
    truncate(target / "saved_model.pb" if part == "graph" else target / "variables" / "variables.data-00000-of-00001")
    return target


def slow_copy(src: Path, dst: Path, seconds: float) -> None:
    """`cp -r` at a crawl: saved_model.pb and the variables index first, then the rest in chunks,
    so the directory looks complete long before it is."""
    files = sorted((p for p in src.rglob("*") if p.is_file()),
                   key=lambda p: (p.name not in ("saved_model.pb", "variables.index"), str(p)))
    chunks = sum(-(-p.stat().st_size // 4096) for p in files)
    pause = seconds / max(1, chunks)
    for path in files:
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "rb") as source, open(target, "wb") as out:
            while data := source.read(4096):
                out.write(data)
                out.flush()
                time.sleep(pause)


@pytest.mark.parametrize("part, cause", [
    ("variables", "its variables or assets are missing, truncated or corrupt"),
    ("graph", "saved_model.pb is not a valid SavedModel (truncated or corrupt)"),
])
def test_a_corrupt_newest_version_falls_back_to_the_one_before_also_after_a_restart(model_base, tmp_path, part, cause):
    base = copy_model_base(model_base, tmp_path)
    srv = ServerProcess(base, "--poll-interval", POLL, log_path=tmp_path / "serve.log")
    try:
        broken_version(base, 2, part)  # while the server runs: it keeps serving version 1
        expected = [("2", "END", "DATA_LOSS", f"version 2 could not be loaded: {cause}"), ("1", "AVAILABLE", "OK", "")]
        wait_for(lambda: status_of(srv) == expected, what=f"version 2 reported broken: {status_of(srv)}")
    finally:
        assert srv.stop() == 0, srv.log()
    srv = ServerProcess(base, "--poll-interval", POLL, log_path=tmp_path / "restart.log")  # waits for /readyz
    try:
        assert status_of(srv) == expected
        r = requests.post(f"{srv.url}/v1/sentiment", json={"texts": ["a great film"]}, timeout=10)
        assert r.status_code == 200 and r.headers["X-Model-Version"] == "1"
        body = requests.get(f"{srv.url}/v1/models/{MODEL_NAME}", timeout=10).text
        assert str(tmp_path) not in body and "/" not in body.replace("\\/", "")  # no server paths
        log = srv.log()
        assert "version 2 failed to load" in log and str(base) in log  # the details are in the log
    finally:
        assert srv.stop() == 0, srv.log()


def test_empty_and_half_copied_versions_wait_quietly_then_load(model_base, tmp_path):
    base = copy_model_base(model_base, tmp_path)
    source = add_model_version(base, 2)
    shutil.move(source, tmp_path / "v2")  # a finished export, outside the model directory
    srv = ServerProcess(base, "--poll-interval", POLL, log_path=tmp_path / "serve.log")
    try:
        (base / "5").mkdir()  # empty: ignored, no status entry, no log line
        seen: list[list[tuple]] = []
        copying = threading.Thread(target=slow_copy, args=(tmp_path / "v2", base / "7", 2.5))
        copying.start()
        while copying.is_alive():
            seen.append(status_of(srv))
            time.sleep(0.05)
        assert all(status == [("1", "AVAILABLE", "OK", "")] for status in seen), seen
        wait_for(lambda: status_of(srv) == [("7", "AVAILABLE", "OK", "")], what="version 7 live, 1 retired")
        log = srv.log()
        assert "failed to load" not in log and "version 5" not in log
        assert requests.get(f"{srv.url}/v1/models/{MODEL_NAME}/versions/5", timeout=10).status_code == 404
    finally:
        assert srv.stop() == 0, srv.log()


def test_rest_input_edge_cases_follow_tf_serving(model_base, tmp_path):
    srv = ServerProcess(model_base, "--poll-interval", "0", log_path=tmp_path / "serve.log")
    url = f"{srv.url}/v1/models/{MODEL_NAME}:predict"
    try:
        for value in (0, False, [], {}):
            r = requests.post(url, json={"signature_name": value, "instances": ["good"]}, timeout=10)
            assert (r.status_code, r.json()) == (400, {"error": "'signature_name' key must be a string value."})
        for b64 in ("YWJj=", "YWJj==", "YWI"):
            r = requests.post(url, json={"instances": [{"b64": b64}]}, timeout=10)
            assert r.status_code == 400 and "Unable to base64 decode" in r.json()["error"], r.text
        r = requests.post(url, json={"instances": [{"b64": "YWJj"}]}, timeout=10)
        assert r.status_code == 200
        r = requests.post(f"{srv.url}/v1/models/{MODEL_NAME}:classify", json={"examples": [{"text": 7}]}, timeout=10)
        assert (r.status_code, r.json()) == (400, {"error": "examples[0].text: expected one string, got int64_list"})
    finally:
        assert srv.stop() == 0, srv.log()


def test_versions_come_and_go_under_load_without_a_failed_request(model_base, tmp_path):
    base = copy_model_base(model_base, tmp_path)
    add_model_version(base, 2)
    finished = add_model_version(base, 6)
    shutil.move(finished, tmp_path / "v6")
    good = base / "2"
    shutil.move(good, tmp_path / "v2")
    srv = ServerProcess(base, "--poll-interval", POLL, log_path=tmp_path / "serve.log")
    stop = threading.Event()
    failures: list[str] = []
    versions: list[list[int]] = [[] for _ in range(6)]

    def load(k: int) -> None:
        session = requests.Session()
        while not stop.is_set():
            try:
                r = session.post(f"{srv.url}/v1/sentiment", json={"texts": [f"a fine film #{k}"]}, timeout=20)
                if r.status_code == 200:
                    versions[k].append(int(r.headers["X-Model-Version"]))
                else:
                    failures.append(f"{r.status_code} {r.text}")
            except requests.RequestException as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=load, args=(k,)) for k in range(len(versions))]
    try:
        for t in threads:
            t.start()
        broken_version(base, 3, "variables")
        wait_for(lambda: any(s[0] == "3" and s[1] == "END" for s in status_of(srv)), what="3 reported broken")
        (base / "4").mkdir()
        slow_copy(tmp_path / "v2", base / "5", 2.0)  # a valid version, copied non-atomically
        wait_for(lambda: ("5", "AVAILABLE", "OK", "") in status_of(srv), what="5 live")
        os.rename(tmp_path / "v6", base / "6")  # a finished export, renamed into place
        wait_for(lambda: all(v and v[-1] == 6 for v in versions), what="every client on version 6")
        shutil.rmtree(base / "3")  # the broken one is deleted: its error goes with it
        wait_for(lambda: [s[:2] for s in status_of(srv)] == [("6", "AVAILABLE")], what="only 6 left")
    finally:
        stop.set()
        for t in threads:
            t.join()
        assert srv.stop() == 0, srv.log()
    assert failures == []
    for seen in versions:
        assert seen[0] == 1 and seen[-1] == 6 and seen == sorted(seen)  # never back to an older version
    assert "version 5 failed" not in srv.log_path.read_text()


def test_status_json_is_what_tf_serving_reports(model_base, tmp_path):
    """Retired versions leave the status list (TF Serving keeps the versions its policy serves)."""
    base = copy_model_base(model_base, tmp_path)
    srv = ServerProcess(base, "--poll-interval", POLL, log_path=tmp_path / "serve.log")
    try:
        add_model_version(base, 2)
        wait_for(lambda: status_of(srv) == [("2", "AVAILABLE", "OK", "")], what="2 live, 1 retired")
        r = requests.get(f"{srv.url}/v1/models/{MODEL_NAME}/versions/1", timeout=10)
        assert (r.status_code, r.json()) == (404, {"error": f"Could not find version 1 of model {MODEL_NAME}"})
        assert json.loads(requests.get(f"{srv.url}/readyz", timeout=10).text)["versions"] == ["2"]
    finally:
        assert srv.stop() == 0, srv.log()
