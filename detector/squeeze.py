"""Feature squeezing (Xu, Evans & Qi, NDSS 2018) as a feature group: how far the network's
softmax moves when the input is squeezed, once per squeezer.

A clean image's prediction survives coarse quantisation and local median smoothing; a minimal
adversarial perturbation (CW, DeepFool, a small-ε L∞ step) is made of exactly the small, local
pixel changes these squeezers remove, so its prediction moves. Each column is the L1 distance
``||softmax(f(x)) - softmax(f(squeeze(x)))||_1`` in [0, 2]. Each squeezed copy of the batch goes
through the network once more: the group costs ``len(SQUEEZERS)`` extra forward passes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

Squeezer = Callable[[torch.Tensor], torch.Tensor]


def bit_depth(bits: int) -> Squeezer:
    """Quantise [0, 1] values to ``2**bits`` levels."""
    levels = 2**bits - 1
    return lambda x: torch.round(x * levels) / levels


def median_filter(size: int) -> Squeezer:
    """A ``size`` x ``size`` median filter per channel (reflect padding; an even size pads one
    pixel more before than after; the lower median of an even window)."""

    def squeeze(x: torch.Tensor) -> torch.Tensor:
        before, after = size // 2, size - 1 - size // 2
        padded = F.pad(x, (before, after, before, after), mode="reflect")
        windows = padded.unfold(2, size, 1).unfold(3, size, 1)
        return windows.reshape(*windows.shape[:4], -1).median(-1).values

    return squeeze


#: Xu et al.'s squeezers for grey-scale images (1-bit, median 2x2 and 3x3) and two milder
#: bit depths, by column name.
SQUEEZERS: dict[str, Squeezer] = {
    "squeeze_bits1": bit_depth(1),
    "squeeze_bits2": bit_depth(2),
    "squeeze_bits4": bit_depth(4),
    "squeeze_median2": median_filter(2),
    "squeeze_median3": median_filter(3),
}
SQUEEZE_NAMES = tuple(SQUEEZERS)


def squeeze_distances(
    model: nn.Module,
    x: torch.Tensor,
    logits: torch.Tensor,
    *,
    value_range: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """[N, len(SQUEEZERS)] float32: L1 distance between the softmax of ``logits`` (the model's
    output on ``x``) and that of each squeezed ``x``. Squeezers act on ``x`` mapped to [0, 1]
    from ``value_range``; ``model`` must not be instrumented by taps that this pass would
    overwrite (see :class:`detector.features.TransportFeatureExtractor`)."""
    low, high = value_range
    unit = ((x.float() - low) / (high - low)).clamp(0.0, 1.0)
    p = logits.float().softmax(1)
    columns = []
    with torch.no_grad():
        for squeeze in SQUEEZERS.values():  # one pass per squeezer: a 5x batch costs more than 5
            q = model((squeeze(unit) * (high - low) + low).to(x.dtype)).float().softmax(1)
            columns.append((q - p).abs().sum(1))
    return torch.stack(columns, 1)
