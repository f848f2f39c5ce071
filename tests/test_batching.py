"""The micro-batcher on the real Guard, without HTTP: decoded requests gathered in one batch are
converted together and answered with their own rows; a request the conversion refuses fails alone,
named; the batch thread picks the forward pass's threads per batch; it drains on close."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from detector.errors import InputError
from service.batching import Decoded, MicroBatcher
from service.errors import NotReadyError
from service.settings import LARGE_REQUEST_IMAGES, adaptive_torch_threads, default_torch_threads


class Recorder:
    """A predictor around the real Guard that records each batch (size, torch threads) and can
    hold the batch thread on a gate."""

    def __init__(self, guard) -> None:
        self.guard = guard
        self.batches: list[tuple[int, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0  # seconds each batch takes at least (a slower network)

    def __call__(self):
        return self.predict

    def predict(self, batch: torch.Tensor):
        self.gate.wait(10)
        time.sleep(self.delay)
        self.batches.append((int(batch.shape[0]), torch.get_num_threads()))
        return self.guard.predict(batch)


def pixels(n: int, seed: int) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).integers(0, 256, (n, 28, 28), dtype=np.uint8))


def decoded(guard, arrays: list[np.ndarray]) -> Decoded:
    def one_by_one() -> torch.Tensor:
        for i, array in enumerate(arrays):
            if array.dtype != np.uint8:
                raise InputError(f"image[{i}]: bad pixels")
        return guard.prepare(np.stack(arrays))

    return Decoded(arrays, guard.prepare, one_by_one)


def run(coroutine):
    return asyncio.run(coroutine)


def test_gathered_requests_are_converted_together_and_answered_with_their_rows(guard) -> None:
    """Three requests queued behind a busy batch run as one forward pass; each gets exactly the
    in-process Guard's answer for its images."""
    recorder = Recorder(guard)
    requests = [pixels(n, seed) for seed, n in enumerate((1, 3, 2))]

    async def scenario():
        batcher = MicroBatcher(recorder, max_batch_size=64, max_wait_s=0.0, max_queue=64)
        batcher.start()
        recorder.gate.clear()
        first = asyncio.ensure_future(batcher.submit(decoded(guard, pixels(1, 9))))
        await asyncio.sleep(0.2)  # the batch thread now holds the first request at the gate
        rest = [asyncio.ensure_future(batcher.submit(decoded(guard, r))) for r in requests]
        await asyncio.sleep(0.05)
        recorder.gate.set()
        results = await asyncio.gather(first, *rest)
        await batcher.close(timeout=5)
        return results[1:]

    results = run(scenario())
    assert [size for size, _ in recorder.batches] == [1, 6]
    for arrays, result in zip(requests, results, strict=True):
        expected = guard.predict(guard.prepare(np.stack(arrays)))
        np.testing.assert_array_equal(result.labels, expected.labels)
        np.testing.assert_allclose(result.scores, expected.scores, rtol=1e-5, atol=1e-6)


def test_a_request_the_joint_conversion_refuses_fails_alone(guard) -> None:
    """Float pixels outside the value range make the batch's joint conversion fail: that
    request fails with its own named error, the others of the batch are answered."""
    recorder = Recorder(guard)
    bad = [np.full((28, 28), 7.0, dtype=np.float32)]
    good = pixels(2, 1)

    async def scenario():
        batcher = MicroBatcher(recorder, max_batch_size=64, max_wait_s=0.2, max_queue=64)
        batcher.start()
        jobs = [batcher.submit(decoded(guard, good)), batcher.submit(decoded(guard, bad))]
        outcome = await asyncio.gather(*jobs, return_exceptions=True)
        await batcher.close(timeout=5)
        return outcome

    answered, refused = run(scenario())
    assert isinstance(refused, InputError) and "image[0]" in str(refused)
    assert len(answered.labels) == 2
    assert recorder.batches == [(2, recorder.batches[0][1])]


def test_the_batch_thread_picks_threads_per_batch(guard) -> None:
    """Unset ``torch_threads``: a batch of single-image requests runs on the default count, a
    batch of large requests on every core."""
    recorder = Recorder(guard)
    large = pixels(LARGE_REQUEST_IMAGES, 2)

    async def scenario():
        batcher = MicroBatcher(
            recorder,
            max_batch_size=64,
            max_wait_s=0.0,
            max_queue=64,
            batch_threads=adaptive_torch_threads,
        )
        batcher.start()
        await batcher.submit(decoded(guard, pixels(1, 3)))
        await batcher.submit(decoded(guard, large))
        await batcher.close(timeout=5)

    run(scenario())
    assert recorder.batches == [
        (1, default_torch_threads()),
        (LARGE_REQUEST_IMAGES, adaptive_torch_threads(LARGE_REQUEST_IMAGES, 1)),
    ]


@pytest.mark.parametrize("linger", [0.0, 1.0])
def test_linger_gathers_the_answered_clients_next_requests(guard, linger: float) -> None:
    """On a network that takes 0.2 s a batch, after a batch of 4 requests their clients come
    back one by one, 20 ms apart: with linger the batch thread waits for all 4 and runs them
    together; without, the first runs alone. When only one comes back, the wait ends after
    ``linger`` x the previous batch's time."""
    recorder = Recorder(guard)
    recorder.delay = 0.2

    async def scenario() -> float:
        batcher = MicroBatcher(
            recorder, max_batch_size=64, max_wait_s=0.0, max_queue=64, linger=linger
        )
        batcher.start()
        recorder.gate.clear()
        first = asyncio.ensure_future(batcher.submit(decoded(guard, pixels(1, 1))))
        await asyncio.sleep(0.05)  # held at the gate: the next 4 queue up behind it
        four = [
            asyncio.ensure_future(batcher.submit(decoded(guard, pixels(1, s)))) for s in range(4)
        ]
        await asyncio.sleep(0.05)
        recorder.gate.set()
        await asyncio.gather(first, *four)
        returning = []
        for seed in range(4):
            returning.append(asyncio.ensure_future(batcher.submit(decoded(guard, pixels(1, seed)))))
            await asyncio.sleep(0.02)
        await asyncio.gather(*returning)
        started = time.perf_counter()
        await batcher.submit(decoded(guard, pixels(1, 7)))  # only 1 of the 4 comes back
        waited = time.perf_counter() - started
        await batcher.close(timeout=5)
        return waited

    waited = run(scenario())
    sizes = [size for size, _ in recorder.batches]
    assert sizes[:2] == [1, 4]
    if linger:
        assert sizes[2:] == [4, 1]
        assert waited < 0.2 + 0.2 * linger + 0.6  # bounded: it does not wait for the other 3
    else:
        assert sizes[2] == 1 and sum(sizes[2:]) == 5


def test_adaptive_threads_rule(monkeypatch) -> None:
    monkeypatch.setattr("service.settings.usable_cores", lambda: 4)
    assert adaptive_torch_threads(1, 1) == 3
    assert adaptive_torch_threads(32, 32) == 3
    assert adaptive_torch_threads(LARGE_REQUEST_IMAGES - 1, 1) == 3
    assert adaptive_torch_threads(LARGE_REQUEST_IMAGES, 1) == 4
    assert adaptive_torch_threads(256, 4) == 4
    monkeypatch.setattr("service.settings.usable_cores", lambda: 1)
    assert adaptive_torch_threads(64, 1) == 1 and adaptive_torch_threads(1, 1) == 1


def test_close_finishes_the_running_batch_and_refuses_new_work(guard) -> None:
    recorder = Recorder(guard)

    async def scenario():
        batcher = MicroBatcher(recorder, max_batch_size=64, max_wait_s=0.0, max_queue=64)
        batcher.start()
        recorder.gate.clear()
        running = asyncio.ensure_future(batcher.submit(decoded(guard, pixels(2, 5))))
        await asyncio.sleep(0.1)
        threading.Timer(0.2, recorder.gate.set).start()
        await batcher.close(timeout=5)
        with pytest.raises(NotReadyError):
            await batcher.submit(decoded(guard, pixels(1, 6)))
        return await running

    assert len(run(scenario()).labels) == 2
