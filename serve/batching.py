"""Dynamic batching: concurrent requests for the same model call are merged into one call.

A request is a dict of input arrays with the same number of rows. `Batcher.submit` queues it
and blocks until its own slice of the merged outputs comes back. Worker threads take the head
of the queue, then keep taking queued requests for the same runner (FIFO, never reordered)
until `max_batch_size` rows or `batch_timeout_s` has passed, and call the runner once.

The queue is bounded by rows (`max_queued_rows`): past it `submit` fails at once with
`Overloaded` rather than growing memory. Every request carries a deadline; one that expires in
the queue is dropped before the model call and its caller gets `DeadlineExceeded`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Mapping

import numpy as np

from serve.errors import DeadlineExceeded, Internal, InvalidArgument, Overloaded, ServingError, Unavailable

log = logging.getLogger(__name__)

Arrays = Mapping[str, np.ndarray]
Runner = Callable[[Arrays], Mapping[str, np.ndarray]]
"""A model call: input arrays (rows on axis 0) -> output arrays with the same rows."""


class _Task:
    __slots__ = ("runner", "inputs", "rows", "deadline", "done", "result", "error", "abandoned")

    def __init__(self, runner: Runner, inputs: Arrays, rows: int, deadline: float) -> None:
        self.runner = runner
        self.inputs = inputs
        self.rows = rows
        self.deadline = deadline
        self.done = threading.Event()
        self.result: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.abandoned = False


class Batcher:
    def __init__(
        self,
        *,
        max_batch_size: int = 64,
        batch_timeout_s: float = 0.002,
        max_queued_rows: int = 4096,
        num_threads: int = 1,
        overload_status: int = 429,
        on_batch: Callable[[int, int, float], None] | None = None,
        arriving: Callable[[], int] | None = None,
        pad_single_row: bool = True,
    ) -> None:
        """`on_batch(rows, requests, seconds)` is called after every model call (for metrics).

        `arriving()`, if given, counts requests received by a frontend but not yet submitted. A
        batch then waits for more only while some are on their way: a lone request runs at once
        instead of paying `batch_timeout_s`, and under load the batch still fills up.

        `pad_single_row` runs a 1-row call as 2 rows (the row repeated). CPU matmul kernels for
        one row (GEMV) round differently from those for several (GEMM); with the pad every
        response is bit-identical whichever batch it was merged into.
        """
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_s
        self.max_queued_rows = max_queued_rows
        self.overload_status = overload_status
        self._on_batch = on_batch
        self._arriving = arriving
        self._pad = pad_single_row
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Task] = collections.deque()
        self._queued_rows = 0
        self._busy = 0  # model calls running (worker batches and inline calls), at most num_threads
        self._num_threads = num_threads
        self._closing = False
        self._threads = [
            threading.Thread(target=self._work, name=f"batcher-{i}", daemon=True) for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def submit(self, runner: Runner, inputs: Arrays, deadline: float) -> dict[str, np.ndarray]:
        """Run `runner` on `inputs` as part of a batch; block until done or `deadline` (monotonic)."""
        rows = _rows(inputs)
        task = _Task(runner, inputs, rows, deadline)
        with self._cv:
            if self._closing:
                raise Unavailable("server is shutting down")
            if self._queue and self._queued_rows + rows > self.max_queued_rows:
                raise Overloaded(
                    f"server overloaded: {self._queued_rows} rows queued (max {self.max_queued_rows}); retry later",
                    self.overload_status,
                )
            inline = (
                self._arriving is not None
                and not self._queue
                and self._busy < self._num_threads
                and self._arriving() <= 0
            )
            if inline:
                self._busy += 1
            else:
                self._queue.append(task)
                self._queued_rows += rows
                self._cv.notify()
        if inline:
            # Idle model and nobody else on the way: run in the caller's thread, saving two
            # thread hand-offs. Requests arriving meanwhile queue for the worker as usual.
            try:
                self._run([task])
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()
            if time.monotonic() > deadline:
                raise DeadlineExceeded("deadline exceeded before the model call completed")
        elif not task.done.wait(max(0.0, deadline - time.monotonic())):
            task.abandoned = True
            raise DeadlineExceeded("deadline exceeded before the model call completed")
        if task.error is not None:
            raise task.error
        assert task.result is not None
        return task.result

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting work, finish what is queued, stop the worker threads."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    # -- worker side -------------------------------------------------------------------------

    def _take_batch(self) -> list[_Task] | None:
        with self._cv:
            # An inline call holds a model slot too: wait for a free one, so at most
            # num_threads model calls run at once and the queue bound stays meaningful.
            while not self._queue or self._busy >= self._num_threads:
                if self._closing and not self._queue:
                    return None
                self._cv.wait()
            first = self._queue.popleft()
            self._queued_rows -= first.rows
            self._busy += 1
            batch, rows = [first], first.rows
            close_at = time.monotonic() + self.batch_timeout_s
            while rows < self.max_batch_size:
                while self._queue:
                    head = self._queue[0]
                    if head.runner is not first.runner or rows + head.rows > self.max_batch_size:
                        return batch  # FIFO: never run a later request before this one
                    self._queue.popleft()
                    self._queued_rows -= head.rows
                    batch.append(head)
                    rows += head.rows
                if rows >= self.max_batch_size or self._closing:
                    break
                if self._arriving is not None and self._arriving() <= 0:
                    break  # nobody else is on the way: waiting would only add latency
                remaining = close_at - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            return batch

    def _work(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            now = time.monotonic()
            live = []
            for task in batch:
                if task.abandoned or task.deadline <= now:
                    task.error = DeadlineExceeded("deadline exceeded while waiting in the batch queue")
                    task.done.set()
                else:
                    live.append(task)
            try:
                if live:
                    self._run(live)
            finally:
                with self._cv:
                    self._busy -= 1

    def _run(self, batch: list[_Task]) -> None:
        runner = batch[0].runner
        if len(batch) == 1:
            merged = batch[0].inputs
        else:
            merged = {name: np.concatenate([t.inputs[name] for t in batch]) for name in batch[0].inputs}
        rows = sum(t.rows for t in batch)
        if rows == 1 and self._pad:
            merged = {name: np.concatenate([value, value]) for name, value in merged.items()}
        start = time.perf_counter()
        try:
            outputs = runner(merged)
        except Exception as exc:  # noqa: BLE001 - reported to each caller
            if len(batch) > 1:
                # One bad request must not fail its batch-mates: retry each on its own.
                for task in batch:
                    self._run([task])
                return
            batch[0].error = _as_serving_error(exc)
            batch[0].done.set()
            return
        if self._on_batch is not None:
            self._on_batch(rows, len(batch), time.perf_counter() - start)
        offset = 0
        for task in batch:
            task.result = {name: value[offset : offset + task.rows] for name, value in outputs.items()}
            offset += task.rows
            task.done.set()


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
    name = type(exc).__name__
    if name == "InvalidArgumentError":  # tf.errors.InvalidArgumentError, without importing TF here
        return InvalidArgument(getattr(exc, "message", str(exc)).strip())
    log.exception("model call failed", exc_info=exc)
    return Internal(f"model call failed: {name}: {exc}")
