"""Dynamic batching on asyncio: concurrent requests for the same model call are merged into one.

A request is a dict of input arrays with the same number of rows. `Batcher.submit` queues it and
awaits a future that receives its own slice of the merged outputs. Worker tasks (one per model
call allowed at once) take the head of the queue, then keep taking queued requests for the same
runner (FIFO, never reordered) up to `max_batch_size` rows, and run the merged call in a small
thread pool, so the event loop keeps reading requests while the model computes. Requests that
arrive during a model call form the next batch: under load batches fill up by themselves.

The queue is bounded by rows (`max_queued_rows`): past it `submit` fails at once with the
configured overload error rather than growing memory. Every request has a deadline; one that
expires while queued is never run, and its caller gets `DeadlineExceeded` at the deadline.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import numpy as np

from serve.core.errors import DeadlineExceeded, Internal, InvalidArgument, ServingError, Unavailable

log = logging.getLogger(__name__)

INLINE_MAX_S = 0.002
"""A single-row model call this fast may run on the event loop when its request is alone (see
`Batcher._run_inline`): the loop is blocked no longer than a request's own parsing takes at load."""

Arrays = Mapping[str, np.ndarray]
Runner = Callable[[Arrays], Mapping[str, np.ndarray]]
"""A model call: input arrays (rows on axis 0) -> output arrays with the same rows."""


class _Arrival:
    """`with batcher.receiving():` - counts a request being read; one object per batcher, reused
    (a generator-based context manager per request costs more than the count it keeps)."""

    __slots__ = ("batcher",)

    def __init__(self, batcher: "Batcher") -> None:
        self.batcher = batcher

    def __enter__(self) -> None:
        self.batcher.arriving += 1

    def __exit__(self, *_exc: object) -> None:
        self.batcher.arriving -= 1


class _Request:
    __slots__ = ("runner", "inputs", "rows", "future")

    def __init__(self, runner: Runner, inputs: Arrays, rows: int, future: asyncio.Future) -> None:
        self.runner = runner
        self.inputs = inputs
        self.rows = rows
        self.future = future


class Batcher:
    def __init__(
        self,
        *,
        max_batch_size: int = 64,
        batch_timeout_s: float = 0.002,
        max_queued_rows: int = 4096,
        num_threads: int = 1,
        overloaded: Callable[[str], ServingError],
        on_batch: Callable[[int, int, float], None] | None = None,
        alone: Callable[[], bool] | None = None,
    ) -> None:
        """`overloaded(message)` builds the error for a full queue (429 or 503, per config);
        `on_batch(rows, requests, seconds)` is called after every model call (metrics);
        `alone()` says whether the caller of `submit` is the only request the server is handling
        (then a fast model is called at once, see `submit`).

        Merging requests does not change their answers: the exported model computes each row on
        its own (`common.model.inference_logits`), so no row is padded or reordered here.
        """
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_s
        self.max_queued_rows = max_queued_rows
        self._overloaded = overloaded
        self._on_batch = on_batch
        self._num_threads = num_threads
        self._queue: collections.deque[_Request] = collections.deque()
        self._queued_rows = 0
        self._idle: collections.deque[asyncio.Future] = collections.deque()  # workers waiting for work
        self._executor: ThreadPoolExecutor | None = None
        self._workers: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.arriving = 0
        """Requests received by an edge that will submit soon (see `receiving`); a batch waits (up
        to `batch_timeout_s`) for them only."""
        self._arrival = _Arrival(self)
        self._alone = alone
        self._running = 0
        """Model calls running now (in the executor or inline)."""
        self._inline_ok = False
        """The last single-row call took under INLINE_MAX_S: the next one alone may run inline."""

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def start(self) -> "Batcher":
        """Start the worker tasks on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self._num_threads, thread_name_prefix="model")
        self._workers = [self._loop.create_task(self._work(), name=f"batcher-{i}") for i in range(self._num_threads)]
        return self

    def receiving(self) -> _Arrival:
        """Wrap the reading and decoding of a request that will submit here: meanwhile a batch
        about to run waits for it (up to `batch_timeout_s`), and stops waiting as soon as it is
        decoded, submitted or failed."""
        return self._arrival

    async def submit(self, runner: Runner, inputs: Arrays, timeout_s: float) -> dict[str, np.ndarray]:
        """Run `runner` on `inputs` as part of a batch; the result, or DeadlineExceeded after `timeout_s`."""
        rows = _rows(inputs)
        if self._closing or self._loop is None:
            raise Unavailable("server is shutting down")
        if self._queue and self._queued_rows + rows > self.max_queued_rows:
            raise self._overloaded(
                f"server overloaded: {self._queued_rows} rows queued (max {self.max_queued_rows}); retry later"
            )
        if rows == 1 and self._inline_ok and not self._queue and not self._running and not self.arriving \
                and self._alone is not None and self._alone():
            return self._run_inline(runner, inputs)
        future = self._loop.create_future()
        self._queue.append(_Request(runner, inputs, rows, future))
        self._queued_rows += rows
        self._wake_one()
        timer = self._loop.call_later(max(0.0, timeout_s), _expire, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _run_inline(self, runner: Runner, inputs: Arrays) -> dict[str, np.ndarray]:
        """A request alone, on a model that answers one row quickly: called here, on the event loop,
        without the hop to the model thread and back (there is nothing to batch it with, and nothing
        else for the loop to do meanwhile). A call that turns out slow sends the next ones back to
        the model thread."""
        self._running += 1
        start = time.perf_counter()
        try:
            outputs = runner(inputs)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            raise _as_serving_error(exc) from None
        finally:
            self._running -= 1
            seconds = time.perf_counter() - start
            self._inline_ok = seconds < INLINE_MAX_S
        if self._on_batch is not None:
            self._on_batch(1, 1, seconds)
        return dict(outputs)

    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting work, finish what is queued, stop the workers and the model threads."""
        self._closing = True
        while self._idle:
            _wake(self._idle.popleft())
        if self._workers:
            await asyncio.wait(self._workers, timeout=timeout)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- worker side -------------------------------------------------------------------------

    def _wake_one(self) -> None:
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _wait_for_work(self, timeout: float | None = None) -> None:
        waiter = self._loop.create_future()
        self._idle.append(waiter)
        if timeout is None:
            await waiter
            return
        handle = self._loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            handle.cancel()

    def _pop_live(self) -> _Request | None:
        """The next queued request whose caller is still waiting (expired ones are dropped)."""
        while self._queue:
            request = self._queue.popleft()
            self._queued_rows -= request.rows
            if not request.future.done():
                return request
        return None

    async def _take_batch(self) -> list[_Request] | None:
        while True:
            first = self._pop_live()
            if first is not None:
                break
            if self._closing:
                return None
            await self._wait_for_work()
        batch, rows = [first], first.rows
        if not getattr(first.runner, "mergeable", True):
            return batch  # its outputs' shape depends on the whole call (see LoadedModel)
        close_at = self._loop.time() + self.batch_timeout_s
        while rows < self.max_batch_size:
            while self._queue:
                head = self._queue[0]
                if head.future.done():
                    self._pop_live()
                    continue
                if head.runner is not first.runner or rows + head.rows > self.max_batch_size:
                    return batch  # FIFO: never run a later request before this one
                self._queue.popleft()
                self._queued_rows -= head.rows
                batch.append(head)
                rows += head.rows
            if rows >= self.max_batch_size or self.arriving <= 0 or self._closing:
                break  # nobody else is on the way: waiting would only add latency
            remaining = close_at - self._loop.time()
            if remaining <= 0:
                break
            await self._wait_for_work(remaining)
        return batch

    async def _work(self) -> None:
        while True:
            batch = await self._take_batch()
            if batch is None:
                return
            await self._run(batch)

    async def _run(self, batch: list[_Request]) -> None:
        runner = batch[0].runner
        if len(batch) == 1:
            merged = batch[0].inputs
        else:
            merged = {name: np.concatenate([r.inputs[name] for r in batch]) for name in batch[0].inputs}
        rows = sum(r.rows for r in batch)
        start = time.perf_counter()
        self._running += 1
        try:
            outputs = await self._loop.run_in_executor(self._executor, runner, merged)
        except Exception as exc:  # noqa: BLE001 - reported to each caller
            self._running -= 1
            if len(batch) > 1:
                for request in batch:  # one bad request must not fail its batch-mates: retry each alone
                    await self._run([request])
                return
            _fail(batch[0].future, _as_serving_error(exc))
            return
        except BaseException:  # cancelled at shutdown
            self._running -= 1
            raise
        self._running -= 1
        seconds = time.perf_counter() - start
        if rows == 1:
            self._inline_ok = seconds < INLINE_MAX_S
        if self._on_batch is not None:
            self._on_batch(rows, len(batch), seconds)
        offset = 0
        for request in batch:
            if not request.future.done():
                request.future.set_result({name: value[offset : offset + request.rows] for name, value in outputs.items()})
            offset += request.rows


def _expire(future: asyncio.Future) -> None:
    _fail(future, DeadlineExceeded("deadline exceeded before the model call completed"))


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _rows(inputs: Arrays) -> int:
    sizes = {len(v) for v in inputs.values()}
    if len(sizes) != 1:
        raise InvalidArgument(f"all inputs must have the same number of rows (batch size), got {sorted(sizes)}")
    (rows,) = sizes
    if rows == 0:
        raise InvalidArgument("inputs are empty: at least one instance is required")
    return rows


def _as_serving_error(exc: Exception) -> ServingError:
    if isinstance(exc, ServingError):
        return exc
    if type(exc).__name__ == "InvalidArgumentError":  # tf.errors.InvalidArgumentError, without importing TF
        log.info("model call rejected its input: %s", str(exc).strip()[:500])
        return InvalidArgument("the model could not process this input")
    log.error("model call failed: %s: %s", type(exc).__name__, str(exc).strip()[:1000])
    return Internal(f"model call failed ({type(exc).__name__})")
