"""What clean looks like: the distance to clean trajectory features in a class-conditional
Gaussian's metric.

``NoveltyDetector`` is fitted on CLEAN samples only (abnormal ones are ignored): features are
made closer to Gaussian (log of the non-negative columns, e.g. the residues' ||r_m||^2/d_m), then
standardized; one mean per predicted class and one shared covariance (Ledoit-Wolf shrinkage) give
a Mahalanobis metric (Lee et al. 2018, here on the transport features instead of the raw
activations). Its distance is, in that metric, to the nearest clean fitting sample (default,
``distance="nearest"``: a whitened 1-nearest-neighbour distance, as deep kNN OOD detection, Sun
et al. 2022) or to the predicted class's mean (``"class-mean"``). Its score is the share of the
clean fitting samples that are closer -- the empirical CDF of the clean distances (each fitting
sample's to its nearest OTHER one), in [0, 1]: HIGHER = MORE ABNORMAL, about uniform on clean
inputs, 1 beyond every clean sample. The ensemble (:mod:`detector.ensemble`) ramps it over its
far tail.

Why the nearest sample: clean is not one ellipsoid per class, so an input far from every clean
image can still be near its class's mean; measured on the training side only, in the ensemble,
the nearest sample flagged more unseen attacks and out-of-distribution stand-ins at a lower clean
FPR than the class mean (docs/decisions.md, "Ensemble parts and tails").

It travels as arrays + JSON, never pickles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.covariance import LedoitWolf
from torch import nn

from detector.base import (
    Detector,
    DetectorInfo,
    SampleSet,
    check_class_labels,
    check_fitted,
)
from detector.errors import ArtefactError, InputError
from detector.features import check_features
from detector.nearest import clean_cdf, nearest_distance
from detector.registry import register_detector

_NOVELTY_ARRAYS = (
    "log_columns",
    "offset",
    "mean",
    "scale",
    "class_means",
    "class_present",
    "precision",
    "reference",
)
_NEAREST_ARRAYS = ("whiten", "points")  # only with distance="nearest"
NOVELTY_DISTANCES = ("class-mean", "nearest")  # see NoveltyDetector


class NoveltyScorer(nn.Module):
    """Torch form of a fitted :class:`NoveltyDetector`: ``forward(features, predicted) -> u``."""

    log_columns: torch.Tensor
    offset: torch.Tensor
    mean: torch.Tensor
    scale: torch.Tensor
    class_means: torch.Tensor
    class_present: torch.Tensor
    precision: torch.Tensor
    reference: torch.Tensor
    whiten: torch.Tensor | None
    points: torch.Tensor | None

    def __init__(self, arrays: dict[str, np.ndarray], n_features: int) -> None:
        super().__init__()
        _check_novelty_arrays(arrays, n_features)
        self.n_features = int(n_features)
        for key in _NOVELTY_ARRAYS:
            value = np.asarray(arrays[key])
            flag = key in ("log_columns", "class_present")
            value = value.astype(bool) if flag else value.astype(np.float32)
            self.register_buffer(key, torch.from_numpy(np.ascontiguousarray(value)))
        for key in _NEAREST_ARRAYS:  # the nearest-sample distance: whitened clean fitting rows
            tensor = None
            if key in arrays:
                tensor = torch.from_numpy(np.ascontiguousarray(np.asarray(arrays[key], np.float32)))
            self.register_buffer(key, tensor)

    def standardized(self, features: torch.Tensor) -> torch.Tensor:
        """The features logged where non-negative and standardized, float32 [N, F]."""
        if features.ndim != 2 or features.shape[1] != self.n_features:
            raise InputError(
                f"fitted on {self.n_features} features, got {tuple(features.shape)}: "
                "this detector belongs to another network"
            )
        x = features.float()
        logged = torch.log(torch.clamp(x, min=0.0) + self.offset)
        return (torch.where(self.log_columns, logged, x) - self.mean) / self.scale

    def distance(
        self,
        features: torch.Tensor,
        predicted: torch.Tensor | None,
        *,
        groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Squared Mahalanobis distance to the nearest clean fitting sample (when fitted with
        ``distance="nearest"``; ``groups``: (the inputs' group ids, the fitting samples'), a
        sample of an input's own group is never its nearest), else to the predicted class's
        mean (nearest mean for labels without one, or when ``predicted`` is None)."""
        z = self.standardized(features)
        if self.points is not None and self.whiten is not None:
            return nearest_distance(z @ self.whiten, self.points, groups=groups)
        diff = z[:, None, :] - self.class_means[None]  # [N, K, F]
        squared = ((diff @ self.precision) * diff).sum(dim=2)  # [N, K]
        squared = torch.where(self.class_present[None], squared, torch.inf)
        nearest = squared.min(dim=1).values
        if predicted is None:
            return nearest
        k = self.class_means.shape[0]
        labels = predicted.to(z.device).long()
        inside = (labels >= 0) & (labels < k)
        own = squared.gather(1, labels.clamp(0, k - 1)[:, None])[:, 0]
        return torch.where(inside & torch.isfinite(own), own, nearest)

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        return clean_cdf(self.reference, self.distance(features, predicted))


def _whitening(precision: np.ndarray) -> np.ndarray:
    """W with W W^T = ``precision`` (symmetric PSD), float32: ||z W||^2 is the Mahalanobis
    distance squared (an eigendecomposition, which a nearly singular matrix does not break)."""
    values, vectors = np.linalg.eigh((precision + precision.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0.0, None))).astype(np.float32)


def _check_novelty_arrays(arrays: dict[str, np.ndarray], n_features: int) -> None:
    missing = [k for k in _NOVELTY_ARRAYS if k not in arrays]
    if missing:
        raise ArtefactError(f"novelty detector arrays lack {', '.join(missing)}")
    f = int(n_features)
    shapes = {
        "log_columns": (f,),
        "offset": (f,),
        "mean": (f,),
        "scale": (f,),
        "precision": (f, f),
    }
    for key, shape in shapes.items():
        if np.asarray(arrays[key]).shape != shape:
            raise ArtefactError(f"novelty array {key!r} must have shape {shape}")
    means = np.asarray(arrays["class_means"])
    if means.ndim != 2 or means.shape[1] != f or np.asarray(arrays["reference"]).ndim != 1:
        raise ArtefactError("novelty arrays 'class_means'/'reference' have the wrong shape")
    present = np.asarray(arrays["class_present"])
    if present.shape != (len(means),) or not present.any():
        raise ArtefactError("novelty array 'class_present' must flag at least one class mean")
    if np.asarray(arrays["reference"]).size == 0:
        raise ArtefactError("novelty array 'reference' is empty")
    nearest = [k for k in _NEAREST_ARRAYS if k in arrays]
    if nearest and len(nearest) != len(_NEAREST_ARRAYS):
        raise ArtefactError("novelty arrays 'whiten' and 'points' travel together")
    if nearest:
        points, whiten = np.asarray(arrays["points"]), np.asarray(arrays["whiten"])
        if whiten.shape != (f, f) or points.ndim != 2 or points.shape[1] != f or not len(points):
            raise ArtefactError(
                f"novelty arrays 'whiten' ({f}, {f}) and 'points' (N, {f}) expected"
            )


@register_detector
class NoveltyDetector(Detector):
    """Class-conditional Gaussian on clean trajectory features; score = share of clean samples
    closer (see the module docstring). ``distance="class-mean"``: the Mahalanobis distance to
    the predicted class's mean; ``"nearest"``: in the same metric (the shared within-class
    covariance), to the nearest clean fitting sample of any class (a 1-nearest-neighbour
    distance; each fitting sample's own is to its nearest OTHER one). Classes predicted fewer
    than ``min_class_samples`` times get no mean of their own (the nearest mean is used); when
    no class has that many, every class shares the pooled mean (one Gaussian for all)."""

    info = DetectorInfo(
        "novelty",
        "NV",
        reads="features",
        supervised=False,
        default_threshold=None,
        servable=True,
        summary="clean trajectory features only: the distance to the nearest clean image in a "
        "class-conditional Gaussian's metric",
    )

    def __init__(
        self,
        min_class_samples: int = 20,
        distance: str = "nearest",
        random_state: int | None = 0,
    ) -> None:
        self.min_class_samples = min_class_samples
        self.distance = distance
        self.random_state = random_state  # unused (the fit is deterministic); kept for with_seed

    def fit(self, features: np.ndarray, predicted_labels: np.ndarray) -> NoveltyDetector:
        """Fit on CLEAN features [N, F] and the network's predicted classes [N]."""
        x = check_features(features).astype(np.float64)
        predicted = check_class_labels(predicted_labels, len(x))
        if self.distance not in NOVELTY_DISTANCES:
            raise InputError(
                f"distance must be one of {', '.join(NOVELTY_DISTANCES)}, got {self.distance!r}"
            )
        if len(x) < 2 * x.shape[1]:
            raise InputError(
                f"a Gaussian on {x.shape[1]} features needs at least {2 * x.shape[1]} clean samples, got {len(x)}"
            )
        log_columns = x.min(axis=0) >= 0
        offset = np.maximum(1e-6, 0.01 * np.median(np.where(log_columns, x, 1.0), axis=0))
        z = np.where(log_columns, np.log(np.clip(x, 0, None) + offset), x)
        mean, scale = z.mean(axis=0), z.std(axis=0) + 1e-6
        z = (z - mean) / scale
        k = int(predicted.max()) + 1
        counts = np.bincount(predicted, minlength=k)
        present = counts >= self.min_class_samples
        class_means = np.zeros((k, x.shape[1]))
        for c in np.flatnonzero(present):
            class_means[c] = z[predicted == c].mean(axis=0)
        if not present.any():  # no class has a mean of its own: all share the pooled one (z: 0)
            present[:] = True
        own = np.where(present[predicted, None], class_means[predicted], 0.0)
        precision = np.linalg.pinv(LedoitWolf().fit(z - own).covariance_)
        self.n_features_in_ = x.shape[1]
        self.arrays_ = {
            "log_columns": log_columns.astype(np.uint8),
            "offset": offset.astype(np.float32),
            "mean": mean.astype(np.float32),
            "scale": scale.astype(np.float32),
            "class_means": class_means.astype(np.float32),
            "class_present": present.astype(np.uint8),
            "precision": precision.astype(np.float32),
            "reference": np.zeros(1, np.float32),
        }
        with torch.inference_mode():
            scorer = NoveltyScorer(self.arrays_, self.n_features_in_)
            rows = torch.from_numpy(x.astype(np.float32))
            if self.distance == "nearest":
                whiten = _whitening(precision)
                points = scorer.standardized(rows) @ torch.from_numpy(whiten)
                self.arrays_.update(whiten=whiten, points=points.numpy())
                d = nearest_distance(points, points, exclude_self=True)
            else:
                d = scorer.distance(rows, torch.from_numpy(predicted))
        self.arrays_["reference"] = np.sort(d.numpy().astype(np.float32))
        return self

    def fit_samples(self, clean: SampleSet, abnormal: SampleSet) -> NoveltyDetector:
        """Fit on the clean samples only (``abnormal`` is ignored: a clean-only detector)."""
        return self.fit(clean.features, clean.predicted)

    def score(self, features: np.ndarray, predicted_labels: np.ndarray) -> np.ndarray:
        """Share of clean fitting samples closer to their class, in [0, 1]: HIGHER = MORE ABNORMAL."""
        check_fitted(self)
        x = check_features(features, self.n_features_in_)
        predicted = check_class_labels(predicted_labels, len(x))
        with torch.inference_mode():
            scores = self.to_torch()(torch.from_numpy(x), torch.from_numpy(predicted))
        return scores.numpy().astype(np.float64)

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        return self.score(samples.features, samples.predicted)

    def to_torch(self) -> NoveltyScorer:
        check_fitted(self)
        return NoveltyScorer(self.arrays_, self.n_features_in_)

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        check_fitted(self)
        return dict(self.arrays_), {**self.get_params(), "n_features_in": int(self.n_features_in_)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], params: dict[str, Any]) -> NoveltyDetector:
        params = dict(params)
        params.setdefault("distance", "class-mean")  # bundles from before the nearest distance
        try:
            n_features = int(params.pop("n_features_in"))
            detector = cls(**params)
        except (KeyError, TypeError, ValueError) as error:
            raise ArtefactError(f"novelty detector params are incomplete: {error}") from error
        _check_novelty_arrays(arrays, n_features)
        if ("points" in arrays) != (detector.distance == "nearest"):
            raise ArtefactError(
                f"novelty arrays do not match distance={detector.distance!r} "
                "(the nearest-sample distance carries 'whiten' and 'points')"
            )
        detector.n_features_in_ = n_features
        keys = _NOVELTY_ARRAYS + (_NEAREST_ARRAYS if "points" in arrays else ())
        detector.arrays_ = {k: np.asarray(arrays[k]) for k in keys}
        return detector
