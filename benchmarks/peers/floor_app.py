"""The floor of :mod:`benchmarks.service_peers`: a bare ASGI app (no framework, no validation, no
metrics) under the same uvicorn as lapguard, that reads the body, decodes the PNGs and runs the
Guard, batching what arrives while the Guard computes (as lapguard's micro-batcher does).

    python -m benchmarks.peers.floor_app BUNDLE PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import numpy as np
import torch
import uvicorn

from benchmarks.peers.v2_images import decode_v2_images, predict_images, torch_threads, v2_outputs
from detector.guard import Guard

MAX_BATCH = 64
Pending = tuple[list[np.ndarray], "asyncio.Future[list[dict]]"]


class Floor:
    """The ASGI callable."""

    def __init__(self, bundle: str) -> None:
        torch.set_num_threads(torch_threads())
        self.guard = Guard.from_bundle(bundle, device="cpu")
        self.guard.warmup()
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                asyncio.get_running_loop().create_task(self._batches())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["method"] == "GET":  # the readiness probe
            await _answer(send, b'{"ready": true}')
            return
        future: asyncio.Future[list[dict]] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((decode_v2_images(body), future))
        outputs = await future
        await _answer(send, json.dumps({"model_name": "lapguard", "outputs": outputs}).encode())

    async def _batches(self) -> None:
        """Take what is queued (up to MAX_BATCH images), score it in a thread, hand out answers."""
        while True:
            items = [await self.queue.get()]
            count = len(items[0][0])
            while count < MAX_BATCH and not self.queue.empty():
                items.append(self.queue.get_nowait())
                count += len(items[-1][0])
            images = [image for batch, _ in items for image in batch]
            result = await asyncio.to_thread(predict_images, self.guard, images)
            start = 0
            for batch, future in items:
                future.set_result(v2_outputs(result, start, start + len(batch)))
                start += len(batch)


async def _answer(send: Any, payload: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


if __name__ == "__main__":
    uvicorn.run(Floor(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
                access_log=False, lifespan="on", server_header=False)  # fmt: skip
