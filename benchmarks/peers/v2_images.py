"""What the peer servers of :mod:`benchmarks.service_peers` share: the Open Inference Protocol body
every server receives (one BYTES input ``image`` of base64 PNGs, as lapguard's ``/v2`` accepts it),
read into decoded images, and the answer (``label``, ``flagged``, ``score``) written back."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import numpy as np
import torch

from detector.guard import Guard, GuardResult
from detector.images import decode_image
from service.settings import default_torch_threads

#: The outputs every server answers with (lapguard is asked for these three by the request).
OUTPUTS = ("label", "flagged", "score")


def torch_threads() -> int:
    """The forward pass's threads, as ``lapguard serve`` takes them: ``LAPGUARD_TORCH_THREADS``,
    else its default (the benchmark gives every server the same)."""
    return int(os.environ.get("LAPGUARD_TORCH_THREADS") or default_torch_threads())


def predict_images(guard: Guard, images: list[np.ndarray]) -> GuardResult:
    """``guard.predict_images`` on :func:`torch_threads` threads, set in the calling thread: torch's
    count is per thread once a thread has used it, and the servers' worker threads may predate
    the setting."""
    if torch.get_num_threads() != torch_threads():
        torch.set_num_threads(torch_threads())
    return guard.predict_images(images)


def v2_body(pngs: list[bytes]) -> bytes:
    """An inference request for ``pngs``: one BYTES input, base64 elements."""
    request = {
        "inputs": [
            {
                "name": "image",
                "shape": [len(pngs)],
                "datatype": "BYTES",
                "data": [base64.b64encode(png).decode() for png in pngs],
            }
        ],
        "outputs": [{"name": name} for name in OUTPUTS],
    }
    return json.dumps(request).encode()


def decode_v2_images(body: bytes) -> list[np.ndarray]:
    """The decoded images of a :func:`v2_body` request."""
    tensor = json.loads(body)["inputs"][0]
    return decode_b64_images(tensor["data"])


def decode_b64_images(elements: list[Any]) -> list[np.ndarray]:
    """Base64 PNG strings (or bytes) -> uint8 images."""
    return [decode_image(base64.b64decode(element)) for element in elements]


def v2_outputs(result: GuardResult, start: int = 0, stop: int | None = None) -> list[dict]:
    """The three output tensors for images ``start:stop`` of ``result``."""
    rows = slice(start, stop)
    labels = result.labels[rows]
    return [
        {"name": "label", "datatype": "INT64", "shape": [len(labels)], "data": labels.tolist()},
        {
            "name": "flagged",
            "datatype": "BOOL",
            "shape": [len(labels)],
            "data": result.flagged[rows].tolist(),
        },
        {
            "name": "score",
            "datatype": "FP32",
            "shape": [len(labels)],
            "data": result.scores[rows].tolist(),
        },
    ]
