"""Why an input was flagged, in the transport view (seed 003 fig. 21-22): its per-block features
msq_m = ||r_m||^2 / d_m and cos_m against the band of clean images of its predicted class.

A :class:`CleanBand` holds, per class, quantiles of every block's (msq, cos) over the clean
images of the training side that the network assigns to that class; a :class:`Gallery` holds a
few clean, adversarial and out-of-distribution samples (8-bit, as a client sends them) for a
first look. Both travel in the bundle (``explain.safetensors``, listed and checksummed in the
manifest like every file) and are optional: a bundle without them explains without a band.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from detector.errors import ArtefactError, InputError

EXPLAIN_FILE = "explain.safetensors"
BAND_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
BLOCK_FEATURES = ("msq", "cos")


def block_features(features: np.ndarray, n_blocks: int) -> np.ndarray:
    """[N, 2, M] (msq_m, cos_m) of every block from feature rows whose first ``2 * n_blocks``
    columns are msq_0, cos_0, msq_1, cos_1, ... (every feature set starts with them)."""
    rows = np.asarray(features, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] < 2 * n_blocks:
        raise InputError(f"expected [N, >= {2 * n_blocks}] features, got {rows.shape}")
    return rows[:, : 2 * n_blocks].reshape(len(rows), n_blocks, 2).transpose(0, 2, 1).copy()


@dataclass(frozen=True)
class CleanBand:
    """Per class k: ``values[k, q, f, m]`` is quantile ``quantiles[q]`` of block m's feature f
    (msq, cos) over the ``counts[k]`` clean images predicted as k (NaN where a class had none)."""

    quantiles: tuple[float, ...]
    values: np.ndarray  # float32 [K, Q, 2, M]
    counts: np.ndarray  # int64 [K]

    @classmethod
    def fit(
        cls,
        blocks: np.ndarray,
        labels: np.ndarray,
        n_classes: int,
        quantiles: Sequence[float] = BAND_QUANTILES,
    ) -> CleanBand:
        """Quantiles of clean ``blocks`` ([N, 2, M], :func:`block_features`) per predicted label."""
        blocks, labels = np.asarray(blocks, np.float64), np.asarray(labels, np.int64)
        if blocks.ndim != 3 or blocks.shape[1] != len(BLOCK_FEATURES) or len(blocks) != len(labels):
            raise InputError(f"expected [N, 2, M] blocks and N labels, got {blocks.shape}")
        levels = tuple(float(q) for q in quantiles)
        values = np.full((n_classes, len(levels), *blocks.shape[1:]), np.nan, np.float32)
        counts = np.bincount(labels, minlength=n_classes)[:n_classes].astype(np.int64)
        for k in np.flatnonzero(counts):
            values[k] = np.quantile(blocks[labels == k], levels, axis=0)
        return cls(levels, values, counts)

    @property
    def n_blocks(self) -> int:
        return int(self.values.shape[-1])

    def for_class(self, label: int) -> dict[str, list[list[float]]] | None:
        """{feature: [[block values] per quantile]} of class ``label``; None if it had no images."""
        if not 0 <= label < len(self.counts) or self.counts[label] == 0:
            return None
        band = self.values[label]
        return {f: band[:, i, :].tolist() for i, f in enumerate(BLOCK_FEATURES)}

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            "band.values": self.values.astype(np.float32),
            "band.counts": self.counts.astype(np.int64),
            "band.quantiles": np.asarray(self.quantiles, np.float64),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], n_classes: int, n_blocks: int) -> CleanBand:
        """Read back :meth:`to_arrays`, checking the shapes against the network's."""
        try:
            values, counts = arrays["band.values"], arrays["band.counts"]
            quantiles = tuple(float(q) for q in arrays["band.quantiles"])
        except KeyError as error:
            raise ArtefactError(f"{EXPLAIN_FILE} lacks the array {error}") from None
        expected = (n_classes, len(quantiles), len(BLOCK_FEATURES), n_blocks)
        if values.shape != expected or counts.shape != (n_classes,):
            raise ArtefactError(
                f"{EXPLAIN_FILE} holds a band of shape {values.shape} but this network needs "
                f"{expected}: it belongs to another network"
            )
        return cls(quantiles, values.astype(np.float32), counts.astype(np.int64))


class GalleryItem(BaseModel):
    """One sample of the bundle's gallery: what it is and where it comes from."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="a short file-like name, e.g. 'clean-0-sneaker.png'")
    kind: Literal["clean", "adversarial", "ood"]
    source: str = Field(description="'test' for clean images, the attack key, or the OOD set")
    label: str | None = Field(default=None, description="the true class (None for OOD images)")


@dataclass(frozen=True)
class Gallery:
    """A few samples as uint8 [G, C, H, W] images (what a client's PNG decodes to) + their items."""

    items: list[GalleryItem]
    images: np.ndarray

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ArtefactError(
                f"gallery images must be uint8 [G, C, H, W], got {self.images.dtype}"
            )
        if len(self.items) != len(self.images):
            raise ArtefactError(
                f"the gallery lists {len(self.items)} samples but holds {len(self.images)} images"
            )

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"gallery.images": np.ascontiguousarray(self.images)}

    @classmethod
    def from_arrays(
        cls, arrays: dict[str, np.ndarray], items: list[GalleryItem], shape: tuple[int, ...]
    ) -> Gallery:
        images = arrays.get("gallery.images", np.zeros((0, *shape), np.uint8))
        if tuple(images.shape[1:]) != tuple(shape):
            raise ArtefactError(
                f"{EXPLAIN_FILE} holds gallery images of shape {images.shape[1:]}, the bundle's "
                f"input is {tuple(shape)}"
            )
        return cls(items, images)


def to_uint8(images: np.ndarray, value_range: tuple[float, float]) -> np.ndarray:
    """Float images in ``value_range`` -> uint8 (rounded), as a client's PNG would hold them."""
    low, high = value_range
    scaled = (np.asarray(images, np.float64) - low) / (high - low)
    return np.round(np.clip(scaled, 0.0, 1.0) * 255).astype(np.uint8)
