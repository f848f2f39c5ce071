"""The server's lifecycle, each test on its own live server: a full queue answers 429, SIGTERM
finishes in-flight requests, readiness waits for warm-up, health answers during a forward pass."""

from __future__ import annotations

import gc
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from service.settings import Settings, default_torch_threads, usable_cores
from tests.live_server import LiveServer
from tests.service_helpers import error_code


def test_full_queue_answers_429_and_shutdown_finishes_in_flight_requests(
    service_bundle, guard, images
) -> None:
    """A long max_wait keeps the first request's 4 images queued (the queue holds 4): the next
    request is refused with 429; on SIGTERM a request still waiting for its batch is answered."""
    settings = Settings(
        bundle=service_bundle,
        max_batch_size=64,
        max_wait_ms=1000,
        max_queue=4,
        max_images_per_request=4,
        warmup=False,
    )
    four = [("files", (f"{i}.png", images[i], "image/png")) for i in range(4)]
    with (
        LiveServer(settings, guard=guard) as live,
        httpx.Client(base_url=live.url, timeout=30) as c,
        ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(c.post, "/v1/predict", files=four)
        time.sleep(0.3)
        refused = c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        assert int(refused.headers["retry-after"]) >= 1
        assert first.result(timeout=30).status_code == 200
        assert "lapguard_rejected_total" in c.get("/metrics").text

        in_flight = pool.submit(c.post, "/v1/predict", files=four)
        time.sleep(0.3)
        live.server.handle_exit(signal.SIGTERM, None)
        response = in_flight.result(timeout=30)
        assert response.status_code == 200 and len(response.json()["results"]) == 4
        live.thread.join(timeout=30)
        assert not live.thread.is_alive()


class SlowGuard:
    """The real Guard with a slow forward (sleeps in the worker thread)."""

    def __init__(self, guard, seconds: float) -> None:
        self._guard, self._seconds = guard, seconds

    def __getattr__(self, name: str):
        return getattr(self._guard, name)

    def predict(self, x):
        time.sleep(self._seconds)
        return self._guard.predict(x)


class HeldWarmup(SlowGuard):
    """The real Guard whose warm-up lasts until the test releases it (no race with the clock)."""

    def __init__(self, guard) -> None:
        super().__init__(guard, 0.0)
        self.release = threading.Event()

    def warmup(self, batch_sizes=(1, 8)) -> None:
        self.release.wait(timeout=60)


def test_not_ready_until_warmed_up(service_bundle, guard, images) -> None:
    settings = Settings(bundle=service_bundle)
    held = HeldWarmup(guard)
    with (
        LiveServer(settings, guard=held, wait_for="/healthz") as live,
        httpx.Client(base_url=live.url, timeout=30) as c,
    ):
        assert c.get("/healthz").json() == {"status": "ok", "ready": False}
        for response in (
            c.get("/readyz"),
            c.get("/v2/health/ready"),
            c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")}),
        ):
            assert response.status_code == 503 and error_code(response) == "not_ready"
            assert int(response.headers["retry-after"]) >= 1
        held.release.set()
        deadline = time.monotonic() + 30
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (
            c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")}).status_code
            == 200
        )


def test_health_and_metrics_answer_while_the_model_computes(service_bundle, guard, images) -> None:
    settings = Settings(bundle=service_bundle, max_wait_ms=1, warmup=False)
    with (
        LiveServer(settings, guard=SlowGuard(guard, 3.0)) as live,
        httpx.Client(base_url=live.url, timeout=30) as c,
        ThreadPoolExecutor(1) as pool,
    ):
        busy = pool.submit(
            c.post, "/v1/predict", files={"files": ("a.png", images[0], "image/png")}
        )
        time.sleep(0.3)
        for path in ("/healthz", "/metrics"):
            start = time.perf_counter()
            assert c.get(path).status_code == 200
            assert time.perf_counter() - start < 1.0, f"{path} waited for the forward pass"
        assert not busy.done()  # the forward pass (3 s) was still running
        assert busy.result(timeout=30).status_code == 200


class ThreadsProbeGuard(SlowGuard):
    """The real Guard, recording torch's thread count where each forward pass runs."""

    def __init__(self, guard) -> None:
        super().__init__(guard, 0.0)
        self.threads: list[int] = []

    def predict(self, x):
        self.threads.append(torch.get_num_threads())
        return self._guard.predict(x)


def test_unset_torch_threads_follow_the_batchs_requests(service_bundle, guard, images) -> None:
    """Unset, a one-image request's forward pass keeps a core for the event loop; a request of
    eight or more images takes every core."""
    probe = ThreadsProbeGuard(guard)
    before = torch.get_num_threads()
    settings = Settings(bundle=service_bundle, warmup=False)
    eight = [("files", (f"{i}.png", images[i % 5], "image/png")) for i in range(8)]
    try:
        with LiveServer(settings, guard=probe) as live, httpx.Client(base_url=live.url) as c:
            one = c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
            assert one.status_code == 200
            assert c.post("/v1/predict", files=eight).status_code == 200
        assert probe.threads == [default_torch_threads(), usable_cores()]
    finally:
        torch.set_num_threads(before)


def test_torch_threads_sets_the_forward_passes_threads(service_bundle, guard, images) -> None:
    """``torch_threads`` (LAPGUARD_TORCH_THREADS, ``--torch-threads``) is the thread count of
    the forward passes (set in the batch thread: torch's count is per thread once used)."""
    probe = ThreadsProbeGuard(guard)
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    settings = Settings(bundle=service_bundle, torch_threads=wanted, warmup=False)
    try:
        with LiveServer(settings, guard=probe) as live, httpx.Client(base_url=live.url) as c:
            response = c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
            assert response.status_code == 200
        assert probe.threads and set(probe.threads) == {wanted}
    finally:
        torch.set_num_threads(before)


def test_the_start_up_heap_is_frozen_once_ready(service_bundle, guard) -> None:
    """Once warm, the objects of start-up are out of the cyclic collector's sight
    (``gc.freeze``): its full collections no longer walk them with the interpreter lock held;
    stopping gives them back."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with LiveServer(Settings(bundle=service_bundle), guard=guard):
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0  # unfrozen on stop
