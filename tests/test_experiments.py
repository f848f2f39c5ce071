"""Detection protocols: leak-free splits, seen/unseen/OOD rows, mean ± std over seeds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from detector.calibration import calibrate_threshold
from detector.ensemble import EnsembleDetector
from detector.errors import InputError
from detector.forest import TransportDetector
from detector.metrics import detection_metrics
from detector.novelty import NoveltyDetector
from detector.quantile import QuantileDetector
from training.evaluation.protocols import (
    ExperimentRecord,
    Samples,
    Sides,
    Split,
    balanced_draw,
    concat,
    evaluate_fitted,
    index_universe,
    run_protocols,
)
from training.presets.pipelines import PIPELINE_PRESETS, PipelineConfig


def _samples(
    name: str, indices: np.ndarray, shift: float, rng: np.random.Generator, success: bool = True
) -> Samples:
    n = len(indices)
    features = rng.normal(shift, 1.0, size=(n, 6)).astype(np.float32)
    return Samples(
        name,
        np.zeros((n, 1, 2, 2), np.float32),
        features,
        rng.integers(0, 3, n),
        indices.astype(np.int64),
        np.full(n, success) if name not in ("clean",) and shift else None,
    )


class RecordingTransportDetector(TransportDetector):
    """The real transport detector, recording which source images each fit saw and its seed."""

    fitted_on: list[tuple[int, set[int]]] = []

    def fit_samples(self, clean: Samples, abnormal: Samples) -> TransportDetector:  # type: ignore[override]
        seen = set(clean.indices.tolist()) | (
            set() if abnormal.name == "ood" else set(abnormal.indices.tolist())
        )
        assert self.random_state is not None
        RecordingTransportDetector.fitted_on.append((self.random_state, seen))
        return super().fit_samples(clean, abnormal)


def _count_fits(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[int]:
    """A list that grows by one at each call of ``cls.fit`` (the real fit, counted)."""
    fits: list[int] = []
    real_fit = cls.fit

    def counted(self, *args, **kwargs):
        fits.append(1)
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(cls, "fit", counted)
    return fits


@pytest.fixture
def world() -> World:
    rng = np.random.default_rng(0)
    universe = np.arange(400)
    clean = _samples("clean", universe, 0.0, rng)
    attacks = {
        "fgm": _samples("fgm", universe, 3.0, rng),
        "cw": _samples("cw", universe[:120], 1.5, rng),  # a smaller subset, like the slow attacks
    }
    ood = {
        "digits": _samples("ood", np.arange(80), 4.0, rng),
        "noise": _samples("ood", np.arange(80), -4.0, rng),
    }
    return clean, attacks, ood


World = tuple[Samples, dict[str, Samples], dict[str, Samples]]


def _run(world: World, **options: Any) -> list[ExperimentRecord]:
    """The protocols on ``world``'s clean, attacked and OOD sets, for the "lap" network, quietly."""
    clean, attacks, ood = world
    return run_protocols(
        model="lap", clean=clean, attacks=attacks, ood_sets=ood, progress=False, **options
    )


def test_split_sides_are_disjoint_and_sized() -> None:
    split = Split(seed=3, test_fraction=0.1, universe=1000)
    assert split.is_test.sum() == 100
    assert not (split.is_test & split.is_calibration).any()
    assert split.is_calibration.sum() == 225  # a quarter of the 900 training-side images
    assert not np.array_equal(
        split.is_test, Split(seed=4, test_fraction=0.1, universe=1000).is_test
    )


def test_protocols_are_leak_free_and_report_mean_and_std(world) -> None:
    RecordingTransportDetector.fitted_on = []
    records = _run(
        world,
        detectors=[RecordingTransportDetector(n_estimators=20)],
        seen=["fgm", "cw"],
        unseen_train="fgm",
        ood_train=["fgm", "digits"],
        seeds=[0, 1, 2],
    )
    rows = {(r.setting, r.train, r.test): r.row() for r in records}
    assert set(rows) == {
        ("seen", "fgm", "fgm"),
        ("seen", "cw", "cw"),
        ("unseen", "fgm", "cw"),
        ("ood", "fgm", "digits"),
        ("ood", "fgm", "noise"),
        ("ood", "digits", "noise"),
    }
    for row in rows.values():
        assert row["runs"] == 3 and 0 <= row["accuracy_std"] <= 0.5
        assert {"accuracy", "auroc", "tpr", "fpr", "fpr_at_95_tpr"} <= set(row)
        # each run's value is kept, in seed order, for paired comparisons between detectors
        runs = row["per_run"]["accuracy"]
        assert len(runs) == 3 and np.isclose(np.mean(runs), row["accuracy"])
        assert np.isclose(np.std(runs), row["accuracy_std"])
    record = next(r for r in records if (r.setting, r.train) == ("seen", "cw"))
    seed_order = [o.metrics["accuracy"] for o in record.outcomes]
    assert rows[("seen", "cw", "cw")]["per_run"]["accuracy"] == seed_order
    # Clear separations are detected; the seen FGM experiment is near perfect.
    assert rows[("seen", "fgm", "fgm")]["accuracy"] > 0.95
    assert rows[("seen", "fgm", "fgm")]["successful_attack_detection_rate"] > 0.95
    assert rows[("ood", "digits", "noise")]["train_set"] == "digits"
    # No source image used in a fit is ever scored as a test sample within the same seed.
    assert len(RecordingTransportDetector.fitted_on) == 3 * 5  # seen x2, unseen, OOD x2 per seed
    for seed, fitted in RecordingTransportDetector.fitted_on:
        test_side = set(np.flatnonzero(Split(seed, 0.1, 400).is_test).tolist())
        assert fitted and not fitted & test_side


class RecordingAbnormal(TransportDetector):
    """The real transport detector, recording the abnormal rows each fit learnt from."""

    abnormal_rows: list[int] = []

    def fit_samples(self, clean: Samples, abnormal: Samples) -> TransportDetector:  # type: ignore[override]
        RecordingAbnormal.abnormal_rows.append(len(abnormal))
        return super().fit_samples(clean, abnormal)


def test_a_set_kept_for_training_is_learnt_whole_and_never_tested_on(world) -> None:
    """The OOD protocol's synthetic set (the seed's experiment on another distribution) trains a
    detector that is tested on every OOD set, with every one of its rows; no row tests it."""
    rng = np.random.default_rng(5)
    kept = {"synthetic": _samples("ood-synthetic", np.arange(90), 4.0, rng)}
    RecordingAbnormal.abnormal_rows = []
    records = _run(
        world,
        detectors=[RecordingAbnormal(n_estimators=10)],
        seen=[],
        unseen_train=None,
        ood_train=["synthetic", "digits"],
        seeds=[0, 1],
        ood_clean_ratio=None,
        ood_train_sets=kept,
    )
    pairs = {(r.train, r.test) for r in records}
    assert pairs == {("synthetic", "digits"), ("synthetic", "noise"), ("digits", "noise")}
    # per seed: the kept set whole (90 rows), then the OOD set's first half (40 of 80)
    assert RecordingAbnormal.abnormal_rows == [90, 40, 90, 40]
    rows = {(r.train, r.test): r.row() for r in records}
    assert rows[("synthetic", "digits")]["accuracy"] > 0.9  # learnt at +4, digits sit at +4
    assert rows[("synthetic", "noise")]["train_set"] == "synthetic"


def test_the_ensemble_reuses_the_transport_forests_and_scores_as_if_fitted_alone(
    world, monkeypatch
) -> None:
    from detector.ensemble import EnsembleDetector

    fits = _count_fits(monkeypatch, TransportDetector)
    params = {"n_estimators": 10, "min_class_samples": 5}
    common = dict(seen=["fgm", "cw"], unseen_train="fgm", ood_train=["fgm", "digits"], seeds=[0, 1])
    both = _run(
        world, detectors=[TransportDetector(**params), EnsembleDetector(**params)], **common
    )
    assert len(fits) == 2 * 5  # every training side is drawn from the seed alone: all reused
    alone = _run(world, detectors=[EnsembleDetector(**params)], **common)
    # Seen and unseen sides draw no shared random numbers: the same rows, the same results.
    reused = [r.row() for r in both if r.detector == "ensemble" and r.setting != "ood"]
    assert len(reused) == 3 and reused == [r.row() for r in alone if r.setting != "ood"]


def test_what_learns_from_clean_images_only_learns_from_every_clean_training_image(
    world, monkeypatch
) -> None:
    """Seen on CW (the first 120 images only), the ensemble's forests learn from the attack's
    pairs and its clean-only parts from every clean image of the training side: the scores are
    those of an ensemble fitted so by hand, not those of one fitted on the sources alone (the
    parts fitted for FGM first, reused as they are). A clean-only detector (QT) learns from
    every clean training image too."""
    clean, attacks, _ = world
    params = {"n_estimators": 10, "min_class_samples": 5}
    fits = _count_fits(monkeypatch, NoveltyDetector)
    _, record, _, quantile = _run(
        world,
        detectors=[EnsembleDetector(**params), QuantileDetector()],
        seen=["fgm", "cw"],
        unseen_train=None,
        ood_train=[],
        seeds=[0],
    )
    assert (record.train, quantile.train, quantile.detector) == ("cw", "cw", "quantile")
    assert len(fits) == 1  # the clean-only parts fitted once for both attacks
    sides = Sides.of(0, 0.1, index_universe(clean, attacks), clean, None)
    (train_clean, train_cw), (test_clean, test_cw) = sides.pairs(attacks["cw"])
    assert len(train_clean) < len(sides.train_clean) / 2
    tested = concat([test_clean, test_cw])
    by_hand, sources_only = (
        EnsembleDetector(**params)
        .with_seed(0)
        .fit_samples(train_clean, train_cw, clean_reference=reference)
        .score_samples(tested)
        for reference in (sides.train_clean, None)
    )
    np.testing.assert_array_equal(record.outcomes[0].scores, by_hand)
    assert not np.array_equal(by_hand, sources_only)
    band, sources_band = (
        QuantileDetector().fit_samples(rows, train_cw).score_samples(tested)
        for rows in (sides.train_clean, train_clean)
    )
    np.testing.assert_array_equal(quantile.outcomes[0].scores, band)
    assert not np.array_equal(band, sources_band)


def test_the_ood_protocol_fits_on_clean_images_from_the_whole_training_side(world) -> None:
    """Trained on an attack whose set covers a few source images (CW: the first 120), the OOD
    detector still sees clean images of the whole training side, the population its clean test
    rows come from, as many as the attack's training rows, the same ones for every detector."""
    fitted: list[tuple[np.ndarray, int]] = []

    class Recording(TransportDetector):
        def fit_samples(self, clean: Samples, abnormal: Samples) -> TransportDetector:  # type: ignore[override]
            fitted.append((clean.indices.copy(), len(abnormal)))
            return super().fit_samples(clean, abnormal)

    _run(
        world,
        seen=[],
        detectors=[Recording(n_estimators=5), Recording(n_estimators=5)],
        unseen_train=None,
        ood_train=["cw"],
        seeds=[0],
    )
    (first, n_abnormal), (second, _) = fitted
    train_side = ~Split(0, 0.1, 400).is_test & ~Split(0, 0.1, 400).is_calibration
    assert len(first) == n_abnormal == train_side[:120].sum()
    assert (first >= 120).any() and train_side[first].all()
    np.testing.assert_array_equal(first, second)


def test_the_ood_protocol_takes_as_many_clean_rows_per_abnormal_row_as_asked(world) -> None:
    """``ood_clean_ratio`` 2: every CW training row against twice as many clean rows of the whole
    training side; where the clean side has no more rows than the attack (FGM covers every
    source image) the seed's balanced rows; None: every clean training row; 1 draws the seed's
    balanced rows, as the default."""
    fitted: list[tuple[str, np.ndarray, int]] = []

    class Recording(TransportDetector):
        def fit_samples(self, clean: Samples, abnormal: Samples) -> TransportDetector:  # type: ignore[override]
            fitted.append((abnormal.name, clean.indices.copy(), len(abnormal)))
            return super().fit_samples(clean, abnormal)

    def fits(**ratio: float | None) -> list[tuple[str, np.ndarray, int]]:
        fitted.clear()
        _run(
            world,
            seen=[],
            detectors=[Recording(n_estimators=5)],
            unseen_train=None,
            ood_train=["cw", "fgm"],
            seeds=[0],
            **ratio,
        )
        return list(fitted)

    split = Split(0, 0.1, 400)
    train_side = ~split.is_test & ~split.is_calibration
    (_, cw_clean, n_cw), (_, fgm_clean, n_fgm) = fits(ood_clean_ratio=2.0)
    assert n_cw == train_side[:120].sum() and len(cw_clean) == 2 * n_cw
    assert train_side[cw_clean].all() and len(np.unique(cw_clean)) == len(cw_clean)
    assert len(fgm_clean) == n_fgm == train_side.sum()
    (_, cw_every, _), (_, fgm_every, _) = fits(ood_clean_ratio=None)
    assert len(cw_every) == len(fgm_every) == train_side.sum()
    default, balanced = fits(), fits(ood_clean_ratio=1.0)
    for (_, a, n_a), (_, b, n_b) in zip(default, balanced, strict=True):
        assert n_a == n_b and len(a) == n_a
        np.testing.assert_array_equal(a, b)
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(InputError, match="finite number >= 1 or None"):
            fits(ood_clean_ratio=bad)
    assert not fitted  # refused before any fit


def _seed_balanced(
    clean: Samples, abnormal: Samples, rng: np.random.Generator
) -> tuple[Samples, Samples]:
    """The seed's balanced draw as the OOD protocol made it before ``ood_clean_ratio``."""
    n = min(len(clean), len(abnormal))
    return clean.subsample(n, rng), abnormal.subsample(n, rng)


@pytest.mark.parametrize("n_clean, n_abnormal", [(300, 120), (120, 300), (200, 200)])
def test_a_clean_ratio_of_one_draws_the_seeds_balanced_rows(n_clean, n_abnormal) -> None:
    rng = np.random.default_rng(0)
    clean = _samples("clean", np.arange(n_clean), 0.0, rng)
    abnormal = _samples("ood", np.arange(n_abnormal), 4.0, rng)
    ours = balanced_draw(clean, abnormal, np.random.default_rng(7), 1.0)
    seeds = _seed_balanced(clean, abnormal, np.random.default_rng(7))
    for a, b in zip(ours, seeds, strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
    more, _ = balanced_draw(clean, abnormal, np.random.default_rng(7), 1.5)
    assert len(more) == min(n_clean, round(1.5 * min(n_clean, n_abnormal)))


def test_the_pipeline_config_refuses_a_clean_ratio_below_one_or_not_finite() -> None:
    base = PIPELINE_PRESETS["smoke"].model_dump()
    assert PipelineConfig(**{**base, "ood_clean_ratio": None}).ood_clean_ratio is None
    for bad in (0.5, float("inf")):
        with pytest.raises(ValidationError, match="ood_clean_ratio"):
            PipelineConfig(**{**base, "ood_clean_ratio": bad})
    assert PIPELINE_PRESETS["smoke"].ood_clean_ratio == 1.0  # the seed's draw
    assert PIPELINE_PRESETS["quick"].ood_clean_ratio is None
    assert PIPELINE_PRESETS["full"].ood_clean_ratio is None


def test_the_ood_protocol_trains_only_on_sets_it_knows() -> None:
    base = PIPELINE_PRESETS["smoke"].model_dump()
    assert "synthetic" in PipelineConfig(**{**base, "ood_train": ["synthetic"]}).ood_train
    with pytest.raises(ValidationError, match="'letters' is neither an attack key"):
        PipelineConfig(**{**base, "ood_train": ["fgm-eps0.1", "letters"]})
    with pytest.raises(ValidationError, match="'noise' is neither an attack key, an OOD set"):
        PipelineConfig(**{**base, "ood_train": ["noise"], "ood_test": ["digits"]})  # never loaded
    with pytest.raises(ValidationError, match="'synthetic' names the OOD protocol's synthetic"):
        PipelineConfig(**{**base, "ood_test": ["digits", "synthetic"]})
    assert "synthetic" in PIPELINE_PRESETS["quick"].ood_train


def test_every_detector_is_tested_on_the_same_ood_rows_whatever_ran_before_it(world) -> None:
    """An OOD row's balanced test draw depends on the seed and the row only: the transport
    detector scores the same rows whether or not another detector's protocols ran first, so the
    detectors' OOD rows are paired (and the evaluation may run them in any grouping)."""
    _, _, ood = world

    class Recording(TransportDetector):
        scored: list[np.ndarray] = []

        def score_samples(self, samples: Samples) -> np.ndarray:  # type: ignore[override]
            Recording.scored.append(samples.indices.copy())
            return super().score_samples(samples)

    def scored_rows(detectors: list) -> list[np.ndarray]:
        Recording.scored = []
        _run(
            world,
            seen=[],
            detectors=detectors,
            unseen_train=None,
            ood_train=["fgm", "digits"],
            seeds=[0, 1],
        )
        return Recording.scored

    alone = scored_rows([Recording(n_estimators=5)])
    after = scored_rows([QuantileDetector(), Recording(n_estimators=5)])
    # 2 seeds x (the calibration slice once per fitted detector, then 3 rows x (clean, OOD))
    assert len(alone) == len(after) == 2 * (2 + 3 * 2)
    assert any(len(rows) < len(ood["digits"]) for rows in alone)  # a draw, not every row
    for a, b in zip(alone, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_protocol_decides_at_the_fitted_detectors_own_threshold() -> None:
    rng = np.random.default_rng(3)
    clean, abnormal = (_samples(k, np.arange(300), m, rng) for k, m in (("clean", 0), ("fgm", 0.8)))
    detector = TransportDetector(n_estimators=30).fit_samples(clean, abnormal)
    assert detector.decision_threshold() != 0.5  # learnt on the overlapping rows' out-of-bag votes
    test_clean, test_abnormal = (
        _samples(k, np.arange(300, 500), m, rng) for k, m in (("clean", 0), ("fgm", 0.8))
    )
    outcome = evaluate_fitted(detector, clean, test_clean, test_abnormal, target_fpr=0.05)
    expected = detection_metrics(outcome.is_abnormal, outcome.scores, detector.decision_threshold())
    assert outcome.metrics["accuracy"] == pytest.approx(expected["accuracy"])
    assert outcome.metrics["fpr"] == pytest.approx(expected["fpr"])


def test_a_threshold_calibrated_once_gives_the_same_outcome() -> None:
    """A protocol that tests one fitted detector on several sets calibrates it once and passes
    the threshold on: the outcome is the one :func:`evaluate_fitted` computes itself."""
    rng = np.random.default_rng(4)
    clean, abnormal = (_samples(k, np.arange(300), m, rng) for k, m in (("clean", 0), ("fgm", 1)))
    detector = QuantileDetector().fit_samples(clean, abnormal)  # decides at its calibration
    calibration, test_clean, test_abnormal = (
        _samples(k, np.arange(300, 500), m, rng)
        for k, m in (("clean", 0), ("clean", 0), ("fgm", 1))
    )
    own = evaluate_fitted(detector, calibration, test_clean, test_abnormal, target_fpr=0.05)
    threshold = calibrate_threshold(detector.score_samples(calibration), 0.05)
    given = evaluate_fitted(
        detector, calibration, test_clean, test_abnormal, target_fpr=0.05, calibrated=threshold
    )
    assert given.metrics == own.metrics
    shifted = evaluate_fitted(
        detector, calibration, test_clean, test_abnormal, target_fpr=0.05, calibrated=-np.inf
    )
    assert shifted.metrics["calibrated_fpr"] == 1.0  # the given threshold is the one read
