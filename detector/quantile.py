"""Zero-shot detector: flag inputs whose transport features leave the clean-data quantile band.

Needs no attacks (seed 003, fig. 21): fitted on CLEAN features only. For a statistic s with
clean quantiles lo = q-quantile and hi = (1-q)-quantile, the score is

    (max(lo - s, s - hi)) / (hi - lo)

the signed distance outside the band in band widths: HIGHER = MORE ABNORMAL, > 0 outside the
band, negative inside (deeper inside = more normal). ``feature="transport_cost"`` uses the
total transport cost sum_m msq_m with q = fpr / 2; ``feature="all"`` scores every feature and
takes the worst, with q = fpr / (2 F) (a union bound), so a threshold of 0 flags about ``fpr``
of clean inputs either way; the calibrated threshold replaces that estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from detector.base import Detector, DetectorInfo, SampleSet, check_fitted
from detector.errors import ArtefactError, ConfigError, InputError
from detector.features import check_features
from detector.registry import register_detector

FEATURES = ("transport_cost", "all")


def cost_columns(n_features: int, feature_names: Sequence[str] | None = None) -> np.ndarray:
    """Indices of the msq_m columns: by name when given, else the even columns of a base layout."""
    if feature_names is not None:
        if len(feature_names) != n_features:
            raise InputError(f"{len(feature_names)} feature names for {n_features} features")
        columns = [i for i, name in enumerate(feature_names) if name.startswith("msq_")]
    else:
        if n_features % 2:
            raise InputError(
                f"{n_features} features is not a plain (msq, cos) layout: pass feature_names to fit"
            )
        columns = list(range(0, n_features, 2))
    if not columns:
        raise InputError("no msq_ columns among the features: the transport cost needs them")
    return np.asarray(columns, dtype=np.int64)


class QuantileScorer(nn.Module):
    """Torch form of a fitted :class:`QuantileDetector`: ``forward(features, predicted=None) -> scores``."""

    columns: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    width: torch.Tensor

    def __init__(self, arrays: dict[str, np.ndarray], n_features: int, feature: str) -> None:
        super().__init__()
        self.n_features = int(n_features)
        self.total = feature == "transport_cost"
        self.register_buffer(
            "columns", torch.from_numpy(np.asarray(arrays["columns"], dtype=np.int64))
        )
        self.register_buffer("low", torch.from_numpy(np.asarray(arrays["low"], dtype=np.float32)))
        self.register_buffer("high", torch.from_numpy(np.asarray(arrays["high"], dtype=np.float32)))
        self.register_buffer(
            "width", torch.from_numpy(np.asarray(arrays["width"], dtype=np.float32))
        )

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        if features.ndim != 2 or features.shape[1] != self.n_features:
            raise InputError(
                f"fitted on {self.n_features} features, got {tuple(features.shape)}: "
                "this detector belongs to another network"
            )
        x = features.float()
        statistic = x.index_select(1, self.columns).sum(dim=1, keepdim=True) if self.total else x
        outside = torch.maximum(self.low - statistic, statistic - self.high) / self.width
        return outside.amax(dim=1)


@register_detector
class QuantileDetector(Detector):
    """Zero-shot transport-cost detector (see the module docstring).

    ``fit(features, is_abnormal=None, predicted_labels=None, *, feature_names=None)`` uses only
    clean rows (all rows, or those with is_abnormal == 0); ``score(features, predicted_labels=None)``
    -> float64 [N], HIGHER = MORE ABNORMAL (> 0 outside the clean band).
    """

    # Zero-shot: its decision is the calibrated threshold, not a vote.
    info = DetectorInfo(
        "quantile",
        "QT",
        reads="features",
        supervised=False,
        default_threshold=None,
        servable=True,
        summary="zero-shot: the transport cost outside its clean quantile band",
    )

    def __init__(self, feature: str = "transport_cost", fpr: float = 0.05) -> None:
        self.feature = feature
        self.fpr = fpr

    def fit(
        self,
        features: np.ndarray,
        is_abnormal: np.ndarray | None = None,
        predicted_labels: np.ndarray | None = None,
        *,
        feature_names: Sequence[str] | None = None,
    ) -> QuantileDetector:
        """Fit the clean quantile band; abnormal rows, when labelled, are ignored (zero-shot)."""
        if self.feature not in FEATURES:
            raise ConfigError(f"feature must be one of {FEATURES}, got {self.feature!r}")
        if not 0.0 < self.fpr < 1.0:
            raise ConfigError(f"fpr must be in (0, 1), got {self.fpr}")
        x = check_features(features)
        if is_abnormal is not None:
            labels = np.asarray(is_abnormal)
            if labels.shape != (len(x),):
                raise InputError(f"is_abnormal must have shape ({len(x)},), got {labels.shape}")
            x = x[labels == 0]
        if len(x) < 2:
            raise InputError("the quantile detector needs at least 2 clean samples")
        columns = cost_columns(x.shape[1], feature_names)
        if self.feature == "transport_cost":
            statistic = x[:, columns].astype(np.float64).sum(axis=1, keepdims=True)
            q = self.fpr / 2
        else:
            statistic = x.astype(np.float64)
            q = self.fpr / (2 * x.shape[1])
        low = np.quantile(statistic, q, axis=0)
        high = np.quantile(statistic, 1 - q, axis=0)
        scale = np.maximum(np.abs(low), np.abs(high))
        width = np.maximum(high - low, np.maximum(scale * 1e-6, 1e-12))
        self.n_features_in_ = x.shape[1]
        self.columns_ = columns
        self.low_ = low.astype(np.float32)
        self.high_ = high.astype(np.float32)
        self.width_ = width.astype(np.float32)
        return self

    def fit_samples(self, clean: SampleSet, abnormal: SampleSet) -> QuantileDetector:
        """Fit the band on the clean samples' features; ``abnormal`` is ignored (zero-shot)."""
        return self.fit(clean.features, feature_names=getattr(clean, "feature_names", None))

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        """:meth:`score` of the samples' features: HIGHER = MORE ABNORMAL."""
        return self.score(samples.features)

    def score(self, features: np.ndarray, predicted_labels: np.ndarray | None = None) -> np.ndarray:
        """Signed distance outside the clean band in band widths; HIGHER = MORE ABNORMAL.

        ``predicted_labels`` is accepted for a common interface with the forest and ignored.
        """
        check_fitted(self)
        x = check_features(features, self.n_features_in_)
        with torch.inference_mode():
            scores = self.to_torch()(torch.from_numpy(x))
        return scores.numpy().astype(np.float64)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {
            "columns": self.columns_,
            "low": self.low_,
            "high": self.high_,
            "width": self.width_,
        }

    def to_torch(self) -> QuantileScorer:
        """The fitted band as a torch module: ``forward(features [N,F], predicted=None) -> scores [N]``."""
        check_fitted(self)
        return QuantileScorer(self._arrays(), self.n_features_in_, self.feature)

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Numpy arrays + JSON-able parameters for :meth:`from_arrays`."""
        check_fitted(self)
        return dict(self._arrays()), {
            **self.get_params(),
            "n_features_in": int(self.n_features_in_),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], params: dict[str, Any]) -> QuantileDetector:
        """A detector that scores like the one :meth:`to_arrays` saved."""
        params = dict(params)
        try:
            n_features = int(params.pop("n_features_in"))
            detector = cls(**params)
            columns = np.asarray(arrays["columns"], dtype=np.int64)
            low, high, width = (
                np.asarray(arrays[k], dtype=np.float32) for k in ("low", "high", "width")
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ArtefactError(
                f"quantile detector arrays/params are incomplete: {error}"
            ) from error
        size = 1 if detector.feature == "transport_cost" else n_features
        if low.shape != (size,) or high.shape != (size,) or width.shape != (size,):
            raise ArtefactError("quantile detector arrays do not match its feature setting")
        if columns.size == 0 or columns.min() < 0 or columns.max() >= n_features:
            raise ArtefactError("quantile detector columns point outside its features")
        detector.n_features_in_ = n_features
        detector.columns_, detector.low_, detector.high_, detector.width_ = (
            columns,
            low,
            high,
            width,
        )
        return detector
