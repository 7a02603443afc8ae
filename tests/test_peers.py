"""The workers' channel to each other (serve.core.peers): how its directory is cleaned up when they stop."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from serve.core.peers import Peers


def _peers(directory: Path, workers: int) -> list[Peers]:
    async def apply(sources: list) -> None:
        return None

    return [Peers(str(directory), i, workers, lambda: b"", apply) for i in range(workers)]


def test_the_last_worker_out_removes_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "peers"
    directory.mkdir()
    (directory / "models.json").write_text("[]")
    first, second = _peers(directory, 2)

    async def run() -> None:
        await first.start()
        await second.start()
        await first.close()
        assert sorted(p.name for p in directory.iterdir()) == ["models.json", "worker-1.sock"]
        await second.close()

    asyncio.run(run())
    assert not directory.exists()


def test_a_worker_stops_cleanly_when_a_sibling_removed_the_directory_first(tmp_path: Path) -> None:
    # One SIGTERM stops every worker at once: a sibling may finish its cleanup between this worker's steps.
    directory = tmp_path / "peers"
    directory.mkdir()
    (worker,) = _peers(directory, 1)

    async def run() -> None:
        await worker.start()
        shutil.rmtree(directory)
        await worker.close()

    asyncio.run(run())
    assert not directory.exists()
