"""Metrics equal scikit-learn's; calibration reaches its target FPR on held-out clean data."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from sklearn import metrics as skm

from detector.calibration import (
    Calibration,
    CalibrationWarning,
    calibrate_threshold,
    empirical_fpr,
    fpr_upper_bound,
    rate_interval,
)
from detector.errors import ArtefactError, ConfigError, InputError
from detector.metrics import (
    auroc,
    balanced_threshold,
    detection_metrics,
    fpr_at_tpr,
    roc_curve,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_roc_and_auroc_equal_sklearn(seed: int, ties: bool) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 500)
    scores = rng.normal(size=500) + y * rng.uniform(0, 2)
    if ties:
        scores = np.round(scores, 1)
    for drop in (True, False):
        ours = roc_curve(y, scores, drop_intermediate=drop)
        theirs = skm.roc_curve(y, scores, drop_intermediate=drop)
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b)
    assert auroc(y, scores) == pytest.approx(skm.roc_auc_score(y, scores), abs=1e-12)
    fpr, tpr, _ = skm.roc_curve(y, scores, drop_intermediate=False)
    assert fpr_at_tpr(y, scores, 0.95) == pytest.approx(fpr[tpr >= 0.95].min())


def test_detection_metrics_equal_sklearn() -> None:
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 400)
    scores = rng.random(400) + 0.3 * y
    success = rng.random(400) < 0.7
    m = detection_metrics(y, scores, 0.6, attack_success=success)
    flagged = scores > 0.6
    assert m["tpr"] == pytest.approx(skm.recall_score(y, flagged))
    assert m["fpr"] == pytest.approx(1 - skm.recall_score(1 - y, ~flagged))
    assert m["accuracy"] == pytest.approx(skm.balanced_accuracy_score(y, flagged))
    assert m["auroc"] == pytest.approx(skm.roc_auc_score(y, scores))
    assert m["successful_attack_detection_rate"] == pytest.approx(
        flagged[(y == 1) & success].mean()
    )
    assert m["n_clean"] + m["n_abnormal"] == 400
    balanced = np.r_[np.zeros(50), np.ones(50)]
    balanced_scores = np.r_[np.linspace(0, 1, 50), np.linspace(0.5, 1.5, 50)]
    assert detection_metrics(balanced, balanced_scores, 0.7)["accuracy"] == pytest.approx(
        skm.accuracy_score(balanced, balanced_scores > 0.7)
    )


def test_metrics_refuse_bad_input() -> None:
    with pytest.raises(InputError, match="both"):
        detection_metrics(np.zeros(5), np.zeros(5), 0.5)
    with pytest.raises(InputError, match="NaN"):
        auroc(np.array([0, 1]), np.array([0.0, np.nan]))


def test_calibrate_threshold_is_smallest_meeting_target() -> None:
    scores = np.arange(100, dtype=float)  # 0..99
    t = calibrate_threshold(scores, 0.05)
    assert t == 94.0 and empirical_fpr(scores, t) == 0.05
    assert empirical_fpr(scores, np.nextafter(t, -np.inf)) > 0.05
    assert calibrate_threshold(scores, 0.0) == 99.0
    discrete = np.r_[np.zeros(90), np.ones(10)]  # ties: the FPR can only be 0.1 or 0
    assert calibrate_threshold(discrete, 0.05) == 1.0
    with pytest.raises(ConfigError):
        calibrate_threshold(scores, 1.0)


@pytest.mark.parametrize("target", [0.01, 0.05, 0.1])
def test_calibration_reaches_target_fpr_on_held_out_clean_data(target: float) -> None:
    rng = np.random.default_rng(int(target * 1000))
    n_cal, n_test = 4000, 40000
    calibration = Calibration.from_scores(rng.gamma(2.0, size=n_cal), target)
    assert calibration.achieved_fpr <= target and calibration.n == n_cal
    held_out = empirical_fpr(rng.gamma(2.0, size=n_test), calibration.threshold)
    # Binomial sampling error of both samples (4 sigma) plus the 1/n granularity of the threshold.
    sigma = math.sqrt(target * (1 - target) * (1 / n_cal + 1 / n_test))
    assert abs(held_out - target) <= 4 * sigma + 1 / n_cal
    assert Calibration.from_dict(calibration.to_dict()) == calibration


def test_a_confident_threshold_keeps_new_images_fpr_under_target_at_that_rate() -> None:
    """Over many calibration sets of 800 images, the point estimate's threshold lets the true FPR
    exceed the target about half the time; the 90%-confidence threshold about 10% of the time."""
    rng = np.random.default_rng(11)
    target, n, trials = 0.05, 800, 400
    exceed = {None: 0, 0.9: 0}
    for _ in range(trials):
        scores = rng.random(n)  # uniform clean scores: the true FPR of t is 1 - t
        for confidence in exceed:
            t = calibrate_threshold(scores, target, confidence=confidence)
            exceed[confidence] += (1 - t) > target
    assert 0.35 <= exceed[None] / trials <= 0.65
    assert 0.03 <= exceed[0.9] / trials <= 0.15  # 0.1 at most, by construction (discreteness)


def test_confident_calibration_bounds_its_fpr_and_travels_in_the_dict() -> None:
    scores = np.arange(1000, dtype=float)
    calibration = Calibration.from_scores(scores, 0.05, confidence=0.95)
    flagged = round(calibration.achieved_fpr * 1000)
    assert fpr_upper_bound(np.array([flagged]), 1000, 0.95)[0] <= 0.05
    assert fpr_upper_bound(np.array([flagged + 1]), 1000, 0.95)[0] > 0.05  # the smallest such t
    assert calibration.achieved_fpr < 0.05 and calibration.confidence == 0.95
    assert Calibration.from_dict(calibration.to_dict()) == calibration
    older = {k: v for k, v in calibration.to_dict().items() if k != "confidence"}
    assert Calibration.from_dict(older).confidence is None  # bundles written before it load
    # Clopper-Pearson: 0 of n flagged bounds the rate by 1 - (1 - c)^(1/n); all of n by 1.
    np.testing.assert_allclose(fpr_upper_bound(np.array([0]), 100, 0.95), 1 - 0.05 ** (1 / 100))
    assert fpr_upper_bound(np.array([100]), 100, 0.95)[0] == 1.0
    with pytest.raises(ConfigError):
        calibrate_threshold(scores, 0.05, confidence=1.0)


def test_rate_interval_is_the_exact_two_sided_clopper_pearson_interval() -> None:
    # 0 of n: [0, 1 - (alpha/2)^(1/n)]; n of n: [(alpha/2)^(1/n), 1]; k of n mirrors n - k of n
    np.testing.assert_allclose(rate_interval(0, 100), (0.0, 1 - 0.025 ** (1 / 100)))
    np.testing.assert_allclose(rate_interval(100, 100), (0.025 ** (1 / 100), 1.0))
    low, high = rate_interval(108, 2000)
    np.testing.assert_allclose((1 - high, 1 - low), rate_interval(1892, 2000))
    assert low < 108 / 2000 < high
    # each side of a 90% interval is the one-sided 95% bound the calibration uses
    assert math.isclose(
        rate_interval(12, 100, 0.9)[1], fpr_upper_bound(np.array([12]), 100, 0.95)[0]
    )
    for flagged, n in ((5, 0), (-1, 10), (11, 10)):
        with pytest.raises(InputError):
            rate_interval(flagged, n)
    with pytest.raises(InputError, match="confidence"):
        rate_interval(5, 10, confidence=1.0)


def test_a_threshold_at_tied_top_scores_is_flagged_saturated_with_a_warning() -> None:
    """A score capped at 1.0 that 8% of clean images reach: a 5% target puts the threshold at 1.0,
    so this detector flags nothing (score > threshold never holds); the calibration says so."""
    rng = np.random.default_rng(0)
    capped = np.r_[rng.uniform(0.0, 0.9, 920), np.ones(80)]
    with pytest.warns(CalibrationWarning, match=r"maximum 1 meets .* \(80 of 1000 clean scores"):
        calibration = Calibration.from_scores(capped, 0.05)
    assert calibration.saturated and calibration.threshold == 1.0
    assert empirical_fpr(capped, calibration.threshold) == 0.0
    assert Calibration.from_dict(calibration.to_dict()).saturated
    # a few ties at the top within the target, a threshold below the top, or a target of 0 (the
    # maximum by design): not saturated
    uniform = rng.uniform(0, 1, 1000)
    for scores, target in (
        (np.r_[uniform[:970], np.ones(30)], 0.05),
        (uniform, 0.05),
        (uniform, 0),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error", CalibrationWarning)
            assert not Calibration.from_scores(scores, target).saturated
    with pytest.warns(CalibrationWarning):  # too few images for the confidence
        assert Calibration.from_scores(uniform[:20], 0.05, confidence=0.95).saturated
    unsaturated = {k: v for k, v in calibration.to_dict().items() if k != "saturated"}
    assert not Calibration.from_dict(unsaturated).saturated  # older bundles and runs load


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"threshold": "0.7"}, "threshold: Input should be a valid number"),
        ({"threshold": float("nan")}, "threshold: Input should be a finite number"),
        ({"target_fpr": 1.5}, "target_fpr: Input should be less than 1"),
        ({"n": 0}, "n: Input should be greater than or equal to 1"),
        ({"n": True}, "n: Input should be a valid integer"),
        ({"confidence": 1.0}, "confidence: Input should be less than 1"),
        ({"saturated": "no"}, "saturated: Input should be a valid boolean"),
        ({"thresold": 0.7}, "thresold: Unexpected keyword argument"),
        ({"threshold": None}, "threshold: Input should be a valid number"),
    ],
)
def test_a_corrupt_calibration_is_refused_with_what_is_wrong(
    change: dict[str, object], message: str
) -> None:
    """An edited or damaged deployable.json never loads into a threshold that flags wrongly."""
    data = Calibration.from_scores(np.arange(100.0), 0.05).to_dict()
    with pytest.raises(ArtefactError, match=message):
        Calibration.from_dict({**data, **change})
    missing = {k: v for k, v in data.items() if k != "n"}
    with pytest.raises(ArtefactError, match="n: Field required"):
        Calibration.from_dict(missing)
    with pytest.raises(ArtefactError, match="calibration: Input should be a dictionary"):
        Calibration.from_dict([data])


def test_too_few_images_for_the_confidence_give_the_highest_score() -> None:
    """Under 59 clean images even 0 flagged cannot bound the FPR by 5% with 95% confidence:
    the threshold is then the highest clean score (nothing flagged), never a lower one."""
    scores = np.random.default_rng(3).random(40)
    assert calibrate_threshold(scores, 0.05, confidence=0.95) == scores.max()
    assert calibrate_threshold(scores, 0.05) < scores.max()  # the point estimate flags 2 of 40


def test_balanced_threshold_is_the_best_balanced_accuracy_of_every_threshold() -> None:
    rng = np.random.default_rng(5)
    y = np.r_[np.zeros(300), np.ones(200)].astype(bool)
    scores = np.round(np.r_[rng.beta(2, 5, 300), rng.beta(5, 2, 200)], 2)  # many ties
    t = balanced_threshold(y, scores)
    grid = np.r_[np.unique(scores), np.unique(scores) - 1e-9]
    best = max(detection_metrics(y, scores, g)["accuracy"] for g in grid)
    assert detection_metrics(y, scores, t)["accuracy"] == pytest.approx(best)
    assert t not in np.unique(scores) or t == 0.5  # between scores, robust to float error


def test_balanced_threshold_prefers_the_given_point_among_equals() -> None:
    y = np.array([0, 0, 0, 1, 1, 1], bool)
    separated = np.array([0.1, 0.2, 0.3, 0.8, 0.9, 1.0])
    assert balanced_threshold(y, separated) == 0.5  # anything in [0.3, 0.8) separates them
    assert balanced_threshold(y, separated, prefer=0.9) == pytest.approx(0.55)  # midway
    assert balanced_threshold(y, separated, prefer=0.0) == pytest.approx(0.55)
    # One clean score at 0.6: flagging above it (one miss, no false positive) ties with
    # flagging above 0.2 (one false positive, no miss): the tie whose range holds 0.5 wins.
    overlapping = np.array([0.1, 0.2, 0.6, 0.55, 0.9, 1.0])
    assert balanced_threshold(y, overlapping) == 0.5
    shifted = np.array([0.1, 0.62, 0.6, 0.7, 0.9, 1.0])  # two clean above 0.5: best at (0.62, 0.7)
    assert balanced_threshold(y, shifted) == pytest.approx(0.66)


def test_balanced_threshold_refusals_and_no_separation() -> None:
    with pytest.raises(InputError, match="both clean and abnormal"):
        balanced_threshold(np.zeros(3, bool), np.array([0.1, 0.2, 0.3]))
    with pytest.raises(InputError, match="NaN"):
        balanced_threshold(np.array([0, 1], bool), np.array([0.1, np.nan]))
    reversed_scores = np.array([0.9, 0.8, 0.1, 0.2])  # abnormal score lower: nothing beats chance
    assert balanced_threshold(np.array([0, 0, 1, 1], bool), reversed_scores, prefer=0.4) == 0.4
