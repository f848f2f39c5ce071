"""Micro-batching: requests queue up and run together in one Guard call, off the event loop.

Each request submits its images: a prepared tensor ``[n, C, H, W]``, or a function that makes one
and runs in the batch thread (e.g. the Guard's ``prepare`` of small decoded images, so that a
small request costs no extra thread hop).
A dedicated batch thread takes what is queued the moment it is free (waiting up to ``max_wait``
after the oldest request for ``max_batch_size`` images, and up to ``linger`` x the previous batch's
compute time for as many images as it had), runs the Guard on the concatenation (one
forward pass) and hands the outcome back to the event loop, which scatters the rows to the waiting
requests; a request whose images cannot be prepared fails alone. The batch thread never waits for
the event loop between batches: under load the loop is busy reading and answering requests, and
a hand-off through it left the network idle (15% of the time at 32 clients on 2 cores). The
scoring function is asked for once per batch (``predictor()``), so a batch never mixes two Guards
when the served bundle is swapped (hot reload). While the batch thread computes, the event loop
keeps serving health checks, metrics and new arrivals (which form the next batch). The queue is
bounded in images: a request that does not fit is refused at once (:class:`OverloadedError`,
HTTP 429).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from detector.errors import InputError
from service.errors import NotReadyError, OverloadedError
from service.metrics import Metrics

if TYPE_CHECKING:
    from detector.guard import GuardResult

logger = logging.getLogger("lapguard.service")

Predict = Callable[[torch.Tensor], "GuardResult"]
#: Called once per batch in the batch thread: the function that scores that batch's chunks.
Predictor = Callable[[], Predict]


@dataclasses.dataclass(frozen=True)
class Decoded:
    """Decoded images whose conversion the batch thread does for the whole batch at once: the
    arrays of every request of one shape and type are stacked and converted in one
    ``prepare(stack)`` call (per request, the small tensor operations would each wait for the
    interpreter lock that the busy event loop holds). ``fallback()`` converts this request's
    images alone and names the image at fault when the joint conversion refuses the stack."""

    arrays: list[np.ndarray]
    prepare: Callable[[np.ndarray], torch.Tensor]
    fallback: Callable[[], torch.Tensor]

    def key(self) -> tuple[object, ...] | None:
        """What requests converted together must share (None: images of several shapes)."""
        shapes = {(a.shape, a.dtype) for a in self.arrays}
        return (self.prepare, *shapes) if len(shapes) == 1 else None


Images = torch.Tensor | Decoded | Callable[[], torch.Tensor]


@dataclasses.dataclass
class _Job:
    images: Images
    size: int
    future: asyncio.Future[GuardResult]
    enqueued: float
    abandoned: bool = False  # the request was cancelled (its client went away)


@dataclasses.dataclass
class _Outcome:
    """What the batch thread hands back to the event loop for one batch."""

    result: GuardResult | None
    failures: list[Exception | None]
    seconds: float
    started: float


class MicroBatcher:
    """Gathers submitted image batches into Guard calls of at most ``max_batch_size`` images."""

    def __init__(
        self,
        predictor: Predictor,
        *,
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int,
        linger: float = 0.0,
        metrics: Metrics | None = None,
        worker_setup: Callable[[], object] | None = None,
        batch_threads: Callable[[int, int], int] | None = None,
    ) -> None:
        self._predictor = predictor
        self._worker_setup = worker_setup  # run once in the batch thread, before any batch
        # (images, requests) of a batch -> torch threads for its forward pass (None: leave as set)
        self._batch_threads = batch_threads
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        # x the previous batch's seconds, to wait for its clients' next requests
        self.linger = linger
        self._last_images = 0  # images and compute seconds of the previous batch (batch thread)
        self._last_seconds = 0.0
        self.max_queue = max_queue
        self._metrics = metrics
        self._queue: deque[_Job] = deque()
        self._queued_images = 0
        self._ready = threading.Condition()  # guards the queue, its count and _closing
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._batch_seconds = 0.05  # running estimate, for Retry-After
        self.running = 0  # images in the batch being computed

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name="lapguard-guard", daemon=True)
        self._thread.start()

    async def close(self, timeout: float) -> None:
        """Refuse new work, finish what is queued (up to ``timeout`` s), fail the rest with 503."""
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                logger.warning(
                    "batcher: %d queued images not finished within %.1f s",
                    self._queued_images,
                    timeout,
                )
        with self._ready:
            left = list(self._queue)
            self._queue.clear()
            self._queued_images = 0
        await asyncio.sleep(0)  # deliver what the batch thread finished before it stopped
        for job in left:
            if not job.future.done():
                job.future.set_exception(
                    NotReadyError("the server is shutting down; retry on another replica")
                )

    @property
    def queued_images(self) -> int:
        return self._queued_images

    # ---- submitting --------------------------------------------------------------------------
    async def submit(self, images: Images, *, size: int | None = None) -> GuardResult:
        """Queue ``images`` (a tensor ``[n, C, H, W]``, :class:`Decoded` arrays, or a function
        returning a tensor, run in the batch thread; then ``size`` = n) and wait for their rows
        of the batch result."""
        if self._closing or self._thread is None:
            raise NotReadyError("the server is shutting down or not started; retry shortly")
        if isinstance(images, torch.Tensor):
            n = int(images.shape[0])
        elif isinstance(images, Decoded):
            n = len(images.arrays)
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
        with self._ready:
            self._queue.append(job)
            self._queued_images += n
            self._ready.notify()
        self._gauge()
        try:
            return await job.future
        except asyncio.CancelledError:
            job.abandoned = True
            raise

    def retry_after(self) -> float:
        """Seconds until the queue has room again, roughly (at least 1)."""
        batches_ahead = math.ceil((self._queued_images + self.running) / self.max_batch_size)
        return max(1.0, batches_ahead * self._batch_seconds)

    # ---- the batch thread --------------------------------------------------------------------
    def _work(self) -> None:
        """Take what is queued the moment the previous batch is done (the batch thread never
        waits for the event loop), compute it, hand the outcome to the loop; until closed and
        drained."""
        if self._worker_setup is not None:
            self._worker_setup()
        while True:
            jobs = self._next_jobs()
            if jobs is None:
                return
            if jobs:  # else every queued request was abandoned
                self._run_batch(jobs)
            # Hold nothing of a batch between batches: its results name the bundle that computed
            # them, which must be released when a reload retires it (service/heap.py).
            del jobs

    def _run_batch(self, jobs: list[_Job]) -> None:
        """Compute one batch and hand its outcome to the event loop."""
        self.running = sum(job.size for job in jobs)
        try:
            deliveries = self._run_jobs(jobs)
        except Exception as error:  # never let the thread die: the next requests would hang
            logger.exception("batcher: a batch failed unexpectedly")
            failed = _Outcome(None, [error] * len(jobs), 0.0, time.perf_counter())
            deliveries = [(jobs, failed)]
        finally:
            self.running = 0
        self._last_images = sum(job.size for job in jobs)
        self._last_seconds = max(outcome.seconds for _, outcome in deliveries)
        for batch, outcome in deliveries:
            self._hand_over(batch, outcome)

    def _next_jobs(self) -> list[_Job] | None:
        """Block until work is queued, fill the batch and take it; None once closing with nothing
        left. The batch waits up to ``max_wait_s`` after its oldest request, and, while fewer
        images are queued than the previous batch had, up to ``linger`` x that batch's compute
        time after the thread became free: the clients just answered are sending their next
        requests, and taking the first few alone would cost a whole forward pass for them and
        split a steady load into a small and a large batch (at 32 single-image clients on 2
        cores, half the batches held <= 4 images)."""
        free_since = time.perf_counter()
        with self._ready:
            while not self._queue:
                if self._closing:
                    return None
                self._ready.wait()
            deadline = self._queue[0].enqueued + self.max_wait_s
            expected = min(self._last_images, self.max_batch_size)
            linger_until = free_since + self.linger * self._last_seconds
            while self._queued_images < self.max_batch_size and not self._closing:
                now = time.perf_counter()
                until = deadline if self._queued_images >= expected else max(deadline, linger_until)
                if until <= now:
                    break
                self._ready.wait(until - now)
            jobs = self._take()
        self._gauge()
        return jobs

    def _take(self) -> list[_Job]:
        jobs: list[_Job] = []
        total = 0
        while self._queue:
            job = self._queue[0]
            if job.abandoned:
                self._queue.popleft()
                self._queued_images -= job.size
                continue
            if jobs and total + job.size > self.max_batch_size:
                break
            self._queue.popleft()
            self._queued_images -= job.size
            jobs.append(job)
            total += job.size
        return jobs

    def _run_jobs(self, jobs: list[_Job]) -> list[tuple[list[_Job], _Outcome]]:
        """The batch's outcome; when the Guard itself fails on a batch of several requests, one
        bad request must not fail the others: each is run alone."""
        if self._batch_threads is not None:
            threads = self._batch_threads(sum(job.size for job in jobs), len(jobs))
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            return [(jobs, self._compute([job.images for job in jobs], started))]
        except Exception as error:
            if len(jobs) == 1:
                return [(jobs, _Outcome(None, [error], time.perf_counter() - started, started))]
            return [item for job in jobs for item in self._run_jobs([job])]

    def _hand_over(self, jobs: list[_Job], outcome: _Outcome) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, jobs, outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            logger.warning("batcher: the event loop closed before %d answers", len(jobs))

    # ---- back on the event loop --------------------------------------------------------------
    def _deliver(self, jobs: list[_Job], outcome: _Outcome) -> None:
        """Set each request's rows (or its failure) on its future."""
        result, failures = outcome.result, outcome.failures
        for job, failure in zip(jobs, failures, strict=True):
            if failure is not None and not job.future.done():
                job.future.set_exception(failure)
        if result is None:
            return
        done = [job for job, failure in zip(jobs, failures, strict=True) if failure is None]
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * outcome.seconds
        self._observe(done, result, outcome.started, outcome.seconds)
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

    def _compute(self, parts: Sequence[Images], started: float) -> _Outcome:
        """Batch thread: make each request's tensor (a failure fails that request only), then
        one Guard call per ``max_batch_size`` images (one for a gathered batch), all by the
        Guard that ``predictor()`` gives at the start."""
        predict = self._predictor()
        joint = _prepare_together(parts)
        tensors: list[torch.Tensor] = []
        failures: list[Exception | None] = []
        for index, images in enumerate(parts):
            try:
                if index in joint:
                    tensors.append(joint[index])
                elif isinstance(images, torch.Tensor):
                    tensors.append(images)
                else:
                    tensors.append(images.fallback() if isinstance(images, Decoded) else images())
                failures.append(None)
            except Exception as error:
                failures.append(error)
        if not tensors:
            return _Outcome(None, failures, time.perf_counter() - started, started)
        batch = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        n = int(batch.shape[0])
        chunks = [
            predict(batch[i : i + self.max_batch_size]) for i in range(0, n, self.max_batch_size)
        ]
        result = chunks[0] if len(chunks) == 1 else concat_results(chunks)
        return _Outcome(result, failures, time.perf_counter() - started, started)

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


def _prepare_together(parts: Sequence[Images]) -> dict[int, torch.Tensor]:
    """The tensors of the :class:`Decoded` parts, by index, each group of one shape, type and
    conversion converted in one call; a group the conversion refuses is left out (its parts
    are converted one by one, to name the image at fault)."""
    groups: dict[tuple[object, ...], list[tuple[int, Decoded]]] = {}
    for index, images in enumerate(parts):
        if isinstance(images, Decoded) and (key := images.key()) is not None:
            groups.setdefault(key, []).append((index, images))
    tensors: dict[int, torch.Tensor] = {}
    for members in groups.values():
        arrays = [array for _, decoded in members for array in decoded.arrays]
        try:
            joint = members[0][1].prepare(np.stack(arrays))
        except InputError:
            continue
        sizes = [len(decoded.arrays) for _, decoded in members]
        tensors.update(zip([i for i, _ in members], torch.split(joint, sizes), strict=True))
    return tensors


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
