"""Payloads -> prepared batches -> result rows, through a Guard (the local and the Ray engine).

Every input is decoded and converted on its own, so that one bad input becomes an error row and
never stops the run; the usable ones are stacked and scored by ONE :meth:`Guard.predict`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from detector.guard import Guard, GuardResult
from detector.images import DEFAULT_MAX_PIXELS, decode_image
from service.batch.inputs import Payload, Unusable, describe_error
from service.batch.writer import Row

Prepare = Callable[[list[np.ndarray]], torch.Tensor]


@dataclass
class PreparedBatch:
    """The usable inputs of a batch stacked ``[n, C, H, W]``, and per input why it is unusable
    (None where it is usable)."""

    images: torch.Tensor | None
    problems: list[str | None]

    def pin_memory(self) -> PreparedBatch:
        """Page-locked images (DataLoader ``pin_memory``: faster copies to the GPU)."""
        images = self.images.pin_memory() if self.images is not None else None
        return PreparedBatch(images, self.problems)


def prepare_payload(
    prepare: Prepare,
    payload: Payload | Unusable,
    *,
    channels: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> torch.Tensor | Unusable:
    """Decode (bytes) and convert one input to the input spec with ``prepare`` (a Guard's);
    any failure comes back as :class:`Unusable` instead of being raised."""
    if isinstance(payload, Unusable):
        return payload
    try:
        if isinstance(payload, bytes):
            image = decode_image(payload, max_pixels=max_pixels, keep_alpha=channels == 4)
        else:
            image = payload
        return prepare([image])[0]
    except Exception as error:  # one bad input never stops the run: it gets an error row
        return Unusable(describe_error(error))


def collate(prepared: Sequence[torch.Tensor | Unusable]) -> PreparedBatch:
    """Stack the usable inputs; keep each unusable one's reason in its place."""
    usable = [p for p in prepared if isinstance(p, torch.Tensor)]
    return PreparedBatch(
        images=torch.stack(usable) if usable else None,
        problems=[p.reason if isinstance(p, Unusable) else None for p in prepared],
    )


def prepare_batch(guard: Guard, payloads: Sequence[Payload | Unusable]) -> PreparedBatch:
    """Each payload prepared for ``guard`` on its own, then collated."""
    channels = guard.input_spec.channels
    return collate([prepare_payload(guard.prepare, p, channels=channels) for p in payloads])


def result_rows(result: GuardResult) -> list[Row]:
    """Every image of a Guard result as the keys of a ``/v1/predict`` result (converted to
    Python values column by column, not element by element)."""
    threshold = float(result.threshold)
    return [
        {
            "label": label,
            "class_name": name,
            "confidence": confidence,
            "flagged": flagged,
            "score": score,
            "threshold": threshold,
        }
        for label, name, confidence, flagged, score in zip(
            result.labels.tolist(),
            result.class_names,
            result.confidences.tolist(),
            result.flagged.tolist(),
            result.scores.tolist(),
            strict=True,
        )
    ]


def score_batch(guard: Guard, batch: PreparedBatch) -> list[Row]:
    """The results of a prepared batch, in input order (``{"error": ...}`` for unusable ones)."""
    if batch.images is None:
        return [{"error": problem} for problem in batch.problems]
    scored = iter(result_rows(guard.predict(batch.images)))
    return [
        {"error": problem} if problem is not None else next(scored) for problem in batch.problems
    ]
