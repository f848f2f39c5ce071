"""Micro-batching: requests queue up and run together in one Guard call, off the event loop.

Each request submits its images: a prepared tensor ``[n, C, H, W]``, or a function that makes one
and runs in the worker thread (e.g. the Guard's ``prepare`` of small decoded images, so that a
small request costs no extra thread hop).
A single asyncio task gathers queued requests until ``max_batch_size`` images are waiting or the
oldest has waited ``max_wait``, runs the Guard on the concatenation in a dedicated worker thread
(one forward pass), and scatters the rows back to the waiting requests; a request whose images
cannot be prepared fails alone. The scoring function is asked for once per batch (``predictor()``),
so a batch never mixes two Guards when the served bundle is swapped (hot reload). While the worker thread computes, the event loop keeps serving
health checks, metrics and new arrivals (which form the next batch). The queue is bounded in
images: a request that does not fit is refused at once (:class:`OverloadedError`, HTTP 429).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from service.errors import NotReadyError, OverloadedError
from service.metrics import Metrics

if TYPE_CHECKING:
    from detector.guard import GuardResult

logger = logging.getLogger("lapguard.service")

Predict = Callable[[torch.Tensor], "GuardResult"]
#: Called once per batch in the worker thread: the function that scores that batch's chunks.
Predictor = Callable[[], Predict]
Images = torch.Tensor | Callable[[], torch.Tensor]


@dataclasses.dataclass
class _Job:
    images: Images
    size: int
    future: asyncio.Future[GuardResult]
    enqueued: float


class MicroBatcher:
    """Gathers submitted image batches into Guard calls of at most ``max_batch_size`` images."""

    def __init__(
        self,
        predictor: Predictor,
        *,
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int,
        metrics: Metrics | None = None,
        worker_setup: Callable[[], object] | None = None,
    ) -> None:
        self._predictor = predictor
        self._worker_setup = worker_setup  # run once in the batch thread, before any batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._metrics = metrics
        self._queue: deque[_Job] = deque()
        self._queued_images = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closing = False
        self._batch_seconds = 0.05  # running estimate, for Retry-After
        self.running = 0  # images in the batch being computed

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is not None:
            return
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lapguard-guard", initializer=self._worker_setup
        )
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lapguard-batcher")

    async def close(self, timeout: float) -> None:
        """Refuse new work, finish what is queued (up to ``timeout`` s), fail the rest with 503."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except asyncio.TimeoutError:
                self._task.cancel()
                logger.warning(
                    "batcher: %d queued images not finished within %.1f s",
                    self._queued_images,
                    timeout,
                )
            except asyncio.CancelledError:
                self._task.cancel()
                raise
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(
                    NotReadyError("the server is shutting down; retry on another replica")
                )
        self._queued_images = 0
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def queued_images(self) -> int:
        return self._queued_images

    # ---- submitting --------------------------------------------------------------------------
    async def submit(self, images: Images, *, size: int | None = None) -> GuardResult:
        """Queue ``images`` (a tensor ``[n, C, H, W]``, or a function returning one, run in the
        worker thread; then ``size`` = n) and wait for their rows of the batch result."""
        if self._closing or self._task is None:
            raise NotReadyError("the server is shutting down or not started; retry shortly")
        if isinstance(images, torch.Tensor):
            n = int(images.shape[0])
        elif size is None:
            raise TypeError("submit(function, size=n): the number of images is needed")
        else:
            n = size
        if self._queued_images + n > self.max_queue:
            if self._metrics is not None:
                self._metrics.rejected.labels("queue_full").inc()
            raise OverloadedError(
                f"the queue is full ({self._queued_images} images waiting, limit {self.max_queue}); retry later",
                retry_after=self.retry_after(),
            )
        loop = asyncio.get_running_loop()
        job = _Job(images=images, size=n, future=loop.create_future(), enqueued=time.perf_counter())
        self._queue.append(job)
        self._queued_images += n
        self._gauge()
        self._wakeup.set()
        return await job.future

    def retry_after(self) -> float:
        """Seconds until the queue has room again, roughly (at least 1)."""
        batches_ahead = math.ceil((self._queued_images + self.running) / self.max_batch_size)
        return max(1.0, batches_ahead * self._batch_seconds)

    # ---- the gathering loop ------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            while not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._fill(self._queue[0].enqueued + self.max_wait_s)
            jobs = self._take()
            if not jobs:
                continue
            try:
                await self._run_batch(jobs)
            except Exception as error:  # never let the loop die: the next requests would hang
                logger.exception("batcher: a batch failed unexpectedly")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(error)

    async def _fill(self, deadline: float) -> None:
        """Wait until a full batch is queued, the deadline passes, or we are closing."""
        while self._queued_images < self.max_batch_size and not self._closing:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Job]:
        jobs: list[_Job] = []
        total = 0
        while self._queue:
            job = self._queue[0]
            if job.future.done():  # the client went away
                self._queue.popleft()
                self._queued_images -= job.size
                continue
            if jobs and total + job.size > self.max_batch_size:
                break
            self._queue.popleft()
            self._queued_images -= job.size
            jobs.append(job)
            total += job.size
        self._gauge()
        return jobs

    async def _run_batch(self, jobs: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self.running = sum(job.size for job in jobs)
        try:
            result, failures, seconds = await loop.run_in_executor(
                self._executor, self._compute, [j.images for j in jobs]
            )
        except Exception as error:  # the Guard itself failed on the batch
            if len(jobs) > 1:  # one bad request must not fail the others: run them one by one
                for job in jobs:
                    await self._run_batch([job])
            elif not jobs[0].future.done():
                jobs[0].future.set_exception(error)
            return
        finally:
            self.running = 0
        done = [job for job, failure in zip(jobs, failures, strict=True) if failure is None]
        for job, failure in zip(jobs, failures, strict=True):
            if failure is not None and not job.future.done():
                job.future.set_exception(failure)
        if result is None:
            return
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
        self._observe(done, result, started, seconds)
        if len(done) == 1:  # the whole result is the one request's
            if not done[0].future.done():
                done[0].future.set_result(result)
            return
        names = _row_fields(result)
        offset = 0
        for job in done:
            if not job.future.done():
                job.future.set_result(slice_result(result, offset, offset + job.size, names))
            offset += job.size

    def _compute(
        self, parts: Sequence[Images]
    ) -> tuple[GuardResult | None, list[Exception | None], float]:
        """Worker thread: make each request's tensor (a failure fails that request only), then
        one Guard call per ``max_batch_size`` images (one for a gathered batch), all by the
        Guard that ``predictor()`` gives at the start."""
        started = time.perf_counter()
        predict = self._predictor()
        tensors: list[torch.Tensor] = []
        failures: list[Exception | None] = []
        for images in parts:
            try:
                tensors.append(images if isinstance(images, torch.Tensor) else images())
                failures.append(None)
            except Exception as error:
                failures.append(error)
        if not tensors:
            return None, failures, time.perf_counter() - started
        batch = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        n = int(batch.shape[0])
        chunks = [
            predict(batch[i : i + self.max_batch_size]) for i in range(0, n, self.max_batch_size)
        ]
        result = chunks[0] if len(chunks) == 1 else concat_results(chunks)
        return result, failures, time.perf_counter() - started

    def _observe(
        self, jobs: list[_Job], result: GuardResult, started: float, seconds: float
    ) -> None:
        m = self._metrics
        if m is None:
            return
        m.batch_size.observe(sum(job.size for job in jobs))
        m.batch_seconds.observe(seconds)
        for job in jobs:
            m.queue_seconds.observe(started - job.enqueued)
        scores = np.asarray(result.scores, dtype=np.float64)
        m.images.inc(len(scores))
        m.flagged.inc(int(np.count_nonzero(result.flagged)))
        for score in scores:
            m.scores.observe(float(score))

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.set(self._queued_images)


def _row_fields(result: GuardResult) -> list[str]:
    """Names of the per-image fields (arrays or lists with one entry per image)."""
    n = len(result.labels)
    names = []
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        if (
            isinstance(value, np.ndarray)
            and value.ndim >= 1
            and len(value) == n
            or isinstance(value, list)
            and len(value) == n
        ):
            names.append(field.name)
    return names


def slice_result(
    result: GuardResult, start: int, stop: int, names: list[str] | None = None
) -> GuardResult:
    """Rows ``start:stop`` of a batch result (every per-image field, ``names`` when the caller
    has them from :func:`_row_fields`, is sliced)."""
    names = _row_fields(result) if names is None else names
    return dataclasses.replace(
        result, **{name: getattr(result, name)[start:stop] for name in names}
    )


def concat_results(results: Sequence[GuardResult]) -> GuardResult:
    """Rows of several results of the same Guard, in order."""
    names = _row_fields(results[0])
    joined: dict[str, Any] = {}
    for name in names:
        parts = [getattr(r, name) for r in results]
        joined[name] = (
            np.concatenate(parts)
            if isinstance(parts[0], np.ndarray)
            else [x for p in parts for x in p]
        )
    return dataclasses.replace(results[0], **joined)
