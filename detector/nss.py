"""Natural-scene-statistics baseline (Kherchouche et al. 2020; seed 003, appendix E.2.2).

BRISQUE-style statistics of the IMAGE (no network; :mod:`detector.scene_statistics`): MSCN
coefficients, a generalized Gaussian fit to them and asymmetric generalized Gaussian fits to
their four pairwise products, at 2 scales = 36 features. A random forest on them gives the
score, the fraction of trees voting abnormal: HIGHER = MORE ABNORMAL.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.ensemble import RandomForestClassifier
from torch import nn

from detector.base import (
    Detector,
    DetectorInfo,
    SampleSet,
    abnormal_labels,
    check_binary_labels,
    check_fitted,
    source_groups,
)
from detector.features import check_features, check_images
from detector.registry import register_detector
from detector.scene_statistics import scene_statistics
from detector.voting import ForestDecision, oob_vote_fraction, vote_fraction

NSS_KEY = "nss"  # the precomputed features' key in ``samples.extra``


def nss_features(
    images: np.ndarray, *, value_range: tuple[float, float] = (0.0, 1.0), chunk: int = 1024
) -> np.ndarray:
    """36 BRISQUE-style features per image of ``images`` [N, C, H, W] (float32 [N, 36]):
    :func:`detector.scene_statistics.scene_statistics`, ``chunk`` images at a time."""
    images = check_images(images, name="images")
    with torch.inference_mode():
        out = [
            scene_statistics(torch.from_numpy(images[start : start + chunk]), value_range).numpy()
            for start in range(0, len(images), chunk)
        ]
    return np.concatenate(out) if out else np.zeros((0, 36), np.float32)


@register_detector
class NSSDetector(ForestDecision, Detector):
    """Random forest on BRISQUE/MSCN statistics of the images themselves.

    ``fit(x_images, is_abnormal)``; ``score(x_images)`` -> float64 [N] in [0, 1], the fraction of
    trees voting abnormal: HIGHER = MORE ABNORMAL. ``score_features`` takes precomputed
    :func:`nss_features`.
    """

    info = DetectorInfo(
        "nss",
        "NS",
        reads="images",
        summary="random forest on natural-scene statistics (BRISQUE/MSCN) of the image itself",
    )

    def __init__(
        self,
        n_estimators: int = 100,
        random_state: int | None = 0,
        value_range: tuple[float, float] = (0.0, 1.0),
        decision: str = "oob",
        n_jobs: int | None = None,
    ) -> None:
        self.n_estimators = n_estimators
        self.random_state = random_state
        self.value_range = value_range
        self.decision = decision
        self.n_jobs = n_jobs

    def fit(self, x_images: np.ndarray, is_abnormal: np.ndarray) -> NSSDetector:
        """Fit the forest on clean (0) vs abnormal (1) images [N, C, H, W]."""
        return self.fit_features(nss_features(x_images, value_range=self.value_range), is_abnormal)

    def fit_features(
        self, features: np.ndarray, is_abnormal: np.ndarray, groups: np.ndarray | None = None
    ) -> NSSDetector:
        """Fit the forest on precomputed :func:`nss_features` of clean (0) vs abnormal (1)
        images; ``groups``: each row's source image, for the out-of-bag decision's votes."""
        features = check_features(features)
        y = check_binary_labels(is_abnormal, len(features))
        self._check_decision()
        self.forest_ = RandomForestClassifier(
            n_estimators=self.n_estimators, random_state=self.random_state, n_jobs=self.n_jobs
        ).fit(features, y)
        self.n_features_in_ = features.shape[1]
        self._learn_decision(lambda: oob_vote_fraction(self.forest_, features, groups), y)
        return self

    def precompute(self, model: nn.Module, images: np.ndarray) -> dict[str, np.ndarray]:
        """The images' :func:`nss_features`, computed once per image set (the network is unused)."""
        return {NSS_KEY: nss_features(images, value_range=self.value_range)}

    def precompute_keys(self) -> list[str]:
        return [NSS_KEY]

    def _features(self, samples: SampleSet) -> np.ndarray:
        """The samples' precomputed NSS features, or those of their images."""
        if NSS_KEY in samples.extra:
            return samples.extra[NSS_KEY]
        return nss_features(samples.images, value_range=self.value_range)

    def fit_samples(self, clean: SampleSet, abnormal: SampleSet) -> NSSDetector:
        """Fit on the (precomputed) NSS features of clean vs abnormal samples' images."""
        return self.fit_features(
            np.concatenate([self._features(clean), self._features(abnormal)]),
            abnormal_labels(clean, abnormal),
            source_groups(clean, abnormal),
        )

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        """:meth:`score` of the samples' images: HIGHER = MORE ABNORMAL."""
        return self.score_features(self._features(samples))

    def score_features(self, features: np.ndarray) -> np.ndarray:
        """Scores of precomputed :func:`nss_features`: HIGHER = MORE ABNORMAL."""
        check_fitted(self)
        return vote_fraction(self.forest_, check_features(features, self.n_features_in_))

    def score(self, x_images: np.ndarray) -> np.ndarray:
        """Abnormality scores in [0, 1] of images [N, C, H, W]: HIGHER = MORE ABNORMAL."""
        check_fitted(self)
        return self.score_features(nss_features(x_images, value_range=self.value_range))
