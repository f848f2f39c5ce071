"""The clean-only Gaussian and its ensemble with the forests: the distance is Mahalanobis to the
nearest clean sample or to the predicted class, the score its clean CDF, the ensemble an OR of
the forests and the far tail."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from detector.ensemble import EnsembleDetector
from detector.errors import ArtefactError, InputError
from detector.novelty import NoveltyDetector


def _clean(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two classes of 3 features: a positive 'msq'-like column (log-normal) and two cosines."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    msq = np.exp(rng.normal(labels * 1.0, 0.3, n))
    cosines = rng.normal(0, 0.1, (n, 2)) + labels[:, None] * 0.5
    return np.column_stack([msq, cosines]).astype(np.float32), labels


def test_distance_is_mahalanobis_to_the_predicted_class_after_the_log() -> None:
    x, y = _clean()
    detector = NoveltyDetector(distance="class-mean").fit(x, y)
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
    detector = NoveltyDetector(min_class_samples=20, distance="class-mean").fit(x, y)
    assert detector.arrays_["class_present"].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    scorer = detector.to_torch()
    features = torch.from_numpy(x[:10])
    with torch.inference_mode():
        nearest = scorer.distance(features, None)
        for label in (7, 99, -1):  # absent, outside the table, negative
            labels = torch.full((10,), label)
            assert torch.equal(scorer.distance(features, labels), nearest)


def test_too_few_samples_per_class_share_one_pooled_gaussian() -> None:
    x, y = _clean(n=30)  # two classes: neither reaches min_class_samples=30
    detector = NoveltyDetector(min_class_samples=30, distance="class-mean").fit(x, y)
    arrays = detector.arrays_
    assert arrays["class_present"].tolist() == [1, 1]
    np.testing.assert_array_equal(arrays["class_means"], 0.0)  # the pooled mean, standardized
    # Every label scores as the pooled Gaussian; far inputs lie beyond every clean sample.
    np.testing.assert_array_equal(detector.score(x, y), detector.score(x, 1 - y))
    assert (detector.score(x + np.float32(5.0), y) == 1.0).all()


def _standardized(detector: NoveltyDetector, x: np.ndarray) -> np.ndarray:
    arrays = detector.arrays_
    z = x.astype(np.float64)
    z[:, 0] = np.log(z[:, 0] + arrays["offset"][0])
    return (z - arrays["mean"]) / arrays["scale"]


def test_nearest_distance_is_mahalanobis_to_the_nearest_clean_sample() -> None:
    x, y = _clean()
    detector = NoveltyDetector().fit(x, y)  # distance="nearest" is the default
    precision = detector.arrays_["precision"].astype(np.float64)
    z = _standardized(detector, x)
    fresh, fresh_y = _clean(n=50, seed=1)
    diff = _standardized(detector, fresh)[:, None, :] - z[None]  # [50, 600, F]
    expected = np.einsum("nmf,fg,nmg->nm", diff, precision, diff).min(axis=1)
    with torch.inference_mode():
        got = detector.to_torch().distance(torch.from_numpy(fresh), None).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
    # The clean CDF is of each fitting sample's distance to its nearest OTHER sample, so fresh
    # clean data scores about uniform; the predicted label plays no part.
    scores = detector.score(*_clean(seed=2))
    assert 0.35 < scores.mean() < 0.65 and scores.min() >= 0.0 and scores.max() <= 1.0
    np.testing.assert_array_equal(
        detector.score(fresh, fresh_y), detector.score(fresh, 1 - fresh_y)
    )
    restored = NoveltyDetector.from_arrays(*detector.to_arrays())
    np.testing.assert_array_equal(restored.score(fresh, fresh_y), detector.score(fresh, fresh_y))


def test_the_nearest_distance_sees_a_gap_that_the_class_mean_fills() -> None:
    """A class made of two clusters: its mean lies in the empty gap between them. Inputs there
    are typical for the class-mean distance and beyond every clean sample for the nearest one."""
    rng = np.random.default_rng(3)
    n = 600
    side = rng.choice([-0.5, 0.5], n)
    x = np.column_stack(
        [np.exp(rng.normal(0, 0.3, n)), side + rng.normal(0, 0.03, n), rng.normal(0, 0.03, n)]
    ).astype(np.float32)
    y = np.zeros(n, int)
    gap = np.column_stack([np.ones(20), np.zeros((20, 2))]).astype(np.float32)
    labels = np.zeros(20, int)
    assert (NoveltyDetector().fit(x, y).score(gap, labels) > 0.98).all()
    assert (NoveltyDetector(distance="class-mean").fit(x, y).score(gap, labels) < 0.2).all()


def test_distances_and_their_arrays_must_agree() -> None:
    x, y = _clean()
    with pytest.raises(InputError, match="distance must be one of"):
        NoveltyDetector(distance="cosine").fit(x, y)
    nearest = NoveltyDetector().fit(x, y)
    arrays, params = nearest.to_arrays()
    with pytest.raises(ArtefactError, match="do not match distance='class-mean'"):
        NoveltyDetector.from_arrays(arrays, {**params, "distance": "class-mean"})
    with pytest.raises(ArtefactError, match="travel together"):
        NoveltyDetector.from_arrays({k: v for k, v in arrays.items() if k != "whiten"}, params)
    with pytest.raises(ArtefactError, match="'points'"):
        NoveltyDetector.from_arrays({**arrays, "points": arrays["points"][:, :2]}, params)
    # A detector saved before the nearest distance (no "distance" param) loads as class-mean.
    old_arrays, old_params = NoveltyDetector(distance="class-mean").fit(x, y).to_arrays()
    del old_params["distance"]
    assert NoveltyDetector.from_arrays(old_arrays, old_params).distance == "class-mean"


def test_nearest_distance_never_reads_a_point_of_the_querys_own_group() -> None:
    """Against brute force: groups of several points, queries over more than one 1,024-row block."""
    from detector.nearest import nearest_distance

    rng = np.random.default_rng(5)
    points = rng.normal(size=(300, 4)).astype(np.float32)
    queries = np.concatenate([points, rng.normal(size=(1900, 4)).astype(np.float32)])
    point_groups = rng.integers(0, 60, len(points))  # about 5 points per group
    query_groups = np.concatenate([point_groups, rng.integers(0, 90, 1900)])  # some groups new
    squared = ((queries[:, None, :].astype(np.float64) - points[None]) ** 2).sum(axis=2)
    squared[query_groups[:, None] == point_groups[None, :]] = np.inf
    got = nearest_distance(
        torch.from_numpy(queries),
        torch.from_numpy(points),
        groups=(torch.from_numpy(query_groups), torch.from_numpy(point_groups)),
    )
    np.testing.assert_allclose(got.numpy(), squared.min(axis=1), rtol=1e-4)
    assert (got[:300] > 0).all()  # a fitting point never finds itself, nor its group's others
    with pytest.raises(InputError, match="one id per query row"):
        nearest_distance(
            torch.from_numpy(queries),
            torch.from_numpy(points),
            groups=(torch.from_numpy(query_groups[:10]), torch.from_numpy(point_groups)),
        )


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
    # Labels or groups of another length are refused by name, before anything is fitted.
    with pytest.raises(InputError, match="is_abnormal must have shape"):
        EnsembleDetector(n_estimators=5).fit(features, is_abnormal[:-1], labels)
    with pytest.raises(InputError, match="groups must have shape"):
        EnsembleDetector(n_estimators=5).fit(features, is_abnormal, labels, groups=labels[:-1])


def _assert_scores_travel(
    ensemble: EnsembleDetector, features: np.ndarray, labels: np.ndarray
) -> EnsembleDetector:
    """The arrays, the torch form and a loaded copy all score alike; returns the loaded copy."""
    restored = EnsembleDetector.from_arrays(*ensemble.to_arrays())
    expected = ensemble.score(features, labels).astype(np.float32)
    np.testing.assert_array_equal(restored.score(features, labels).astype(np.float32), expected)
    with torch.inference_mode():
        torch_scores = ensemble.to_torch()(torch.from_numpy(features), torch.from_numpy(labels))
    np.testing.assert_allclose(torch_scores.numpy(), expected, atol=1e-6)
    return restored


def test_family_forests_join_the_ensemble_and_travel_with_it() -> None:
    x, y = _clean(n=900)
    rng = np.random.default_rng(3)
    large = x[:500] + np.float32(0.6)  # a large, easy family
    subtle = x[500:560].copy()
    subtle[:, 1] += np.float32(0.12) * rng.standard_normal(60).astype(np.float32)
    features = np.concatenate([x, large, subtle])
    is_abnormal = np.r_[np.zeros(len(x), int), np.ones(560, int)]
    labels = np.r_[y, y[:560]]
    families = np.r_[np.full(len(x), ""), np.full(500, "large"), np.full(60, "subtle")]
    ensemble = EnsembleDetector(n_estimators=15, tail=0.05).fit(
        features, is_abnormal, labels, families
    )
    assert ensemble.family_names_ == ["large", "subtle"] and len(ensemble.families_) == 2
    parts = [ensemble.forests_.score(features, labels)]
    parts += [f.score(features, labels) for f in ensemble.families_]
    ramp = np.clip((ensemble.novelty_.score(features, labels) - 0.95) / 0.05, 0, 1)
    np.testing.assert_allclose(
        ensemble.score(features, labels), np.max([*parts, ramp], axis=0), atol=1e-6
    )
    # The subtle family's own forests were fitted on its 60 rows vs 4 clean rows per row; the
    # large family's on its 500 rows vs every one of the 900 clean rows (fewer than 4 x 500).
    root_weight = ensemble.families_[1].forest_.estimators_[0].tree_.weighted_n_node_samples[0]
    assert root_weight == 300  # a bootstrap sample of 60 + 240 rows
    large_root = ensemble.families_[0].forest_.estimators_[0].tree_.weighted_n_node_samples[0]
    assert large_root == 1400
    # The torch form names each part's score (which part flags an input); its max is the score.
    with torch.inference_mode():
        named = ensemble.to_torch().parts(torch.from_numpy(features), torch.from_numpy(labels))
    assert list(named) == ["forests", "family large", "family subtle", "novelty"]
    for expected, score in zip([*parts, ramp], named.values(), strict=True):
        np.testing.assert_allclose(score.numpy(), expected, atol=1e-6)
    # The arrays, the torch form and a loaded copy all score alike.
    restored = _assert_scores_travel(ensemble, features, labels)
    assert restored.family_names_ == ["large", "subtle"]
    assert list(restored.to_torch().parts(torch.from_numpy(features[:3]))) == list(named)
    # One family, no family forests; family_forests=False never fits them.
    one = EnsembleDetector(n_estimators=5).fit(
        features, is_abnormal, labels, np.where(is_abnormal == 1, "large", "")
    )
    off = EnsembleDetector(n_estimators=5, family_forests=False)
    assert one.families_ == [] and off.fit(features, is_abnormal, labels, families).families_ == []
    with pytest.raises(InputError, match="families must have shape"):
        EnsembleDetector(n_estimators=5).fit(features, is_abnormal, labels, families[:10])
    with pytest.raises(InputError, match="family_clean_ratio must be > 0"):
        EnsembleDetector(n_estimators=5, family_clean_ratio=0).fit(features, is_abnormal, labels)


@dataclass
class Rows:
    """A sample set whose last feature column is the logit margin (the margin part reads it)."""

    features: np.ndarray
    predicted: np.ndarray
    feature_names: tuple[str, ...] = ("msq_0", "cos_0", "head_margin")
    images: np.ndarray = field(default_factory=lambda: np.zeros((0, 1, 1, 1)))
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.features)


def test_the_margin_part_flags_inputs_on_the_decision_boundary() -> None:
    x, y = _clean(n=1000)
    x[:, 2] = np.abs(x[:, 2]) + 1.0  # clean margins >= 1
    attacked = x[:300].copy()
    attacked[:, 0] *= 1.5
    ensemble = EnsembleDetector(n_estimators=10, margin_tail=0.02).fit_samples(
        Rows(x, y), Rows(attacked, y[:300])
    )
    assert ensemble.margin_column_ == 2
    boundary = x[300:400].copy()
    boundary[:, 2] = 0.01  # below every clean margin: u = 1, the ramp gives 1
    assert (ensemble.score(boundary, y[300:400]) == 1.0).all()
    features = np.concatenate([x, attacked, boundary])
    _assert_scores_travel(ensemble, features, np.r_[y, y[:300], y[300:400]])
    # Without the margin column among the features, or with margin_tail 0, no margin part.
    unnamed = EnsembleDetector(n_estimators=5).fit(
        np.concatenate([x, attacked]),
        np.r_[np.zeros(1000), np.ones(300)].astype(int),
        np.r_[y, y[:300]],
    )
    off = EnsembleDetector(n_estimators=5, margin_tail=0.0).fit_samples(
        Rows(x, y), Rows(attacked, y[:300])
    )
    assert unnamed.margin_column_ is None and off.margin_column_ is None


def test_the_clean_only_parts_learn_from_the_clean_reference_the_forests_from_the_rows() -> None:
    """With ``clean_reference`` (a paired protocol's every clean training image) the forests
    are those fitted on the attack's sources alone, the clean-only parts those fitted on the
    reference: a clean image whose margin no source had is no longer flagged for it."""
    from detector.margin import margin_arrays

    x, y = _clean(n=1200)
    x[:, 2] = np.abs(x[:, 2]) * 4 + 0.05  # clean margins, some of them low
    sources = np.flatnonzero(x[:, 2] > 0.2)[:400]  # an attack's sources: no low margin
    attacked = x[sources].copy()
    attacked[:, 0] *= 1.5
    pairs = (Rows(x[sources], y[sources]), Rows(attacked, y[sources]))
    alone = EnsembleDetector(n_estimators=10, min_class_samples=5).fit_samples(*pairs)
    everything = EnsembleDetector(n_estimators=10, min_class_samples=5).fit_samples(
        *pairs, clean_reference=Rows(x, y)
    )
    low = x[:, 2] < 0.1
    assert low.sum() > 10
    np.testing.assert_array_equal(everything.forests_.score(x, y), alone.forests_.score(x, y))
    novelty = NoveltyDetector(min_class_samples=5).fit(x, y)
    for key, value in novelty.arrays_.items():
        np.testing.assert_array_equal(everything.novelty_.arrays_[key], value)
    for key, value in margin_arrays(x[:, 2], y, 5).items():
        np.testing.assert_array_equal(everything.margin_[key], value)
    rows, labels = torch.from_numpy(x[low]), torch.from_numpy(y[low])
    with torch.inference_mode():
        margin_alone = alone.to_torch().parts(rows, labels)["margin"]
        margin_everything = everything.to_torch().parts(rows, labels)["margin"]
    assert (margin_alone == 1.0).all() and (margin_everything < 1.0).float().mean() > 0.5
    _assert_scores_travel(everything, x, y)
    # A bad reference is refused by name before anything is fitted: a fitted detector refitted
    # with one keeps every part it had.
    before = everything.score(x, y)
    grouped = Rows(x, y)
    grouped.indices = np.arange(len(x))  # type: ignore[attr-defined]
    refused = {
        "clean-only parts need clean rows of 3 columns": Rows(x[:, :2], y),
        "feature columns differ": Rows(x, y, ("msq_0", "head_margin", "cos_0")),
        "groups and the rows' must both be given": grouped,
    }
    fewer = (Rows(x[sources[:200]], y[sources[:200]]), Rows(attacked[:200], y[sources[:200]]))
    for message, reference in refused.items():
        with pytest.raises(InputError, match=message):
            everything.fit_samples(*fewer, clean_reference=reference)
        np.testing.assert_array_equal(everything.score(x, y), before)
    # Clean-only parts fitted on the same reference are reused as they are, and only then.
    params = {"n_estimators": 10, "min_class_samples": 5}
    refitted = EnsembleDetector(**params).fit_samples(*fewer, clean_reference=Rows(x, y))
    reused = EnsembleDetector(**params).fit_samples(
        *fewer, clean_reference=Rows(x, y), clean_parts=everything
    )
    assert reused.novelty_ is everything.novelty_ and reused.margin_ is everything.margin_
    np.testing.assert_array_equal(reused.score(x, y), refitted.score(x, y))
    with pytest.raises(InputError, match="fitted with other parameters"):
        EnsembleDetector(**params, tail=0.05).fit_samples(
            *fewer, clean_reference=Rows(x, y), clean_parts=everything
        )
    with pytest.raises(InputError, match="fitted on other clean rows"):
        EnsembleDetector(**params).fit_samples(
            *fewer, clean_reference=Rows(x[:600], y[:600]), clean_parts=everything
        )


def test_held_out_scores_give_fitting_clean_rows_the_scores_of_new_clean_rows() -> None:
    """A fitted ensemble's own clean rows score low (its trees drew them, each is its own nearest
    clean row); scored by what never saw their source (out-of-bag trees, the nearest clean row of
    another source) they are flagged about as often as new clean rows, so a threshold can be
    calibrated on them. Rows of a source it never saw get :meth:`score` itself."""
    from types import SimpleNamespace

    def rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = _clean(n, seed)
        embedding = np.random.default_rng(seed + 50).normal(size=(n, 2)).astype(np.float32)
        return np.concatenate([x, embedding], axis=1), y

    x, y = rows(1500, 0)
    rng = np.random.default_rng(4)
    large = x[:500] + np.float32(0.6) * np.r_[np.ones(3), np.zeros(2)].astype(np.float32)
    subtle = x[500:700].copy()
    subtle[:, 1] += np.float32(0.1) * rng.standard_normal(200).astype(np.float32)
    features = np.concatenate([x, large, subtle])
    is_abnormal = np.r_[np.zeros(1500, int), np.ones(700, int)]
    labels = np.r_[y, y[:700]]
    families = np.r_[np.full(1500, ""), np.full(500, "large"), np.full(200, "subtle")]
    groups = np.r_[np.arange(1500), np.arange(700)]  # each attacked row shares its source's id
    ensemble = EnsembleDetector(n_estimators=40, tail=0.05, penultimate_tail=0.05).fit(
        features, is_abnormal, labels, families, penultimate_columns=2, groups=groups
    )
    fresh, fresh_labels = rows(3000, 1)
    new_groups = np.arange(10_000, 13_000)
    held_fresh, trees = ensemble.held_out_scores(fresh, fresh_labels, new_groups)
    np.testing.assert_array_equal(held_fresh, ensemble.score(fresh, fresh_labels))
    assert (trees == 40).all()
    threshold = np.quantile(held_fresh, 0.9)
    in_sample = ensemble.score(x, y)
    held_out, trees = ensemble.held_out_scores(x, y, np.arange(1500))
    voted = trees >= 5
    assert voted.mean() > 0.5  # rows with an attacked twin: ~e^-2 of the trees
    assert np.mean(in_sample > threshold) < 0.04
    assert 0.06 < np.mean(held_out[voted] > threshold) < 0.14
    # The sample-set form: NaN where a forest had too few such trees; it needs the sources.
    samples = SimpleNamespace(
        features=x[:, :3], predicted=y, extra={"penultimate": x[:, 3:]}, indices=np.arange(1500)
    )
    scores = ensemble.score_held_out(samples)
    assert scores is not None
    np.testing.assert_array_equal(np.isnan(scores), trees < 10)
    with pytest.raises(InputError, match="source image"):
        ensemble.score_held_out(SimpleNamespace(features=x[:, :3], predicted=y, extra={}))
    assert NoveltyDetector().fit(x[:, :3], y).score_held_out(samples) is None
    with pytest.raises(InputError, match="as fitted"):
        EnsembleDetector.from_arrays(*ensemble.to_arrays()).held_out_scores(x, y, groups[:1500])
