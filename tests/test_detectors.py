"""Detectors: score direction (higher = more abnormal), tensor forms equal to sklearn, width refusal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from detector.base import source_groups
from detector.ensemble import EnsembleDetector
from detector.errors import ArtefactError, InputError, NotFittedError
from detector.features import extract_features
from detector.forest import TensorForest, TransportDetector, forest_arrays
from detector.mahalanobis import MahalanobisDetector, mahalanobis_features
from detector.metrics import auroc, balanced_threshold
from detector.networks import get_model
from detector.nss import NSSDetector, nss_features
from detector.quantile import QuantileDetector
from detector.voting import oob_vote_fraction

WIDTH_ERROR = "fitted on 6 features, got 8: this detector belongs to another network"


def _separated(n: int, seed: int, shift: float = 2.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clean features N(0, 1), abnormal ones shifted in two of 6 columns; predicted labels 0..3."""
    rng = np.random.default_rng(seed)
    y = np.r_[np.zeros(n), np.ones(n)].astype(int)
    x = rng.normal(size=(2 * n, 6)).astype(np.float32)
    x[y == 1, :2] += shift
    return x, y, rng.integers(0, 4, 2 * n)


def test_transport_detector_scores_abnormal_higher() -> None:
    x, y, predicted = _separated(200, 0)
    detector = TransportDetector(n_estimators=30, min_class_samples=20).fit(x, y, predicted)
    xt, yt, pt = _separated(200, 1)
    scores = detector.score(xt, pt)
    assert scores.min() >= 0 and scores.max() <= 1
    assert scores[yt == 1].mean() > scores[yt == 0].mean() + 0.5
    assert auroc(yt, scores) > 0.95
    np.testing.assert_array_equal(detector.predict(xt, pt), scores > detector.decision_threshold())


def test_votes_are_the_general_and_own_class_forests_and_score_is_their_max() -> None:
    x, y, predicted = _separated(100, 2)
    predicted[(predicted == 3) & (y == 1)] = 0  # class 3 gets no forest of its own
    detector = TransportDetector(n_estimators=9, min_class_samples=10).fit(x, y, predicted)
    xt, _, pt = _separated(100, 3)
    general, own = detector.votes(xt, pt)
    # Fully grown trees have pure leaves: their mean probability is the share of trees voting.
    np.testing.assert_array_equal(general, detector.forest_.predict_proba(xt)[:, 1])
    for label, forest in detector.class_forests_.items():
        rows = pt == label
        np.testing.assert_array_equal(own[rows], forest.predict_proba(xt[rows])[:, 1])
    np.testing.assert_array_equal(own[pt == 3], general[pt == 3])
    np.testing.assert_array_equal(detector.score(xt, pt), np.maximum(general, own))
    arrays, params = detector.to_arrays()
    with pytest.raises(InputError, match="loaded from arrays"):
        TransportDetector.from_arrays(arrays, params).votes(xt, pt)


def test_oob_votes_equal_sklearns_out_of_bag_estimate() -> None:
    from sklearn.ensemble import RandomForestClassifier

    x, y, _ = _separated(150, 4, shift=0.7)
    forest = RandomForestClassifier(n_estimators=40, oob_score=True, random_state=1).fit(x, y)
    # Fully grown trees have pure leaves: sklearn's mean out-of-bag probability is the vote share.
    np.testing.assert_allclose(oob_vote_fraction(forest, x), forest.oob_decision_function_[:, 1])
    no_bag = RandomForestClassifier(n_estimators=3, bootstrap=False).fit(x, y)
    assert np.isnan(oob_vote_fraction(no_bag, x)).all()


def test_grouped_oob_votes_leave_a_rows_twin_out_of_the_bag_too() -> None:
    from sklearn.ensemble import RandomForestClassifier

    rng = np.random.default_rng(8)
    source = rng.normal(size=(300, 4)).astype(np.float32)
    attacked = source + np.float32(0.3) * (rng.random((300, 4)) > 0.5)  # near twins, weak signal
    x, y = np.concatenate([source, attacked]), np.r_[np.zeros(300), np.ones(300)].astype(int)
    groups = np.r_[np.arange(300), np.arange(300)]
    forest = RandomForestClassifier(n_estimators=60, random_state=0).fit(x, y)
    plain, grouped = oob_vote_fraction(forest, x), oob_vote_fraction(forest, x, groups)
    # A tree that drew a row's twin votes that row the twin's label: plain votes understate it.
    assert auroc(y, plain) < 0.5 < auroc(y[~np.isnan(grouped)], grouped[~np.isnan(grouped)])
    assert np.isnan(grouped).mean() < 0.01  # ~13% of 60 trees miss both twins
    assert np.isnan(oob_vote_fraction(forest, x, np.zeros(600))).all()  # one group: every bag
    with pytest.raises(InputError, match="groups must have shape"):
        oob_vote_fraction(forest, x, groups[:10])


def test_held_out_votes_count_only_trees_that_never_drew_a_rows_group() -> None:
    from sklearn.ensemble import RandomForestClassifier

    from detector.voting import held_out_votes, vote_fraction

    x, y, _ = _separated(100, 5, shift=0.8)
    groups = np.r_[np.arange(100), np.arange(100)]  # each abnormal row is a clean row's twin
    forest = RandomForestClassifier(n_estimators=30, random_state=2).fit(x, y)
    # The fitting rows themselves: their grouped out-of-bag votes, counted tree by tree.
    fraction, counts = held_out_votes(forest, x, groups, groups)
    drew = np.array([np.isin(groups, groups[s]) for s in forest.estimators_samples_])  # [T, N]
    votes = np.array([tree.predict(x) for tree in forest.estimators_])  # [T, N]
    expected_counts = (~drew).sum(axis=0)
    with np.errstate(invalid="ignore"):
        expected = np.where(~drew, votes, 0).sum(axis=0) / expected_counts
    np.testing.assert_array_equal(counts, expected_counts)
    np.testing.assert_allclose(fraction, expected, equal_nan=True)
    assert expected_counts.max() < 30 and (expected_counts > 0).mean() > 0.9  # some, not all
    assert np.isnan(fraction[expected_counts == 0]).all()  # no tree left: no vote
    np.testing.assert_array_equal(fraction, oob_vote_fraction(forest, x, groups))
    # New rows of a group the forest never saw: every tree votes, as vote_fraction.
    fresh, _, _ = _separated(50, 6)
    fraction, counts = held_out_votes(forest, fresh, np.arange(1000, 1100), groups)
    np.testing.assert_array_equal(fraction, vote_fraction(forest, fresh))
    assert (counts == 30).all()
    # A new row of a fitting group (another image of the same source): only the trees that drew
    # none of the group's fitting rows vote on it.
    row, group = fresh[:1], np.array([7])
    out = [
        i for i, drawn in enumerate(forest.estimators_samples_) if not (groups[drawn] == 7).any()
    ]
    fraction, counts = held_out_votes(forest, row, group, groups)
    expected = np.mean([forest.estimators_[i].predict(row)[0] for i in out]) if out else np.nan
    assert counts[0] == len(out) < 30 and np.allclose(fraction[0], expected, equal_nan=True)
    with pytest.raises(InputError, match="fitted_groups must name"):
        held_out_votes(forest, row, group, groups[:10])


def test_fit_samples_groups_each_attacked_image_with_its_source() -> None:
    from types import SimpleNamespace

    from training.evaluation.protocols import Samples

    x, y, predicted = _separated(150, 9, shift=0.9)
    source = np.r_[np.arange(150), np.arange(150)]  # row i and row 150 + i: one source image

    def rows(part: np.ndarray) -> Samples:
        images = np.zeros((len(part), 1, 2, 2), np.float32)
        return Samples("set", images, x[part], predicted[part], source[part])

    clean, abnormal = rows(np.arange(150)), rows(np.arange(150, 300))
    np.testing.assert_array_equal(source_groups(clean, abnormal), source)
    unnamed = SimpleNamespace(features=x[:150], predicted=predicted[:150], extra={})
    assert source_groups(unnamed, abnormal) is None  # type: ignore[arg-type]
    params = {"n_estimators": 30, "min_class_samples": 10}
    via_samples = TransportDetector(**params).fit_samples(clean, abnormal)
    grouped = TransportDetector(**params).fit(x, y, predicted, source)
    ungrouped = TransportDetector(**params).fit(x, y, predicted)
    assert via_samples.decision_threshold() == grouped.decision_threshold()
    assert grouped.decision_threshold() != ungrouped.decision_threshold()
    ensemble = EnsembleDetector(**params, penultimate_tail=0).fit_samples(clean, abnormal)
    assert ensemble.forests_.decision_threshold() == grouped.decision_threshold()
    # Its clean fitting images scored by the trees that drew neither them nor their twins: the
    # grouped out-of-bag score (as its decision reads it), NaN where fewer than 10 trees did.
    hundred = TransportDetector(n_estimators=100, min_class_samples=10).fit_samples(clean, abnormal)
    general = oob_vote_fraction(hundred.forest_, x, source)
    own = general.copy()
    for label, forest in hundred.class_forests_.items():
        rows_of = predicted == label
        own[rows_of] = oob_vote_fraction(forest, x[rows_of], source[rows_of])
    held_out = hundred.score_held_out(clean)
    assert held_out is not None
    _, trees = hundred.held_out_scores(x[:150], predicted[:150], source[:150])
    expected = np.where(trees >= 10, np.fmax(general, own)[:150], np.nan)
    np.testing.assert_array_equal(held_out, expected)
    assert 0.05 < np.isnan(held_out).mean() < 0.8  # ~100 x e^-2 trees each: some fewer than 10
    with pytest.raises(InputError, match="as fitted"):
        TransportDetector.from_arrays(*grouped.to_arrays()).score_held_out(clean)
    with pytest.raises(InputError, match="without each row's source image"):
        ungrouped.score_held_out(clean)  # its groups are row positions, not the indices


def test_transport_decision_is_the_out_of_bag_balanced_point() -> None:
    x, y, predicted = _separated(300, 5, shift=0.9)  # overlapping: the point is not trivial
    oob = TransportDetector(n_estimators=40, min_class_samples=20).fit(x, y, predicted)
    general = oob_vote_fraction(oob.forest_, x)
    own = general.copy()
    for label, forest in oob.class_forests_.items():
        own[predicted == label] = oob_vote_fraction(forest, x[predicted == label])
    expected = balanced_threshold(y, np.fmax(general, own))
    assert oob.decision_threshold() == expected != 0.5
    majority = TransportDetector(n_estimators=40, min_class_samples=20, decision="majority")
    majority.fit(x, y, predicted)
    assert majority.decision_threshold() == 0.5
    np.testing.assert_array_equal(majority.score(x, predicted), oob.score(x, predicted))
    np.testing.assert_array_equal(oob.predict(x, predicted), oob.score(x, predicted) > expected)
    with pytest.raises(InputError, match="decision must be one of"):
        TransportDetector(decision="mean").fit(x, y, predicted)


def test_nss_decision_is_its_forests_out_of_bag_balanced_point() -> None:
    x, y, _ = _separated(300, 7, shift=0.9)
    detector = NSSDetector(n_estimators=40).fit_features(x, y)
    expected = balanced_threshold(y, oob_vote_fraction(detector.forest_, x))
    assert detector.decision_threshold() == expected
    with pytest.raises(InputError, match="decision must be one of"):
        NSSDetector(decision="vote").fit_features(x, y)
    with pytest.raises(NotFittedError):
        NSSDetector().decision_threshold()


def test_transport_decision_travels_with_its_arrays(tmp_path: Path) -> None:
    x, y, predicted = _separated(150, 6, shift=0.9)
    detector = TransportDetector(n_estimators=10, min_class_samples=10).fit(x, y, predicted)
    arrays, params = detector.to_arrays()
    loaded = TransportDetector.from_arrays(arrays, params)
    assert loaded.decision_threshold() == detector.decision_threshold()
    np.testing.assert_array_equal(loaded.predict(x, predicted), detector.predict(x, predicted))
    legacy = {k: v for k, v in params.items() if k not in ("threshold", "decision")}
    assert TransportDetector.from_arrays(arrays, legacy).decision_threshold() == 0.5
    with pytest.raises(ArtefactError, match="threshold must be in"):
        TransportDetector.from_arrays(arrays, {**params, "threshold": float("nan")})


def test_class_forests_only_where_both_labels_are_common_enough() -> None:
    x, y, predicted = _separated(100, 2)
    predicted[(predicted == 3) & (y == 1)] = 0  # class 3 has no abnormal samples
    detector = TransportDetector(n_estimators=5, min_class_samples=10).fit(x, y, predicted)
    assert sorted(detector.class_forests_) == [0, 1, 2]
    assert (
        list(
            TransportDetector(n_estimators=5, class_conditional=False)
            .fit(x, y, predicted)
            .class_forests_
        )
        == []
    )


@pytest.mark.parametrize("max_depth", [None, 3])
def test_tensor_forest_equals_sklearn(max_depth: int | None) -> None:
    x, y, predicted = _separated(150, 3, shift=0.8)
    detector = TransportDetector(n_estimators=25, max_depth=max_depth, min_class_samples=10).fit(
        x, y, predicted
    )
    xt, _, _ = _separated(100, 4, shift=0.8)
    # Include values exactly on split thresholds, and labels without a class forest.
    arrays = detector.arrays_
    internal = np.flatnonzero(np.isfinite(arrays["threshold"]))[:40]
    for row, node in enumerate(internal):
        xt[row, arrays["feature"][node]] = np.float32(arrays["threshold"][node])
    pt = np.random.default_rng(5).integers(-1, 7, len(xt))
    expected = detector.score(xt, pt)
    module = detector.to_torch()
    with torch.inference_mode():
        got = module(torch.from_numpy(xt), torch.from_numpy(pt)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-6)
    # One forest alone: fraction of trees voting abnormal, as sklearn's trees vote.
    forest = TensorForest(forest_arrays([detector.forest_]), 6)
    votes = np.mean([t.predict(xt) for t in detector.forest_.estimators_], axis=0)
    np.testing.assert_allclose(forest.fraction(torch.from_numpy(xt)).numpy(), votes, atol=1e-6)
    restored = TransportDetector.from_arrays(*detector.to_arrays())
    np.testing.assert_allclose(restored.score(xt, pt), expected, atol=1e-6)


def test_detectors_refuse_another_width_and_unfitted_use() -> None:
    x, y, predicted = _separated(60, 6)
    wide = np.zeros((3, 8), np.float32)
    transport = TransportDetector(n_estimators=3).fit(x, y, predicted)
    quantile = QuantileDetector().fit(x)
    with pytest.raises(InputError, match=WIDTH_ERROR):
        transport.score(wide, np.zeros(3, int))
    with pytest.raises(InputError, match=WIDTH_ERROR):
        quantile.score(wide)
    with pytest.raises(InputError, match="fitted on 6 features"):
        transport.to_torch()(torch.from_numpy(wide), torch.zeros(3, dtype=torch.long))
    with pytest.raises(NotFittedError):
        TransportDetector().score(x, predicted)
    with pytest.raises(InputError, match="both clean"):
        TransportDetector().fit(x, np.zeros(len(x), int), predicted)
    # groups of another length: refused at fit, even where the decision never reads them
    with pytest.raises(InputError, match="groups must have shape"):
        TransportDetector(n_estimators=3, decision="majority").fit(
            x, y, predicted, np.arange(len(x) + 5)
        )


@pytest.mark.parametrize("feature", ["transport_cost", "all"])
def test_quantile_detector_direction_fpr_and_tensor_form(feature: str) -> None:
    rng = np.random.default_rng(7)
    clean = np.abs(rng.normal(size=(4000, 6))).astype(np.float32)
    abnormal = clean[:500] * 4.0
    detector = QuantileDetector(feature=feature, fpr=0.1).fit(clean[:2000])
    clean_scores, abnormal_scores = detector.score(clean[2000:]), detector.score(abnormal)
    assert abnormal_scores.mean() > clean_scores.mean()
    assert auroc(np.r_[np.zeros(2000), np.ones(500)], np.r_[clean_scores, abnormal_scores]) > 0.9
    assert np.mean(clean_scores > 0) <= 0.1 + 0.04  # the band alone flags about fpr of clean data
    with torch.inference_mode():
        np.testing.assert_allclose(
            detector.to_torch()(torch.from_numpy(abnormal)).numpy(), abnormal_scores, atol=1e-6
        )
    np.testing.assert_allclose(
        QuantileDetector.from_arrays(*detector.to_arrays()).score(abnormal), abnormal_scores
    )


def test_quantile_detector_uses_only_clean_rows_and_named_cost_columns() -> None:
    x, y, _ = _separated(100, 8)
    names = ["msq_0", "cos_0", "msq_1", "cos_1", "cos_0_dir1", "line_shape"]
    detector = QuantileDetector().fit(x, y, feature_names=names)
    np.testing.assert_array_equal(detector.columns_, [0, 2])
    assert detector.low_[0] == pytest.approx(
        np.quantile(x[y == 0][:, [0, 2]].sum(1), 0.025), rel=1e-5
    )


def _fashion_images(root: Path, n: int) -> np.ndarray:
    raw = root / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte"
    if not raw.is_file():
        pytest.skip(f"Fashion-MNIST is not laid out under {root}")
    pixels = np.fromfile(raw, dtype=np.uint8, offset=16, count=n * 28 * 28)
    return (pixels.reshape(n, 1, 28, 28) / 255.0).astype(np.float32)


def test_nss_detector_scores_noise_higher_than_real_images(data_root: Path) -> None:
    real = _fashion_images(data_root, 240)
    noise = np.random.default_rng(9).random((240, 1, 28, 28), dtype=np.float32)
    features = nss_features(real[:4])
    assert features.shape == (4, 36) and np.isfinite(features).all()
    y = np.r_[np.zeros(120), np.ones(120)].astype(int)
    detector = NSSDetector(n_estimators=20).fit(np.concatenate([real[:120], noise[:120]]), y)
    scores = detector.score(np.concatenate([real[120:], noise[120:]]))
    assert scores[120:].mean() > scores[:120].mean() + 0.5
    with pytest.raises(InputError, match="fitted on 36 features, got 8"):
        detector.score_features(np.zeros((2, 8), np.float32))
    # Precomputed once per image set (the pipeline's cache), the same fit and the same scores.
    from training.evaluation.protocols import Samples

    def rows(images: np.ndarray, precomputed: bool) -> Samples:
        n = len(images)
        extra = detector.precompute(None, images) if precomputed else {}  # type: ignore[arg-type]
        z = np.zeros(n, np.int64)
        return Samples("set", images, np.zeros((n, 1), np.float32), z, z, extra=extra)

    assert detector.precompute_keys() == ["nss"]
    for precomputed in (False, True):
        fitted = NSSDetector(n_estimators=20).fit_samples(
            rows(real[:120], precomputed), rows(noise[:120], precomputed)
        )
        test = rows(np.concatenate([real[120:], noise[120:]]), precomputed)
        np.testing.assert_array_equal(fitted.score_samples(test), scores)


def test_mahalanobis_detector_scores_noise_higher(
    tiny_network: torch.nn.Module, data_root: Path
) -> None:
    real = _fashion_images(data_root, 400)
    labels = np.arange(400) % 10  # any labelling works for the Gaussian fit's plumbing
    noise = np.random.default_rng(10).random((200, 1, 28, 28), dtype=np.float32)
    detector = MahalanobisDetector(magnitudes=(0.0, 0.01), n_estimators=20, selection_samples=120)
    detector.fit_clean(tiny_network, real[:200], labels[:200])
    assert detector.layer_names_ == ["blocks.1"] and detector.layer_dims_ == [4, 4]
    x = np.concatenate([real[200:300], noise[:100]])
    y = np.r_[np.zeros(100), np.ones(100)].astype(int)
    detector.fit(tiny_network, x, y)
    assert detector.magnitude_ in (0.0, 0.01) and set(detector.selection_auroc_) == {0.0, 0.01}
    scores = detector.score(tiny_network, np.concatenate([real[300:], noise[100:]]))
    assert scores[100:].mean() > scores[:100].mean() + 0.5
    features = detector.mahalanobis_features(tiny_network, real[:5], 0.01)
    assert features.shape == (5, 2) and np.isfinite(features).all()
    # Pre-processing moves inputs towards the closest class: the Gaussian score does not drop.
    plain = detector.mahalanobis_features(tiny_network, real[:5], 0.0)
    assert (features >= plain - 1e-3 * np.abs(plain)).mean() > 0.8
    shared = detector.copy_statistics(random_state=3)
    assert (
        shared.random_state == 3
        and shared.means_ is detector.means_
        and not hasattr(shared, "forest_")
    )
    np.testing.assert_array_equal(
        mahalanobis_features(tiny_network, real[:5], detector, 0.01), features
    )
    other = get_model("resnet9_mnist", width=6, depth=2, hidden=8).eval()
    with pytest.raises(InputError, match="another network"):
        detector.score(other, real[:3])


def test_transport_features_feed_the_detector_end_to_end(
    tiny_network: torch.nn.Module, data_root: Path
) -> None:
    real = _fashion_images(data_root, 200)
    noisy = np.clip(real + np.random.default_rng(11).normal(0, 0.3, real.shape), 0, 1).astype(
        np.float32
    )
    features, logits = extract_features(tiny_network, np.concatenate([real, noisy]))
    y = np.r_[np.zeros(200), np.ones(200)].astype(int)
    train = np.r_[0:150, 200:350]
    test = np.r_[150:200, 350:400]
    detector = TransportDetector(n_estimators=30).fit(
        features[train], y[train], logits[train].argmax(1)
    )
    assert auroc(y[test], detector.score(features[test], logits[test].argmax(1))) > 0.9


def test_vote_fraction_is_the_mean_of_each_trees_predict() -> None:
    """The one-conversion walk gives every tree's own ``predict`` vote, float64 input or
    float32, a forest of one class too; a wrong width is refused (apply would not check it)."""
    from sklearn.ensemble import RandomForestClassifier

    from detector.voting import vote_fraction

    x, y, _ = _separated(300, 0, shift=0.8)  # overlapping: many split votes
    forest = RandomForestClassifier(40, random_state=0, min_samples_leaf=2).fit(x, y)
    single = RandomForestClassifier(5, random_state=0).fit(x, np.zeros(len(x), int))
    rows = np.random.default_rng(1).normal(size=(200, 6))
    for fitted, test in ((forest, rows), (forest, rows.astype(np.float32)), (single, rows)):
        expected = np.mean([tree.predict(test) for tree in fitted.estimators_], axis=0)
        np.testing.assert_array_equal(vote_fraction(fitted, test), expected)
    assert 0 < vote_fraction(forest, rows).mean() < 1
    with pytest.raises(InputError, match="takes 6 features, got 5"):
        vote_fraction(forest, rows[:, :5])
