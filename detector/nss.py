"""Natural-scene-statistics baseline (Kherchouche et al. 2020; seed 003, appendix E.2.2).

BRISQUE-style statistics of the IMAGE (no network): MSCN coefficients (mean subtracted,
contrast normalized with a 7x7 Gaussian window, sigma 7/6), a generalized Gaussian fit to them
(shape, variance) and asymmetric generalized Gaussian fits to their four pairwise products
(horizontal, vertical, two diagonals: shape, mean, left and right variance): 18 numbers per
scale, at 2 scales (the image and its 2x2 average-pooled half) = 36 features, computed with
numpy/scipy by moment matching. A random forest on them gives the score, the fraction of trees
voting abnormal: HIGHER = MORE ABNORMAL.
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import gaussian_filter
from scipy.special import gammaln
from sklearn.ensemble import RandomForestClassifier
from torch import nn

from detector.base import (
    Detector,
    DetectorInfo,
    ForestDecision,
    SampleSet,
    abnormal_labels,
    check_binary_labels,
    check_fitted,
    oob_vote_fraction,
    source_groups,
    vote_fraction,
)
from detector.features import check_features, check_images
from detector.registry import register_detector

LUMA = np.array([0.299, 0.587, 0.114])
NSS_KEY = "nss"  # the precomputed features' key in ``samples.extra``
_SIGMA = 7.0 / 6.0
_ALPHA = np.arange(0.2, 10.0, 0.001)
# r(a) = G(1/a) G(3/a) / G(2/a)^2, decreasing in a: E[x^2] / E[|x|]^2 of a GGD with shape a.
_R = np.exp(gammaln(1 / _ALPHA) + gammaln(3 / _ALPHA) - 2 * gammaln(2 / _ALPHA))
_TINY = 1e-12


def feature_names() -> list[str]:
    """Names of the 36 columns of :func:`nss_features`."""
    names = []
    for scale in (0, 1):
        names += [f"s{scale}_ggd_shape", f"s{scale}_ggd_var"]
        for pair in ("h", "v", "d1", "d2"):
            names += [f"s{scale}_{pair}_{k}" for k in ("shape", "mean", "left_var", "right_var")]
    return names


def mscn(images: np.ndarray, c: float = 1.0) -> np.ndarray:
    """MSCN coefficients of gray images [N, H, W] on a 0..255 scale."""
    blur = {"sigma": _SIGMA, "truncate": 3.0 / _SIGMA, "mode": "nearest", "axes": (1, 2)}
    mu = gaussian_filter(images, **blur)
    sigma = np.sqrt(np.abs(gaussian_filter(images * images, **blur) - mu * mu))
    return (images - mu) / (sigma + c)


def _shape_from_ratio(ratio: np.ndarray) -> np.ndarray:
    """Invert r(a) = ratio on the grid (linear interpolation, clamped at its ends)."""
    return np.interp(ratio, _R[::-1], _ALPHA[::-1])


def ggd_fit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shape, variance) of a zero-mean generalized Gaussian per row of x [N, P]."""
    variance = np.mean(x * x, axis=1)
    mean_abs = np.mean(np.abs(x), axis=1)
    return _shape_from_ratio(variance / np.maximum(mean_abs**2, _TINY)), variance


def aggd_fit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(shape, mean, left variance, right variance) of an asymmetric GGD per row of x [N, P]."""
    negative, positive = x < 0, x > 0
    left_var = np.sum(np.where(negative, x * x, 0), axis=1) / np.maximum(negative.sum(axis=1), 1)
    right_var = np.sum(np.where(positive, x * x, 0), axis=1) / np.maximum(positive.sum(axis=1), 1)
    left, right = np.sqrt(left_var), np.sqrt(right_var)
    gamma = left / np.maximum(right, _TINY)
    r_hat = np.mean(np.abs(x), axis=1) ** 2 / np.maximum(np.mean(x * x, axis=1), _TINY)
    big_r = r_hat * (gamma**3 + 1) * (gamma + 1) / np.maximum((gamma**2 + 1) ** 2, _TINY)
    # rho(a) = G(2/a)^2 / (G(1/a) G(3/a)) = 1 / r(a), so invert r at 1 / R.
    shape = _shape_from_ratio(1.0 / np.maximum(big_r, _TINY))
    scale = np.exp(0.5 * (gammaln(1 / shape) - gammaln(3 / shape)))
    mean = (right - left) * scale * np.exp(gammaln(2 / shape) - gammaln(1 / shape))
    return shape, mean, left_var, right_var


def _scale_features(gray: np.ndarray) -> np.ndarray:
    coefficients = mscn(gray)
    n = len(gray)
    columns = list(ggd_fit(coefficients.reshape(n, -1)))
    products = (
        coefficients[:, :, :-1] * coefficients[:, :, 1:],  # horizontal
        coefficients[:, :-1, :] * coefficients[:, 1:, :],  # vertical
        coefficients[:, :-1, :-1] * coefficients[:, 1:, 1:],  # main diagonal
        coefficients[:, :-1, 1:] * coefficients[:, 1:, :-1],  # anti-diagonal
    )
    for product in products:
        columns += list(aggd_fit(product.reshape(n, -1)))
    return np.stack(columns, axis=1)


def nss_features(
    images: np.ndarray, *, value_range: tuple[float, float] = (0.0, 1.0), chunk: int = 1024
) -> np.ndarray:
    """36 BRISQUE-style features per image of ``images`` [N, C, H, W] (float32 [N, 36])."""
    images = check_images(images, name="images")
    low, high = value_range
    out = []
    for start in range(0, len(images), chunk):
        x = images[start : start + chunk].astype(np.float64)
        gray = x[:, 0] if x.shape[1] == 1 else np.tensordot(x[:, :3], LUMA, axes=([1], [0]))
        gray = (gray - low) * (255.0 / (high - low))
        h, w = gray.shape[1] // 2 * 2, gray.shape[2] // 2 * 2
        half = gray[:, :h, :w].reshape(len(gray), h // 2, 2, w // 2, 2).mean(axis=(2, 4))
        out.append(np.concatenate([_scale_features(gray), _scale_features(half)], axis=1))
    return np.nan_to_num(np.concatenate(out)).astype(np.float32)


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
