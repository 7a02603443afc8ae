"""The workers of one `--workers N` server, to each other: one Unix socket per worker,
`worker-I.sock` in a directory the supervisor made.

A sibling asks a worker for its metrics (so a scrape landing on any worker covers all of them), or
tells it to apply a new set of models (so a ReloadConfig reaching one worker reaches all). The
set last applied that way is kept in the same directory: a worker that starts later (a restart
after a crash) serves it too, instead of the one the server started with.

A request is one byte saying what is asked, then its payload; the asker half-closes, the worker
answers and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from typing import Awaitable, Callable, Sequence

from serve.core.errors import Unavailable
from serve.core.model_versions import ModelSource

log = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 1.0
"""How long a scrape waits for a sibling worker's metrics before leaving them out."""
APPLY_TIMEOUT_S = 60.0
"""How long a reload waits for a sibling to confirm it applied the new models."""
_PING, _METRICS, _APPLY, _MONITORING = b"P", b"M", b"C", b"D"
SAVED_MODELS = "models.json"


def _encode(sources: Sequence[ModelSource]) -> bytes:
    return json.dumps([dataclasses.asdict(s) for s in sources]).encode()


def _decode(data: bytes) -> list[ModelSource]:
    return [ModelSource(s["name"], s["base_path"], s["version_policy"], tuple(s["versions"]),
                        tuple((label, version) for label, version in s["version_labels"]), s["num_latest"])
            for s in json.loads(data)]


def saved_models(directory: str) -> list[ModelSource] | None:
    """The models a reload last gave every worker of this server, if one did."""
    try:
        with open(os.path.join(directory, SAVED_MODELS), "rb") as f:
            return _decode(f.read())
    except (OSError, ValueError, KeyError):
        return None


def _remove_if_last(directory: str) -> None:
    """The last worker out removes the directory, also when the supervisor was killed. Siblings stop
    at the same moment (one SIGTERM reaches them all), so any of them may already have removed it."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    if any(name.endswith(".sock") for name in names):
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)


class Peers:
    """This worker's side of the channel: it answers its siblings and asks them."""

    def __init__(self, directory: str, index: int, workers: int, metrics: Callable[[], bytes],
                 apply: Callable[[list[ModelSource]], Awaitable[None]],
                 monitoring: Callable[[str], dict] | None = None) -> None:
        """`metrics()`: this worker's exposition; `apply(sources)`: serve these models from now on;
        `monitoring(model)`: this worker's drift windows of that model's versions (plain JSON)."""
        self.directory, self.index, self.workers = directory, index, workers
        self._metrics, self._apply, self._monitoring = metrics, apply, monitoring
        self._server: asyncio.AbstractServer | None = None

    def _path(self, index: int) -> str:
        return os.path.join(self.directory, f"worker-{index}.sock")

    async def start(self) -> None:
        path = self._path(self.index)
        if os.path.exists(path):
            os.unlink(path)  # left by this worker's predecessor
        self._server = await asyncio.start_unix_server(self._answer, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        with contextlib.suppress(OSError):
            os.unlink(self._path(self.index))
        _remove_if_last(self.directory)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.read()
            kind, payload = request[:1], request[1:]
            if kind == _METRICS:
                writer.write(self._metrics())
            elif kind == _MONITORING and self._monitoring is not None:
                writer.write(json.dumps(self._monitoring(payload.decode())).encode())
            elif kind == _APPLY:
                await self._apply(_decode(payload))
                writer.write(b"ok")
            else:
                writer.write(b"ok")
            await writer.drain()
        except Exception as exc:  # noqa: BLE001 - told to the asking sibling, which reports it
            log.exception("a request from a sibling worker failed")
            writer.write(b"error " + str(exc).encode()[:500])
        finally:
            writer.close()

    async def _ask(self, index: int, kind: bytes, payload: bytes, timeout_s: float) -> bytes:
        async def ask() -> bytes:
            reader, writer = await asyncio.open_unix_connection(self._path(index))
            writer.write(kind + payload)
            writer.write_eof()
            answer = await reader.read()
            writer.close()
            return answer

        return await asyncio.wait_for(ask(), timeout_s)

    def _siblings(self) -> list[int]:
        return [i for i in range(self.workers) if i != self.index]

    # -- metrics -----------------------------------------------------------------------------------

    async def metrics_of_all(self) -> dict[int, bytes]:
        """Every worker's metrics that answer within METRICS_TIMEOUT_S, by worker (a worker being
        restarted is left out of this scrape)."""
        texts = {self.index: self._metrics()}
        fetched = await asyncio.gather(*(self._fetch_metrics(i) for i in self._siblings()))
        texts.update((i, text) for i, text in fetched if text is not None)
        return texts

    async def _fetch_metrics(self, index: int) -> tuple[int, bytes | None]:
        try:
            return index, await self._ask(index, _METRICS, b"", METRICS_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            log.debug("metrics of worker %d left out of this scrape: %s", index, exc)
            return index, None

    async def monitoring_of_all(self, model: str) -> dict[int, dict]:
        """Every worker's drift windows of `model` that answer within METRICS_TIMEOUT_S, by worker."""
        windows = {self.index: self._monitoring(model) if self._monitoring else {}}

        async def fetch(index: int) -> tuple[int, dict | None]:
            try:
                return index, json.loads(await self._ask(index, _MONITORING, model.encode(), METRICS_TIMEOUT_S))
            except (OSError, ValueError, asyncio.TimeoutError) as exc:
                log.debug("drift windows of worker %d left out: %s", index, exc)
                return index, None

        fetched = await asyncio.gather(*(fetch(i) for i in self._siblings()))
        windows.update((i, w) for i, w in fetched if isinstance(w, dict))
        return windows

    # -- models ------------------------------------------------------------------------------------

    async def apply_everywhere(self, sources: list[ModelSource]) -> None:
        """Every worker serves `sources` once this returns. Unavailable (and nothing changed) while a
        sibling is not running; Unavailable naming the workers that did not confirm otherwise."""
        siblings = self._siblings()
        pings = await asyncio.gather(*(self._ask(i, _PING, b"", METRICS_TIMEOUT_S) for i in siblings),
                                     return_exceptions=True)
        absent = [i for i, answer in zip(siblings, pings) if answer != b"ok"]
        if absent:
            raise Unavailable(f"worker {', '.join(map(str, absent))} of {self.workers} is not running (being "
                              "restarted?): nothing was changed; try again in a few seconds")
        saved = os.path.join(self.directory, SAVED_MODELS)
        with open(saved + ".tmp", "wb") as f:
            f.write(_encode(sources))
        os.replace(saved + ".tmp", saved)  # a worker starting from now on serves these
        payload = _encode(sources)
        answers = await asyncio.gather(self._apply(sources),
                                       *(self._ask(i, _APPLY, payload, APPLY_TIMEOUT_S) for i in siblings),
                                       return_exceptions=True)
        failed = {}
        for i, answer in zip([self.index, *siblings], answers):
            if isinstance(answer, BaseException) or (i != self.index and answer != b"ok"):
                failed[i] = answer.decode(errors="replace") if isinstance(answer, bytes) else repr(answer)
        if failed:
            for i, why in failed.items():
                log.error("worker %d did not apply the new models: %s", i, why)
            raise Unavailable(f"the new models were applied by {self.workers - len(failed)} of {self.workers} "
                              f"workers; worker {', '.join(map(str, failed))} did not confirm (see the server log)")

    def forget_saved(self) -> None:
        """The models now come from --model-config-file again (it changed)."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, SAVED_MODELS))

