"""Mahalanobis baseline (Lee et al. 2018; seed 003, appendix E.2.1).

Per layer l (the input of the first residual block and the output of each stage, i.e. the last
block of each group of blocks of one shape; or every block's output with ``layers="blocks"``),
activations are mean-pooled over space, class means and one tied covariance are fitted on clean
training images (``fit_clean``; the precision is a pseudo-inverse, so singular covariances are
fine), and the layer's feature is the Gaussian score

    S_l(x) = max_c -(h_l(x) - mu_c)^T Sigma^-1 (h_l(x) - mu_c)        (higher = more normal)

after input pre-processing x -> x - eps * sign(grad_x min_c distance_l), a step that increases
S_l (Lee et al.; their step in normalized space equals this one in pixel space). The per-layer
scores go into a random forest trained on abnormal-vs-clean images (``fit``), whose fraction of
trees voting abnormal is the score: HIGHER = MORE ABNORMAL. The magnitude eps is chosen on a
validation split of the training data passed to ``fit`` (best AUROC), never on test data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from sklearn.covariance import EmpiricalCovariance
from sklearn.ensemble import RandomForestClassifier
from sklearn.model_selection import train_test_split
from torch import nn

from detector.base import (
    Detector,
    DetectorInfo,
    SampleSet,
    abnormal_labels,
    check_binary_labels,
    check_class_labels,
    check_fitted,
    source_groups,
)
from detector.errors import ConfigError, InputError
from detector.features import check_features, check_images, model_device
from detector.metrics import auroc
from detector.registry import register_detector
from detector.taps import Tap, Taps, default_tap_names
from detector.voting import ForestDecision, oob_vote_fraction, vote_fraction

MAGNITUDES = (0.0, 0.0005, 0.001, 0.0014, 0.002, 0.005, 0.01)


def mahalanobis_key(magnitude: float) -> str:
    """Name of the precomputed Mahalanobis features at ``magnitude`` in ``samples.extra``."""
    return f"mahalanobis@{magnitude:g}"


def block_names(model: nn.Module, taps: Sequence[str] | None = None) -> list[str]:
    """Residual block modules: the parents of the residual taps."""
    names = list(taps) if taps is not None else default_tap_names(model)
    return [name.rsplit(".", 1)[0] for name in names]


def _pool(x: torch.Tensor) -> torch.Tensor:
    """Spatial mean of an activation [N, C, ...] as float32 [N, C] (gradients flow through)."""
    return x.float().mean(dim=tuple(range(2, x.ndim))) if x.ndim > 2 else x.float()


def layer_taps(model: nn.Module, first: str, outputs: Sequence[str]) -> Taps:
    """Taps recording mean-pooled activations: the input of ``first`` and the outputs of
    ``outputs`` (module names), in that order."""
    return Taps(model, [Tap(first, "input"), *outputs], transform=_pool)


def stage_layers(
    model: nn.Module, sample: torch.Tensor, taps: Sequence[str] | None, layers: str
) -> list[str]:
    """Block names whose outputs are used: the last block of each same-shape group ("stages")
    or every block ("blocks")."""
    names = block_names(model, taps)
    if layers == "blocks":
        return names
    with (
        torch.no_grad(),
        Taps(model, names, transform=lambda out: tuple(out.shape[1:])) as shapes_seen,
    ):
        model(sample)
        shapes = shapes_seen.outputs
    return [n for i, n in enumerate(names) if i == len(names) - 1 or shapes[i] != shapes[i + 1]]


def gaussian_scores(h: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """max_c -(h - mu_c)^T P (h - mu_c) per sample: [N]."""
    diff = h[:, None, :] - means[None, :, :]  # [N, K, C]
    distance = torch.einsum("nkc,cd,nkd->nk", diff, precision, diff)
    return -distance.min(dim=1).values


@register_detector
class MahalanobisDetector(ForestDecision, Detector):
    """Lee et al. (2018) with a random forest on per-layer scores (see the module docstring).

    ``fit_clean(model, x, y)`` then ``fit(model, x, is_abnormal)``; ``score(model, x)`` ->
    float64 [N], HIGHER = MORE ABNORMAL (fraction of trees voting abnormal). At the sample-set
    level: ``prepare`` (= ``fit_clean``), ``precompute`` once per image set, then
    ``fit_samples``/``score_samples`` read the per-magnitude features from ``samples.extra``.
    """

    info = DetectorInfo(
        "mahalanobis",
        "MH",
        reads="network",
        summary="random forest on per-layer Mahalanobis scores of the activations (Lee et al. 2018)",
    )

    def __init__(
        self,
        magnitudes: Sequence[float] = MAGNITUDES,
        random_state: int | None = 0,
        *,
        layers: Literal["stages", "blocks"] = "stages",
        taps: Sequence[str] | None = None,
        n_estimators: int = 100,
        validation_fraction: float = 0.2,
        selection_samples: int | None = 2000,
        batch_size: int = 128,
        decision: str = "oob",
        n_jobs: int | None = None,
    ) -> None:
        self.magnitudes = magnitudes
        self.random_state = random_state
        self.layers = layers
        self.taps = taps
        self.n_estimators = n_estimators
        self.validation_fraction = validation_fraction
        self.selection_samples = selection_samples
        self.batch_size = batch_size
        self.decision = decision
        self.n_jobs = n_jobs

    # ---------------------------------------------------------------------------------------
    # Layer activations and scores
    # ---------------------------------------------------------------------------------------
    def _taps(self, model: nn.Module) -> Taps:
        return layer_taps(model, block_names(model, self.taps)[0], self.layer_names_)

    def _pooled(self, model: nn.Module, x: np.ndarray) -> list[np.ndarray]:
        device = model_device(model)
        parts: list[list[np.ndarray]] = []
        with torch.no_grad(), self._taps(model) as taps:
            for start in range(0, len(x), self.batch_size):
                model(torch.from_numpy(x[start : start + self.batch_size]).to(device))
                parts.append([h.cpu().numpy() for h in taps.outputs])
        return [
            np.concatenate([p[i] for p in parts]).astype(np.float64) for i in range(len(parts[0]))
        ]

    def _statistics(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        means = [torch.from_numpy(m).float().to(device) for m in self.means_]
        precisions = [torch.from_numpy(p).float().to(device) for p in self.precisions_]
        return means, precisions

    def _check_network(self, model: nn.Module, x: np.ndarray) -> None:
        with torch.no_grad(), self._taps(model) as taps:
            model(torch.from_numpy(x[:1]).to(model_device(model)))
            dims = [h.shape[1] for h in taps.outputs]
        if dims != self.layer_dims_:
            raise InputError(
                f"fitted on layers with dims {self.layer_dims_}, got {dims}: this detector belongs to another network"
            )

    @staticmethod
    def _gradient_signs(
        model: nn.Module,
        taps: Taps,
        batch: torch.Tensor,
        means: list[torch.Tensor],
        precisions: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """sign(grad_x min_c distance_l) for every layer l (independent of the magnitude)."""
        x = batch.clone().requires_grad_(True)
        with torch.enable_grad():
            model(x)
            layers = taps.outputs
            signs = []
            for index, h in enumerate(layers):
                distance = -gaussian_scores(h, means[index], precisions[index])
                (grad,) = torch.autograd.grad(
                    distance.sum(), x, retain_graph=index < len(layers) - 1
                )
                signs.append(grad.sign())
        return signs

    def _features_for(
        self, model: nn.Module, x: np.ndarray, magnitudes: Sequence[float]
    ) -> dict[float, np.ndarray]:
        """Per-layer Gaussian scores [N, L] of ``x`` for each magnitude."""
        check_fitted(self)
        device = model_device(model)
        means, precisions = self._statistics(device)
        n_layers = len(means)
        out: dict[float, list[np.ndarray]] = {float(m): [] for m in magnitudes}
        was_training = model.training
        model.eval()
        try:
            with self._taps(model) as taps:
                for start in range(0, len(x), self.batch_size):
                    batch = torch.from_numpy(x[start : start + self.batch_size]).to(device)
                    signs = None
                    if any(m > 0 for m in magnitudes):
                        signs = self._gradient_signs(model, taps, batch, means, precisions)
                    for magnitude in out:
                        with torch.no_grad():
                            if magnitude == 0 or signs is None:
                                model(batch)
                                layers = taps.outputs
                                scores = [
                                    gaussian_scores(layers[i], means[i], precisions[i])
                                    for i in range(n_layers)
                                ]
                            else:
                                scores = []
                                for i in range(n_layers):
                                    model(batch - magnitude * signs[i])
                                    scores.append(
                                        gaussian_scores(taps.outputs[i], means[i], precisions[i])
                                    )
                        out[magnitude].append(torch.stack(scores, dim=1).cpu().numpy())
        finally:
            model.train(was_training)
        return {m: np.concatenate(parts).astype(np.float32) for m, parts in out.items()}

    def mahalanobis_features(self, model: nn.Module, x: np.ndarray, magnitude: float) -> np.ndarray:
        """Per-layer Gaussian scores [N, L] (higher = more normal) after pre-processing with ``magnitude``."""
        x = check_images(x)
        check_fitted(self)
        self._check_network(model, x)
        return self._features_for(model, x, [magnitude])[float(magnitude)]

    # ---------------------------------------------------------------------------------------
    # Fitting and scoring
    # ---------------------------------------------------------------------------------------
    def fit_clean(self, model: nn.Module, x: np.ndarray, y: np.ndarray) -> MahalanobisDetector:
        """Class means and tied covariance per layer from clean training images and their labels."""
        if self.layers not in ("stages", "blocks"):
            raise ConfigError(f"layers must be 'stages' or 'blocks', got {self.layers!r}")
        x = check_images(x)
        labels = check_class_labels(y, len(x), "y")
        if len(x) < 2:
            raise InputError("fit_clean needs at least 2 images")
        was_training = model.training
        model.eval()
        try:
            sample = torch.from_numpy(x[:1]).to(model_device(model))
            self.layer_names_ = stage_layers(model, sample, self.taps, self.layers)
            pooled = self._pooled(model, x)
        finally:
            model.train(was_training)
        classes = np.unique(labels)
        means, precisions = [], []
        for h in pooled:
            class_means = np.stack([h[labels == c].mean(axis=0) for c in classes])
            centered = h - class_means[np.searchsorted(classes, labels)]
            precisions.append(EmpiricalCovariance(assume_centered=True).fit(centered).precision_)
            means.append(class_means)
        self.classes_ = classes
        self.means_ = means
        self.precisions_ = precisions
        self.layer_dims_ = [h.shape[1] for h in pooled]
        return self

    def copy_statistics(self, **params: Any) -> MahalanobisDetector:
        """A new detector with this one's parameters updated by ``params`` and its fitted clean
        statistics (``fit_clean``) shared, ready for ``fit``: one Gaussian fit, many forests."""
        check_fitted(self)
        copy = type(self)(**{**self.get_params(), **params})
        for name in ("layer_names_", "classes_", "means_", "precisions_", "layer_dims_"):
            setattr(copy, name, getattr(self, name))
        return copy

    def _forest(self) -> RandomForestClassifier:
        return RandomForestClassifier(
            n_estimators=self.n_estimators, random_state=self.random_state, n_jobs=self.n_jobs
        )

    def _magnitudes(self) -> list[float]:
        magnitudes = [float(m) for m in self.magnitudes]
        if not magnitudes or any(m < 0 for m in magnitudes):
            raise ConfigError(
                f"magnitudes must be a non-empty list of values >= 0, got {self.magnitudes}"
            )
        return magnitudes

    def features_by_magnitude(self, model: nn.Module, x: np.ndarray) -> dict[float, np.ndarray]:
        """Per-layer Gaussian scores [N, L] of ``x`` at every one of ``magnitudes`` (one gradient
        pass per batch, shared by all magnitudes): the input of :meth:`fit_features`, computed once
        per image set when several forests are fitted on the same images."""
        if not hasattr(self, "means_"):
            raise ConfigError("call fit_clean(model, clean_train_images, labels) first")
        x = check_images(x)
        self._check_network(model, x)
        return self._features_for(model, x, self._magnitudes())

    def fit(self, model: nn.Module, x: np.ndarray, is_abnormal: np.ndarray) -> MahalanobisDetector:
        """Choose the magnitude on a validation split of (x, is_abnormal), then fit the forest on all."""
        if not hasattr(self, "means_"):
            raise ConfigError("call fit_clean(model, clean_train_images, labels) before fit")
        return self.fit_features(self.features_by_magnitude(model, x), is_abnormal)

    def fit_features(
        self,
        features: dict[float, np.ndarray],
        is_abnormal: np.ndarray,
        groups: np.ndarray | None = None,
    ) -> MahalanobisDetector:
        """:meth:`fit` from precomputed :meth:`features_by_magnitude`: the magnitude with the best
        validation AUROC (on at most ``selection_samples`` rows of this training data), then the
        forest on every row at that magnitude; ``groups``: each row's source image, for the
        out-of-bag decision's votes."""
        check_fitted(self)
        self._check_decision()
        magnitudes = self._magnitudes()
        missing = [m for m in magnitudes if m not in features]
        if missing:
            raise InputError(
                f"features for magnitudes {missing} are missing (have {sorted(features)})"
            )
        n = len(features[magnitudes[0]])
        y = check_binary_labels(is_abnormal, n)
        self.selection_auroc_: dict[float, float] = {}
        if len(magnitudes) == 1:
            self.magnitude_ = magnitudes[0]
        else:
            index = np.arange(n)
            if self.selection_samples is not None and n > self.selection_samples:
                index, _ = train_test_split(
                    index,
                    train_size=self.selection_samples,
                    stratify=y,
                    random_state=self.random_state,
                )
            train, val = train_test_split(
                index,
                test_size=self.validation_fraction,
                stratify=y[index],
                random_state=self.random_state,
            )
            for magnitude in magnitudes:
                f = check_features(features[magnitude])
                forest = self._forest().fit(f[train], y[train])
                self.selection_auroc_[magnitude] = auroc(y[val], vote_fraction(forest, f[val]))
            self.magnitude_ = max(
                magnitudes, key=lambda m: self.selection_auroc_[m]
            )  # first of the best
        chosen = check_features(features[self.magnitude_])
        self.forest_ = self._forest().fit(chosen, y)
        self.n_features_in_ = chosen.shape[1]
        self._learn_decision(lambda: oob_vote_fraction(self.forest_, chosen, groups), y)
        return self

    # ---------------------------------------------------------------------------------------
    # The sample-set level (detector.base.Detector)
    # ---------------------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, images: np.ndarray, labels: np.ndarray
    ) -> MahalanobisDetector:
        """:meth:`fit_clean`: class statistics from clean training images and their labels."""
        return self.fit_clean(model, images, labels)

    def precompute(self, model: nn.Module, images: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`features_by_magnitude` of ``images``, keyed by :func:`mahalanobis_key`."""
        features = self.features_by_magnitude(model, images)
        return {mahalanobis_key(m): f for m, f in features.items()}

    def precompute_keys(self) -> list[str]:
        """One :func:`mahalanobis_key` per input pre-processing magnitude."""
        return [mahalanobis_key(m) for m in self.magnitudes]

    def with_seed(self, seed: int) -> MahalanobisDetector:
        """An unfitted copy with ``random_state=seed`` sharing the clean statistics, if fitted."""
        if hasattr(self, "means_"):
            return self.copy_statistics(random_state=seed)
        return type(self)(**{**self.get_params(), "random_state": seed})

    @staticmethod
    def _extra(samples: SampleSet, magnitude: float) -> np.ndarray:
        key = mahalanobis_key(magnitude)
        if key not in samples.extra:
            raise ConfigError(
                f"samples {getattr(samples, 'name', '')!r} lack {key!r}: add "
                "detector.precompute(model, samples.images) to samples.extra first"
            )
        return samples.extra[key]

    def fit_samples(self, clean: SampleSet, abnormal: SampleSet) -> MahalanobisDetector:
        """:meth:`fit_features` on the precomputed features of clean vs abnormal samples."""
        features = {
            float(m): np.concatenate([self._extra(clean, m), self._extra(abnormal, m)])
            for m in self.magnitudes
        }
        return self.fit_features(
            features, abnormal_labels(clean, abnormal), source_groups(clean, abnormal)
        )

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        """Forest score of the precomputed features at ``magnitude_``: HIGHER = MORE ABNORMAL."""
        self._check_forest()
        return self.score_features(self._extra(samples, self.magnitude_))

    def _check_forest(self) -> None:
        check_fitted(self)
        if not hasattr(self, "forest_"):
            raise ConfigError("call fit(model, x, is_abnormal) before scoring")

    def score_features(self, features: np.ndarray) -> np.ndarray:
        """Forest score of precomputed per-layer features (``mahalanobis_features`` at
        ``magnitude_``): HIGHER = MORE ABNORMAL."""
        self._check_forest()
        return vote_fraction(self.forest_, check_features(features, self.n_features_in_))

    def score(self, model: nn.Module, x: np.ndarray) -> np.ndarray:
        """Abnormality scores in [0, 1] of images ``x``: HIGHER = MORE ABNORMAL."""
        self._check_forest()
        return self.score_features(self.mahalanobis_features(model, x, self.magnitude_))


def mahalanobis_features(
    model: nn.Module, x: np.ndarray, statistics: MahalanobisDetector, magnitude: float = 0.0
) -> np.ndarray:
    """Per-layer Gaussian scores [N, L] of ``x`` from a detector fitted with ``fit_clean``
    (function form of :meth:`MahalanobisDetector.mahalanobis_features`, e.g. for timing)."""
    return statistics.mahalanobis_features(model, x, magnitude)
