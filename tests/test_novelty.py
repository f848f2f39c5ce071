"""The clean-only Gaussian and its ensemble with the forests: the distance is Mahalanobis to the
predicted class, the score its clean CDF, the ensemble an OR of the forests and the far tail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detector.errors import ArtefactError, InputError
from detector.novelty import EnsembleDetector, NoveltyDetector


def _clean(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two classes of 3 features: a positive 'msq'-like column (log-normal) and two cosines."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    msq = np.exp(rng.normal(labels * 1.0, 0.3, n))
    cosines = rng.normal(0, 0.1, (n, 2)) + labels[:, None] * 0.5
    return np.column_stack([msq, cosines]).astype(np.float32), labels


def test_distance_is_mahalanobis_to_the_predicted_class_after_the_log() -> None:
    x, y = _clean()
    detector = NoveltyDetector().fit(x, y)
    arrays = detector.arrays_
    assert arrays["log_columns"].tolist() == [1, 0, 0]  # only the non-negative column
    z = x.astype(np.float64)
    z[:, 0] = np.log(z[:, 0] + arrays["offset"][0])
    z = (z - arrays["mean"]) / arrays["scale"]
    diff = z - arrays["class_means"][y]
    expected = np.einsum("nf,fg,ng->n", diff, arrays["precision"].astype(np.float64), diff)
    with torch.inference_mode():
        got = detector.to_torch().distance(torch.from_numpy(x), torch.from_numpy(y)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # The score is the share of clean fitting samples closer: about uniform on clean data.
    fresh, fresh_y = _clean(seed=1)
    scores = detector.score(fresh, fresh_y)
    assert 0.4 < scores.mean() < 0.6 and scores.min() >= 0 and scores.max() <= 1
    far = fresh.copy()
    far[:, 1:] += 3.0
    assert (detector.score(far, fresh_y) == 1.0).all()  # beyond every clean sample


def test_classes_without_a_mean_use_the_nearest_one() -> None:
    x, y = _clean()
    y = y.copy()
    y[:5] = 7  # a class predicted 5 times: below min_class_samples
    detector = NoveltyDetector(min_class_samples=20).fit(x, y)
    assert detector.arrays_["class_present"].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    scorer = detector.to_torch()
    features = torch.from_numpy(x[:10])
    with torch.inference_mode():
        nearest = scorer.distance(features, None)
        for label in (7, 99, -1):  # absent, outside the table, negative
            labels = torch.full((10,), label)
            assert torch.equal(scorer.distance(features, labels), nearest)


def test_bad_fits_and_artefacts_are_refused() -> None:
    x, y = _clean(n=5)
    with pytest.raises(InputError, match="at least 6 clean samples"):
        NoveltyDetector().fit(x, y)
    x, y = _clean()
    detector = NoveltyDetector().fit(x, y)
    arrays, params = detector.to_arrays()
    broken = {**arrays, "precision": np.eye(2, dtype=np.float32)}
    with pytest.raises(ArtefactError, match="precision"):
        NoveltyDetector.from_arrays(broken, params)
    with pytest.raises(ArtefactError, match="reference"):
        NoveltyDetector.from_arrays({k: v for k, v in arrays.items() if k != "reference"}, params)
    with pytest.raises(InputError, match="fitted on 3 features"):
        detector.score(x[:, :2], y)


def test_ensemble_flags_what_the_forests_flag_or_the_far_tail_of_clean() -> None:
    x, y = _clean(n=800)
    rng = np.random.default_rng(2)
    attacked = x[:400] + np.float32(0.15) * rng.standard_normal((400, 3)).astype(np.float32)
    features = np.concatenate([x, attacked])
    is_abnormal = np.r_[np.zeros(len(x), int), np.ones(400, int)]
    labels = np.r_[y, y[:400]]
    ensemble = EnsembleDetector(n_estimators=15, tail=0.02).fit(features, is_abnormal, labels)
    forests = ensemble.forests_.score(features, labels)
    u = ensemble.novelty_.score(features, labels)
    ramp = np.clip((u - 0.98) / 0.02, 0, 1)
    np.testing.assert_allclose(
        ensemble.score(features, labels), np.maximum(forests, ramp), atol=1e-6
    )
    # Something no attack looked like (far from clean) is flagged by the novelty part alone.
    unseen = x[400:500].copy()
    unseen[:, 1:] -= 4.0
    assert (ensemble.score(unseen, y[400:500]) == 1.0).all()
    # Round trip through arrays: the same scores.
    restored = EnsembleDetector.from_arrays(*ensemble.to_arrays())
    np.testing.assert_array_equal(
        restored.score(features, labels), ensemble.score(features, labels)
    )
    with pytest.raises(InputError, match="tail must be in"):
        EnsembleDetector(tail=1.5).fit(features, is_abnormal, labels)
