"""How close to the decision boundary clean inputs sit: the clean CDF of the classifier's logit
margin (top-1 minus top-2), per predicted class.

Minimal-perturbation attacks (CW-L2 with confidence 0, DeepFool) stop as soon as the label
flips, so their images sit on the boundary: a top-1 margin that few clean inputs of the same
predicted class have. :class:`MarginScorer` gives the share of clean fitting samples of the
predicted class whose margin is at least the input's, in [0, 1]: HIGHER = MORE ABNORMAL (about
uniform on clean inputs, 1 below every clean margin of the class). It reads one column of the
transport features (``head_margin``, the head group's first column) and travels as arrays.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from detector.errors import ArtefactError, InputError

MARGIN_FEATURE = "head_margin"
MARGIN_ARRAYS = ("margin_reference", "margin_counts")


def margin_arrays(
    margins: np.ndarray, predicted: np.ndarray, min_class_samples: int
) -> dict[str, np.ndarray]:
    """Sorted clean margins per predicted class, padded with +inf (``margin_reference`` [K+1, M])
    and their counts (``margin_counts`` [K+1]); the last row pools every class, for labels
    without a row of their own (fewer than ``min_class_samples`` clean samples)."""
    margins = np.asarray(margins, np.float32)
    predicted = np.asarray(predicted, np.int64)
    if len(margins) == 0:
        raise InputError("the margin reference needs clean samples")
    k = int(predicted.max()) + 1
    rows = [np.sort(margins[predicted == c]) for c in range(k)]
    rows = [r if len(r) >= min_class_samples else np.zeros(0, np.float32) for r in rows]
    rows.append(np.sort(margins))
    width = max(len(r) for r in rows)
    reference = np.full((len(rows), width), np.inf, np.float32)
    for i, row in enumerate(rows):
        reference[i, : len(row)] = row
    return {
        "margin_reference": reference,
        "margin_counts": np.array([len(r) for r in rows], np.int64),
    }


def check_margin_arrays(arrays: dict[str, np.ndarray]) -> None:
    """ArtefactError unless the arrays are a margin reference :func:`margin_arrays` wrote."""
    missing = [k for k in MARGIN_ARRAYS if k not in arrays]
    if missing:
        raise ArtefactError(f"margin arrays lack {', '.join(missing)}")
    reference, counts = np.asarray(arrays["margin_reference"]), np.asarray(arrays["margin_counts"])
    if reference.ndim != 2 or counts.shape != (len(reference),) or counts[-1] < 1:
        raise ArtefactError("margin arrays have the wrong shape or an empty pooled row")
    if (counts < 0).any() or (counts > reference.shape[1]).any():
        raise ArtefactError("margin counts do not fit the reference")


class MarginScorer(nn.Module):
    """``forward(features, predicted) -> u``: share of clean samples of the predicted class with
    a margin at least the input's (column ``column`` of the features)."""

    reference: torch.Tensor
    counts: torch.Tensor

    def __init__(self, arrays: dict[str, np.ndarray], column: int) -> None:
        super().__init__()
        check_margin_arrays(arrays)
        self.column = int(column)
        reference = np.asarray(arrays["margin_reference"], np.float32)
        self.register_buffer("reference", torch.from_numpy(np.ascontiguousarray(reference)))
        self.register_buffer("counts", torch.from_numpy(np.asarray(arrays["margin_counts"])))

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        margin = features[:, self.column].float()
        pooled = len(self.counts) - 1
        if predicted is None:
            row = torch.full_like(margin, pooled, dtype=torch.long)
        else:
            row = predicted.to(margin.device).long()
            inside = (row >= 0) & (row < pooled)
            row = torch.where(inside, row, pooled)
            row = torch.where(self.counts[row] > 0, row, pooled)
        # per reference row, how many clean margins lie strictly below each input's
        values = margin[None].expand(len(self.reference), -1).contiguous()
        below = torch.searchsorted(self.reference, values, side="left").gather(0, row[None])[0]
        return 1.0 - below.float() / self.counts[row].float()
