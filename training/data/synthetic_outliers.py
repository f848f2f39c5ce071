"""Synthetic outliers: clean training images made unnatural by fixed transforms.

The deployed ensemble can learn them as one more abnormal family beside the attacks (the config's
``deploy_synthetic_outliers``), so that its forests also know what an image the network was never
meant to see looks like: outlier exposure (Hendrycks et al. 2019) without an outside data set.
Six transforms, each keeping the image's size and value range: rotated by 90 degrees, upside
down, inverted, its 4 x 4 grid of tiles shuffled, its centre zoomed in 2x, and shrunk 2x onto a
blank canvas. Source image ``i`` of a batch gets transform ``i mod 6``; the tile shuffles are
seeded. Measured on the training side: docs/decisions.md, "Synthetic outliers".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from detector.errors import ConfigError, InputError

# The name of the OOD protocol's synthetic training set (``PipelineConfig.ood_train``): these
# outliers of the network's own validation images, the seed's OOD experiment that trains on
# another distribution than the one it is tested on (seed 003 section 5.4.4, experiment 1).
SYNTHETIC_OOD = "synthetic"


def check_held_back(network: str, held_back: int, n: int) -> None:
    """Refuse an OOD protocol that trains on ``n`` synthetic outliers of network ``network``'s
    validation images when it holds back only ``held_back``."""
    if held_back < n:
        raise ConfigError(
            f"the OOD protocol trains on {n} synthetic outliers of network {network!r}'s "
            f"validation images, but it holds back {held_back}: lower ood_n or take "
            f"{SYNTHETIC_OOD!r} out of ood_train"
        )


Transform = Callable[[np.ndarray, np.random.Generator, tuple[float, float]], np.ndarray]


def _resize(images: np.ndarray, size: tuple[int, int], mode: str) -> np.ndarray:
    tensor = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    return F.interpolate(tensor, size=size, mode=mode).numpy()


def _rot90(x: np.ndarray, rng: np.random.Generator, value_range: tuple[float, float]) -> np.ndarray:
    turned = np.rot90(x, 1, axes=(2, 3))
    return turned if turned.shape == x.shape else _resize(turned, x.shape[2:], "bilinear")


def _upside_down(
    x: np.ndarray, rng: np.random.Generator, value_range: tuple[float, float]
) -> np.ndarray:
    return x[:, :, ::-1]


def _inverted(
    x: np.ndarray, rng: np.random.Generator, value_range: tuple[float, float]
) -> np.ndarray:
    low, high = value_range
    return (low + high) - x


def _tiles_shuffled(
    x: np.ndarray, rng: np.random.Generator, value_range: tuple[float, float]
) -> np.ndarray:
    """Each image's 4 x 4 grid of tiles in its own random order (a margin the grid does not
    cover stays in place)."""
    n, c, h, w = x.shape
    th, tw = h // 4, w // 4
    out = x.copy()
    grid = x[:, :, : 4 * th, : 4 * tw].reshape(n, c, 4, th, 4, tw).transpose(0, 2, 4, 1, 3, 5)
    tiles = grid.reshape(n, 16, c, th, tw)
    order = np.argsort(rng.random((n, 16)), axis=1)
    shuffled = np.take_along_axis(tiles, order[:, :, None, None, None], axis=1)
    back = shuffled.reshape(n, 4, 4, c, th, tw).transpose(0, 3, 1, 4, 2, 5)
    out[:, :, : 4 * th, : 4 * tw] = back.reshape(n, c, 4 * th, 4 * tw)
    return out


def _zoomed(
    x: np.ndarray, rng: np.random.Generator, value_range: tuple[float, float]
) -> np.ndarray:
    h, w = x.shape[2:]
    centre = x[:, :, h // 4 : h // 4 + h // 2, w // 4 : w // 4 + w // 2]
    return _resize(centre, (h, w), "nearest")


def _shrunk(
    x: np.ndarray, rng: np.random.Generator, value_range: tuple[float, float]
) -> np.ndarray:
    h, w = x.shape[2:]
    small = _resize(x, (h // 2, w // 2), "area")
    out = np.full_like(x, value_range[0])
    top, left = (h - h // 2) // 2, (w - w // 2) // 2
    out[:, :, top : top + h // 2, left : left + w // 2] = small
    return out


SYNTHETIC_TRANSFORMS: dict[str, Transform] = {
    "rot90": _rot90,
    "upside-down": _upside_down,
    "inverted": _inverted,
    "tiles-shuffled": _tiles_shuffled,
    "zoomed": _zoomed,
    "shrunk": _shrunk,
}


def synthetic_outliers(
    images: np.ndarray, value_range: tuple[float, float], *, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(outliers float32 [N, C, H, W], the transform's name per row) of clean ``images``
    [N, C, H, W]: row ``i`` is source ``i`` under transform ``i mod 6``, clipped to
    ``value_range``."""
    x = np.asarray(images, dtype=np.float32)
    if x.ndim != 4 or min(x.shape[2:], default=0) < 4:
        raise InputError(f"expected images [N, C, H, W] of at least 4 x 4 pixels, got {x.shape}")
    rng = np.random.default_rng(seed)
    names = list(SYNTHETIC_TRANSFORMS)
    out = np.empty_like(x)
    for k, transform in enumerate(SYNTHETIC_TRANSFORMS.values()):
        rows = np.arange(k, len(x), len(names))
        if len(rows):
            out[rows] = transform(x[rows], rng, value_range)
    low, high = value_range
    kinds = np.array([names[i % len(names)] for i in range(len(x))])
    return np.clip(out, low, high).astype(np.float32), kinds
