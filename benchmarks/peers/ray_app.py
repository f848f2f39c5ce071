"""The Ray Serve peer of :mod:`benchmarks.service_peers`: one deployment whose ``@serve.batch``
method scores the images of the requests that arrive together. Runs in the peers' virtual
environment until SIGTERM.

    python -m benchmarks.peers.ray_app BUNDLE PORT
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import numpy as np
import ray
import torch
from ray import serve
from starlette.requests import Request

from benchmarks.peers.v2_images import decode_v2_images, predict_images, torch_threads, v2_outputs
from detector.guard import Guard

CPUS = os.cpu_count() or 1


@serve.deployment(ray_actor_options={"num_cpus": CPUS}, max_ongoing_requests=256)
class GuardDeployment:
    def __init__(self, bundle: str) -> None:
        torch.set_num_threads(torch_threads())  # Ray sets OMP_NUM_THREADS=num_cpus otherwise
        self.guard = Guard.from_bundle(bundle, device="cpu")
        self.guard.warmup()

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0)
    async def score(self, batches: list[list[np.ndarray]]) -> list[dict]:
        images = [image for batch in batches for image in batch]
        result = await asyncio.to_thread(predict_images, self.guard, images)
        answers, start = [], 0
        for batch in batches:
            outputs = v2_outputs(result, start, start + len(batch))
            answers.append({"model_name": "lapguard", "outputs": outputs})
            start += len(batch)
        return answers

    async def __call__(self, request: Request) -> dict:
        if request.method == "GET":
            return {"ready": True}
        return await self.score(decode_v2_images(await request.body()))


def main() -> None:
    bundle, port = sys.argv[1], int(sys.argv[2])
    ray.init(num_cpus=CPUS, include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(GuardDeployment.bind(bundle), route_prefix="/", blocking=False)
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    loop.run_until_complete(stop.wait())
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
