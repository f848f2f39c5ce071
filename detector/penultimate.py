"""What clean looks like to the classifier: the distance to the nearest clean image in the
network's penultimate embedding (deep nearest-neighbour OOD detection, Sun et al. 2022).

The embedding is the input of the network's last linear layer scaled to unit length
(:func:`detector.features.unit_rows`; the extractor's ``penultimate`` columns). A fitted part
keeps the clean fitting rows and the sorted distances of each to its nearest OTHER one; its score
is the share of those that are smaller than an input's distance to its nearest clean row -- the
empirical CDF, about uniform on clean inputs, 1 beyond every clean sample: HIGHER = MORE
ABNORMAL. The ensemble (:class:`detector.ensemble.EnsembleDetector`) ramps it over its far tail.

Why: the trajectory features see how an image travels, not what the classifier makes of it, and
rotated or upside-down clothes travel much like clothes. Measured on the training side only,
this part alone flags more of the rotated clothes than a nearest distance on the pixels'
principal components, and the ensemble with it flags more of them at the same calibrated FPR
target, every attack about as often (docs/decisions.md, "Penultimate part").
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from detector.errors import ArtefactError, InputError
from detector.features import FeatureSpec, extract_features, penultimate_width
from detector.nearest import clean_cdf, nearest_distance

PENULTIMATE_KEY = "penultimate"  # the embedding's key in ``samples.extra``


def penultimate_embedding(
    model: nn.Module, images: np.ndarray, *, batch_size: int = 256
) -> np.ndarray:
    """The unit-length penultimate embeddings [N, D] of ``images``, float32: the same columns the
    extractor appends with ``FeatureSpec(penultimate=D)``, from the same code."""
    width = penultimate_width(model)
    features, _ = extract_features(
        model, images, batch_size=batch_size, spec=FeatureSpec(penultimate=width)
    )
    return np.ascontiguousarray(features[:, -width:])


def embedding_arrays(clean: np.ndarray) -> dict[str, np.ndarray]:
    """The part fitted on CLEAN embeddings [N, D]: ``points`` (the rows, float32) and
    ``reference`` (each row's squared distance to its nearest other row, sorted)."""
    points = np.asarray(clean, dtype=np.float32)
    if points.ndim != 2 or points.shape[1] < 1:
        raise InputError(f"embeddings must be a [N, D] array, got shape {points.shape}")
    if not np.isfinite(points).all():
        raise InputError("embeddings contain NaN or infinite values")
    rows = torch.from_numpy(np.ascontiguousarray(points))
    with torch.inference_mode():
        reference = nearest_distance(rows, rows, exclude_self=True).numpy()
    return {"points": points, "reference": np.sort(reference).astype(np.float32)}


def check_embedding_arrays(arrays: dict[str, np.ndarray], width: int) -> None:
    """ArtefactError unless ``arrays`` are a fitted part on ``width``-wide embeddings."""
    if set(arrays) != {"points", "reference"}:
        raise ArtefactError(
            f"penultimate part arrays must be 'points' and 'reference', got {sorted(arrays)}"
        )
    points, reference = np.asarray(arrays["points"]), np.asarray(arrays["reference"])
    if points.ndim != 2 or points.shape[1] != width or len(points) < 2:
        raise ArtefactError(f"penultimate array 'points' must have shape (N >= 2, {width})")
    if reference.ndim != 1 or reference.size == 0:
        raise ArtefactError("penultimate array 'reference' must be a non-empty vector")


class EmbeddingScorer(nn.Module):
    """``forward(embedding [N, D]) -> u``: the share of clean fitting rows whose own nearest
    distance is at most the input's distance to its nearest clean row, in [0, 1]."""

    points: torch.Tensor
    reference: torch.Tensor

    def __init__(self, arrays: dict[str, np.ndarray], width: int) -> None:
        super().__init__()
        check_embedding_arrays(arrays, width)
        for key in ("points", "reference"):
            value = np.ascontiguousarray(np.asarray(arrays[key], np.float32))
            self.register_buffer(key, torch.from_numpy(value))

    def forward(
        self,
        embedding: torch.Tensor,
        *,
        groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``groups``: (the inputs' group ids, the clean rows'): a clean row of an input's own
        group is never its nearest (:func:`~detector.nearest.nearest_distance`)."""
        if embedding.ndim != 2 or embedding.shape[1] != self.points.shape[1]:
            raise InputError(
                f"fitted on {self.points.shape[1]}-wide embeddings, got {tuple(embedding.shape)}"
            )
        distance = nearest_distance(embedding.float(), self.points, groups=groups)
        return clean_cdf(self.reference, distance)
