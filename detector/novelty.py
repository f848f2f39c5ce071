"""What clean looks like: a class-conditional Gaussian on the trajectory features, and its
ensemble with the supervised forests.

``NoveltyDetector`` is fitted on CLEAN samples only (abnormal ones are ignored): features are
made closer to Gaussian (log of the non-negative columns, e.g. the residues' ||r_m||^2/d_m), then
standardized; one mean per predicted class and one shared covariance (Ledoit-Wolf shrinkage) give
the Mahalanobis distance of a sample to its predicted class (Lee et al. 2018, here on the
transport features instead of the raw activations). Its score is the share of the clean fitting
samples that are closer -- the empirical CDF of the clean distances, in [0, 1]: HIGHER = MORE
ABNORMAL, about uniform on clean inputs, 1 beyond every clean sample.

``EnsembleDetector`` flags what the forests flag OR what lies in the far tail of clean:
score = max(forest vote fraction, clip(1 - (1 - u) / tail, 0, 1)), so at the default
threshold 0.5 the novelty part spends ``tail / 2`` of the false-positive budget; the bundle's
threshold is calibrated on the combined score. ``tail`` defaults to the bundle's default FPR
target (5%): at the decision 0.5 the clean-only part flags 2.5% of clean inputs and the forests
about 1-1.5%, so the ensemble's own decision stays inside the budget a deployment calibrates to
(0.02, i.e. 1% of clean, left half of it unused: on a validation quarter of the training side,
forests trained on FGM only then missed most of the attacks they never saw). Both travel as
arrays + JSON, never pickles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.covariance import LedoitWolf
from torch import nn

from detector.base import (
    DEFAULT_VOTE_THRESHOLD,
    Detector,
    DetectorInfo,
    SampleSet,
    abnormal_labels,
    check_class_labels,
    check_fitted,
)
from detector.errors import ArtefactError, InputError
from detector.features import check_features
from detector.forest import TransportDetector
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

    def __init__(self, arrays: dict[str, np.ndarray], n_features: int) -> None:
        super().__init__()
        _check_novelty_arrays(arrays, n_features)
        self.n_features = int(n_features)
        for key in _NOVELTY_ARRAYS:
            value = np.asarray(arrays[key])
            flag = key in ("log_columns", "class_present")
            value = value.astype(bool) if flag else value.astype(np.float32)
            self.register_buffer(key, torch.from_numpy(np.ascontiguousarray(value)))

    def distance(self, features: torch.Tensor, predicted: torch.Tensor | None) -> torch.Tensor:
        """Squared Mahalanobis distance to the predicted class's mean (nearest mean for labels
        without one, or when ``predicted`` is None)."""
        if features.ndim != 2 or features.shape[1] != self.n_features:
            raise InputError(
                f"fitted on {self.n_features} features, got {tuple(features.shape)}: "
                "this detector belongs to another network"
            )
        x = features.float()
        logged = torch.log(torch.clamp(x, min=0.0) + self.offset)
        z = (torch.where(self.log_columns, logged, x) - self.mean) / self.scale
        diff = z[:, None, :] - self.class_means[None]  # [N, K, F]
        squared = ((diff @ self.precision) * diff).sum(dim=2)  # [N, K]
        squared = torch.where(self.class_present[None], squared, torch.inf)
        nearest = squared.min(dim=1).values
        if predicted is None:
            return nearest
        k = self.class_means.shape[0]
        labels = predicted.to(x.device).long()
        inside = (labels >= 0) & (labels < k)
        own = squared.gather(1, labels.clamp(0, k - 1)[:, None])[:, 0]
        return torch.where(inside & torch.isfinite(own), own, nearest)

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        d = self.distance(features, predicted)
        rank = torch.searchsorted(self.reference, d.contiguous(), right=True)
        return rank.to(torch.float32) / self.reference.numel()


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


@register_detector
class NoveltyDetector(Detector):
    """Class-conditional Gaussian on clean trajectory features; score = share of clean samples
    closer to their class (see the module docstring). Classes predicted fewer than
    ``min_class_samples`` times get no mean of their own (the nearest mean is used)."""

    info = DetectorInfo(
        "novelty", "NV", reads="features", supervised=False, default_threshold=None, servable=True
    )

    def __init__(self, min_class_samples: int = 20, random_state: int | None = 0) -> None:
        self.min_class_samples = min_class_samples
        self.random_state = random_state  # unused (the fit is deterministic); kept for with_seed

    def fit(self, features: np.ndarray, predicted_labels: np.ndarray) -> NoveltyDetector:
        """Fit on CLEAN features [N, F] and the network's predicted classes [N]."""
        x = check_features(features).astype(np.float64)
        predicted = check_class_labels(predicted_labels, len(x))
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
        if not present.any():
            raise InputError(f"no class has {self.min_class_samples} clean samples to fit a mean")
        class_means = np.zeros((k, x.shape[1]))
        for c in np.flatnonzero(present):
            class_means[c] = z[predicted == c].mean(axis=0)
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
            d = scorer.distance(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(predicted))
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
        try:
            n_features = int(params.pop("n_features_in"))
            detector = cls(**params)
        except (KeyError, TypeError, ValueError) as error:
            raise ArtefactError(f"novelty detector params are incomplete: {error}") from error
        _check_novelty_arrays(arrays, n_features)
        detector.n_features_in_ = n_features
        detector.arrays_ = {k: np.asarray(arrays[k]) for k in _NOVELTY_ARRAYS}
        return detector


class EnsembleScorer(nn.Module):
    """max(forest vote fraction, novelty tail ramp): torch form of :class:`EnsembleDetector`."""

    def __init__(self, forests: nn.Module, novelty: NoveltyScorer, tail: float) -> None:
        super().__init__()
        self.forests = forests
        self.novelty = novelty
        self.tail = float(tail)

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        u = self.novelty(features, predicted)
        ramp = torch.clamp(1.0 - (1.0 - u) / self.tail, 0.0, 1.0)  # exactly 1 at u = 1
        return torch.maximum(self.forests(features, predicted).float(), ramp)


@register_detector
class EnsembleDetector(Detector):
    """The transport forests (what attacks look like) OR the novelty detector's far tail (what
    clean does not look like): see the module docstring. ``tail`` is the clean tail the novelty
    part ramps over (a share of the false-positive budget, fixed a priori, never tuned on tests)."""

    info = DetectorInfo("ensemble", "TR+NV", reads="features", servable=True)

    def __init__(
        self,
        n_estimators: int = 100,
        max_depth: int | None = None,
        class_conditional: bool = True,
        min_class_samples: int = 20,
        tail: float = 0.05,
        random_state: int | None = 0,
        n_jobs: int | None = None,
    ) -> None:
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.class_conditional = class_conditional
        self.min_class_samples = min_class_samples
        self.tail = tail
        self.random_state = random_state
        self.n_jobs = n_jobs

    def _parts(self) -> tuple[TransportDetector, NoveltyDetector]:
        shared = {k: v for k, v in self.get_params().items() if k != "tail"}
        return TransportDetector(**shared), NoveltyDetector(
            min_class_samples=self.min_class_samples
        )

    def fit(
        self, features: np.ndarray, is_abnormal: np.ndarray, predicted_labels: np.ndarray
    ) -> EnsembleDetector:
        """Forests on every row (0 clean / 1 abnormal); the Gaussian on the clean rows only."""
        if not 0 < self.tail < 1:
            raise InputError(f"tail must be in (0, 1), got {self.tail}")
        forests, novelty = self._parts()
        self.forests_ = forests.fit(features, is_abnormal, predicted_labels)
        clean = np.asarray(is_abnormal) == 0
        self.novelty_ = novelty.fit(
            np.asarray(features)[clean], np.asarray(predicted_labels)[clean]
        )
        self.n_features_in_ = self.forests_.n_features_in_
        return self

    def fit_samples(self, clean: SampleSet, abnormal: SampleSet) -> EnsembleDetector:
        """Forests on clean vs abnormal; the Gaussian on the clean samples only."""
        return self.fit(
            np.concatenate([clean.features, abnormal.features]),
            abnormal_labels(clean, abnormal),
            np.concatenate([clean.predicted, abnormal.predicted]),
        )

    def score(self, features: np.ndarray, predicted_labels: np.ndarray) -> np.ndarray:
        """Combined scores in [0, 1]: HIGHER = MORE ABNORMAL; > 0.5 is the default decision."""
        check_fitted(self)
        # float32 arithmetic, as the torch form computes it
        u = self.novelty_.score(features, predicted_labels).astype(np.float32)
        ramp = np.float32(1.0) - (np.float32(1.0) - u) / np.float32(self.tail)
        ramp = np.clip(ramp, np.float32(0.0), np.float32(1.0))
        forests = self.forests_.score(features, predicted_labels).astype(np.float32)
        return np.maximum(forests, ramp).astype(np.float64)

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        return self.score(samples.features, samples.predicted)

    def predict(self, features: np.ndarray, predicted_labels: np.ndarray) -> np.ndarray:
        return self.score(features, predicted_labels) > DEFAULT_VOTE_THRESHOLD

    def to_torch(self) -> EnsembleScorer:
        check_fitted(self)
        return EnsembleScorer(self.forests_.to_torch(), self.novelty_.to_torch(), self.tail)

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        check_fitted(self)
        forest_arrays, _ = self.forests_.to_arrays()
        novelty_arrays, _ = self.novelty_.to_arrays()
        arrays = {f"forest.{k}": v for k, v in forest_arrays.items()}
        arrays.update({f"novelty.{k}": v for k, v in novelty_arrays.items()})
        return arrays, {**self.get_params(), "n_features_in": int(self.n_features_in_)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], params: dict[str, Any]) -> EnsembleDetector:
        params = dict(params)
        try:
            n_features = int(params.pop("n_features_in"))
            detector = cls(**params)
        except (KeyError, TypeError, ValueError) as error:
            raise ArtefactError(f"ensemble detector params are incomplete: {error}") from error

        def part(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

        forests, _ = detector._parts()
        forest_params = {**forests.get_params(), "n_features_in": n_features}
        detector.forests_ = TransportDetector.from_arrays(part("forest."), forest_params)
        detector.novelty_ = NoveltyDetector.from_arrays(
            part("novelty."),
            {"min_class_samples": detector.min_class_samples, "n_features_in": n_features},
        )
        detector.n_features_in_ = n_features
        return detector
