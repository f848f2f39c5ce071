"""Leak-free detection protocols of seed 003 §5.4: seen, unseen and out-of-distribution.

Every sample is tied to the index of its source test image. For each seed, the test-image index
space is split once into B1 (training side, 90%) and B2 (test side, 10%); every attack's set is
cut by the same split, so no test image (clean or attacked) is ever on both sides, also across
attacks. Thresholds are calibrated on clean samples held out from the training side only.

- seen: train on B1 clean vs B1 attacked, test on B2 clean vs B2 attacked (same attack);
- unseen: train on one attack (FGM), test on every other attack's B2;
- OOD: train against one abnormal set (an attack, or another data set), test on B2 clean vs an
  unseen OOD set (digits, noise, another data set).
Each experiment is repeated over seeds and reported as mean ± std.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from detector.artefacts import save_npz
from detector.base import Detector
from detector.calibration import calibrate_threshold
from detector.ensemble import EnsembleDetector
from detector.errors import InputError
from detector.forest import TransportDetector
from detector.metrics import detection_metrics

# The calibration slice: a quarter of the training side (2,000 clean images of Fashion-MNIST's
# 10,000 test images at test_fraction 0.2). The bundle's threshold keeps the FPR's one-sided
# 95% Clopper-Pearson bound under its target: with 800 images (a tenth) that forced an empirical
# FPR of 3.6% for a 5% target, with 2,000 it allows 4.15% -- budget the detector flags with.
CALIBRATION_FRACTION = 0.25
METRIC_KEYS = (
    "accuracy",
    "auroc",
    "tpr",
    "fpr",
    "successful_attack_detection_rate",
    "fpr_at_95_tpr",
    "calibrated_tpr",
    "calibrated_fpr",
)


@dataclass
class Samples:
    """Inputs of one kind (clean, one attack, one OOD set), aligned row by row."""

    name: str
    images: np.ndarray  # [N, C, H, W] float32
    features: np.ndarray  # transport features [N, F]
    predicted: np.ndarray  # the network's predicted labels [N]
    indices: np.ndarray  # source test-image index per row (OOD sets: their own 0..N-1)
    success: np.ndarray | None = None  # attack success per row (adversarial sets only)
    extra: dict[str, np.ndarray] = field(
        default_factory=dict
    )  # other detectors' row-aligned features
    feature_names: tuple[str, ...] | None = None  # the feature columns' names, when known
    families: np.ndarray | None = None  # attack family per row, when rows mix families

    def take(self, mask: np.ndarray) -> Samples:
        return Samples(
            self.name,
            self.images[mask],
            self.features[mask],
            self.predicted[mask],
            self.indices[mask],
            None if self.success is None else self.success[mask],
            {k: v[mask] for k, v in self.extra.items()},
            self.feature_names,
            None if self.families is None else self.families[mask],
        )

    def __len__(self) -> int:
        return len(self.indices)

    def subsample(self, n: int, rng: np.random.Generator) -> Samples:
        """At most ``n`` rows, drawn without replacement by ``rng`` and kept in order."""
        if len(self) <= n:
            return self
        return self.take(np.sort(rng.choice(len(self), n, replace=False)))


def concat(parts: Sequence[Samples], name: str = "mixed") -> Samples:
    success = None
    if all(p.success is not None for p in parts):
        success = np.concatenate([p.success for p in parts])
    shared = set.intersection(*(set(p.extra) for p in parts)) if parts else set()
    families = None
    if any(p.families is not None for p in parts):
        families = np.concatenate(
            [p.families if p.families is not None else np.full(len(p), p.name) for p in parts]
        )
    return Samples(
        name,
        np.concatenate([p.images for p in parts]),
        np.concatenate([p.features for p in parts]),
        np.concatenate([p.predicted for p in parts]),
        np.concatenate([p.indices for p in parts]),
        success,
        {k: np.concatenate([p.extra[k] for p in parts]) for k in shared},
        parts[0].feature_names if parts else None,
        families,
    )


@dataclass
class Split:
    """B1/B2 membership of test-image indices for one seed."""

    seed: int
    test_fraction: float
    universe: int

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        order = rng.permutation(self.universe)
        n_test = int(round(self.universe * self.test_fraction))
        self.is_test = np.zeros(self.universe, dtype=bool)
        self.is_test[order[:n_test]] = True
        # Calibration: a slice of the training side, never used to fit.
        self.is_calibration = np.zeros(self.universe, dtype=bool)
        train_order = order[n_test:]
        self.is_calibration[train_order[: int(round(len(train_order) * CALIBRATION_FRACTION))]] = (
            True
        )

    def train(self, samples: Samples) -> Samples:
        return samples.take(~self.is_test[samples.indices] & ~self.is_calibration[samples.indices])

    def calibration(self, samples: Samples) -> Samples:
        return samples.take(self.is_calibration[samples.indices])

    def test(self, samples: Samples) -> Samples:
        return samples.take(self.is_test[samples.indices])


@dataclass
class Outcome:
    """One seed's result: metrics, plus the scores (kept for ROC curves)."""

    metrics: dict[str, float]
    is_abnormal: np.ndarray
    scores: np.ndarray


def check_clean_ratio(clean_ratio: float | None) -> None:
    """Refuse a clean-rows-per-abnormal-row ratio that is not a finite number >= 1 (or None)."""
    if clean_ratio is not None and not (np.isfinite(clean_ratio) and clean_ratio >= 1):
        raise InputError(f"clean_ratio must be a finite number >= 1 or None, got {clean_ratio}")


def balanced_draw(
    clean: Samples,
    abnormal: Samples,
    rng: np.random.Generator,
    clean_ratio: float | None = 1.0,
) -> tuple[Samples, Samples]:
    """Trim the larger side to the smaller one's count (the seed's balanced sets, ``clean_ratio``
    1), then draw up to ``clean_ratio`` clean rows per abnormal row where the clean side has more
    (None: every clean row)."""
    check_clean_ratio(clean_ratio)
    n_abnormal = min(len(clean), len(abnormal))
    n_clean = len(clean) if clean_ratio is None else int(round(clean_ratio * n_abnormal))
    n_clean = min(len(clean), n_clean)
    return clean.subsample(n_clean, rng), abnormal.subsample(n_abnormal, rng)


@dataclass
class ExperimentRecord:
    """Mean ± std over seeds of one (model, detector, setting, train set, test set)."""

    model: str
    detector: str
    setting: str
    train: str
    test: str
    outcomes: list[Outcome] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        keys = [k for k in METRIC_KEYS if all(k in o.metrics for o in self.outcomes)]
        row: dict[str, Any] = {
            "model": self.model,
            "detector": self.detector,
            "setting": self.setting,
        }
        if self.setting == "ood":
            row.update(train_set=self.train, test_set=self.test)
        else:
            row.update(train_attack=self.train, test_attack=self.test)
        per_run: dict[str, list[float]] = {}
        for key in keys:
            values = np.array([o.metrics[key] for o in self.outcomes])
            row[key] = float(values.mean())
            row[f"{key}_std"] = float(values.std())
            per_run[key] = [float(v) for v in values]
        row["runs"] = len(self.outcomes)
        row["per_run"] = per_run  # run i of every detector is seed i's split: paired comparisons
        row["n_test"] = int(np.mean([o.metrics["n_test"] for o in self.outcomes]))
        return row


def run_protocols(
    *,
    model: str,
    clean: Samples,
    attacks: dict[str, Samples],
    ood_sets: dict[str, Samples],
    detectors: Sequence[Detector],
    seen: Sequence[str],
    unseen_train: str | None,
    ood_train: Sequence[str],
    seeds: Sequence[int],
    test_fraction: float = 0.1,
    target_fpr: float = 0.05,
    noisy_copies: Samples | None = None,
    ood_clean_ratio: float | None = 1.0,
    ood_train_sets: dict[str, Samples] | None = None,
    progress: bool = True,
) -> list[ExperimentRecord]:
    """Run seen, unseen and OOD experiments for every detector over ``seeds``.

    ``detectors`` are prototypes (prepared, e.g. Mahalanobis statistics, but not fitted); each
    fit uses ``prototype.with_seed(seed)`` through the one contract (``fit_samples`` /
    ``score_samples``). ``attacks`` and ``clean`` rows carry test-image indices; ``ood_sets`` are
    external (their rows are split by position). ``noisy_copies`` (noised clean images,
    labelled clean) are added to the training side when given. ``ood_clean_ratio``: up to that
    many clean training rows per abnormal row in the OOD protocol (1: the seed's balanced sets;
    None: every clean training row). ``ood_train_sets``: abnormal sets the OOD protocol may train
    on but never tests on (the synthetic outliers of the network's own validation images: the
    seed's OOD experiment that trains on another distribution); each is used whole.
    """
    check_clean_ratio(ood_clean_ratio)  # before any fit, not when the OOD protocol draws
    universe = index_universe(clean, attacks)
    per_seed = len(seen) + (1 if unseen_train else 0) + len(ood_train)
    protocols = _Protocols(
        model, attacks, ood_sets, target_fpr, ood_clean_ratio, dict(ood_train_sets or {})
    )
    with tqdm(
        total=len(seeds) * len(detectors) * per_seed,
        desc=f"detection experiments ({model})",
        disable=not progress,
        dynamic_ncols=True,
    ) as bar:
        for seed in seeds:
            sides = Sides.of(seed, test_fraction, universe, clean, noisy_copies)
            for prototype in detectors:
                for key in seen:
                    protocols.seen(prototype, sides, key)
                    bar.update()
                if unseen_train:
                    protocols.unseen(prototype, sides, unseen_train)
                    bar.update()
                for train_key in ood_train:
                    protocols.ood(prototype, sides, train_key)
                    bar.update()
    return list(protocols.records.values())


def index_universe(clean: Samples, attacks: dict[str, Samples]) -> int:
    """The size of the test-image index space the splits cut (one more than the largest index)."""
    return int(max(clean.indices.max(), *(a.indices.max() for a in attacks.values()))) + 1


@dataclass
class Sides:
    """One seed's split of the clean samples: training, calibration and test sides."""

    seed: int
    split: Split
    train_clean: Samples
    calibration_clean: Samples
    test_clean: Samples

    @classmethod
    def of(
        cls,
        seed: int,
        test_fraction: float,
        universe: int,
        clean: Samples,
        noisy_copies: Samples | None,
    ) -> Sides:
        split = Split(seed, test_fraction, universe)
        train_clean = split.train(clean)
        if noisy_copies is not None:
            train_clean = concat([train_clean, split.train(noisy_copies)], "clean+noise")
        return cls(
            seed,
            split,
            train_clean,
            split.calibration(clean),
            split.test(clean),
        )

    def pairs(
        self, attack: Samples, n_train: int | None = None
    ) -> tuple[tuple[Samples, Samples], tuple[Samples, Samples]]:
        """((train clean, train attacked), (test clean, test attacked)): an attack's B1 and B2
        sides, each attacked image with its clean source. ``n_train`` keeps that many training
        pairs, drawn by the seed (nested: a smaller ``n_train`` keeps a subset of a larger one)."""
        train = self.split.train(attack)
        if n_train is not None and n_train < len(train):
            order = np.random.default_rng(self.seed).permutation(len(train))
            train = train.take(np.sort(order[:n_train]))
        return _paired(self.train_clean, train), _paired(self.test_clean, self.split.test(attack))


@dataclass
class _Protocols:
    """The three protocols for one model, collecting one record per (detector, setting, sets)."""

    model: str
    attacks: dict[str, Samples]
    ood_sets: dict[str, Samples]
    target_fpr: float
    ood_clean_ratio: float | None = 1.0
    ood_train_sets: dict[str, Samples] = field(default_factory=dict)  # trained on, never tested
    records: dict[tuple[str, str, str, str], ExperimentRecord] = field(default_factory=dict)
    forests: dict[tuple[Any, ...], TransportDetector] = field(default_factory=dict)
    clean_parts: dict[int, EnsembleDetector] = field(default_factory=dict)  # one seed's at a time

    def _fit(
        self, prototype: Detector, sides: Sides, clean: Samples, abnormal: Samples
    ) -> Detector:
        """``prototype`` fitted for the seed. The ensemble reuses the forests the transport
        detector fitted on the same rows with the same parameters and seed (the same forests:
        the fit is deterministic), so a protocol running both fits them once; its clean-only
        parts are fitted once per seed, on the same clean images every time. Clean-only
        detectors (``info.supervised`` False) and the ensemble's clean-only parts learn clean
        from every clean image of the seed's training side, whatever rows the forests learn
        from: an attack's own sources leave out the network's mistakes (CW, APGD), and parts
        fitted on a few hundred of them flag every low-margin clean image."""
        detector = prototype.with_seed(sides.seed)
        if not detector.info.supervised:
            return detector.fit_samples(sides.train_clean, abnormal)
        key = (clean.name, abnormal.name, clean.indices.tobytes(), abnormal.indices.tobytes())
        if any(seed != sides.seed for seed, *_ in self.forests):
            self.forests.clear()  # one seed's forests at a time
        forests = self.forests.get((sides.seed, *key))
        if isinstance(detector, EnsembleDetector):
            if forests is None or forests.get_params() != detector.forest_params():
                forests = None
            parts = self.clean_parts.get(sides.seed)
            if parts is not None and parts.get_params() != detector.get_params():
                parts = None
            detector = detector.fit_samples(
                clean,
                abnormal,
                forests=forests,
                clean_reference=sides.train_clean,
                clean_parts=parts,
            )
            self.clean_parts = {sides.seed: detector}
            return detector
        detector = detector.fit_samples(clean, abnormal)
        if isinstance(detector, TransportDetector):
            self.forests[(sides.seed, *key)] = detector
        return detector

    def _record(
        self, detector: Detector, setting: str, train: str, test: str, outcome: Outcome
    ) -> None:
        name = detector.info.name
        record = self.records.setdefault(
            (name, setting, train, test),
            ExperimentRecord(self.model, name, setting, train, test),
        )
        record.outcomes.append(outcome)

    def _evaluate(
        self,
        detector: Detector,
        sides: Sides,
        test_clean: Samples,
        test_abnormal: Samples,
        calibrated: float,
    ) -> Outcome:
        """The outcome at ``calibrated``, the fitted detector's threshold on the seed's
        calibration slice (:func:`calibrated_threshold`: scored once for every set it is
        tested on)."""
        return evaluate_fitted(
            detector,
            sides.calibration_clean,
            test_clean,
            test_abnormal,
            self.target_fpr,
            calibrated=calibrated,
        )

    def seen(self, prototype: Detector, sides: Sides, key: str) -> None:
        """Train and test on the same attack (its B1 and B2 sides)."""
        (train_clean, train_abnormal), (test_clean, test_abnormal) = sides.pairs(self.attacks[key])
        detector = self._fit(prototype, sides, train_clean, train_abnormal)
        calibrated = calibrated_threshold(detector, sides.calibration_clean, self.target_fpr)
        outcome = self._evaluate(detector, sides, test_clean, test_abnormal, calibrated)
        self._record(detector, "seen", key, key, outcome)

    def unseen(self, prototype: Detector, sides: Sides, train_key: str) -> None:
        """Train on one attack, test on every other attack's B2."""
        train_clean, train_abnormal = _paired(
            sides.train_clean, sides.split.train(self.attacks[train_key])
        )
        detector = self._fit(prototype, sides, train_clean, train_abnormal)
        calibrated = calibrated_threshold(detector, sides.calibration_clean, self.target_fpr)
        for key, attack in self.attacks.items():
            if key == train_key:
                continue
            test_clean, test_abnormal = _paired(sides.test_clean, sides.split.test(attack))
            outcome = self._evaluate(detector, sides, test_clean, test_abnormal, calibrated)
            self._record(detector, "unseen", train_key, key, outcome)

    def ood(self, prototype: Detector, sides: Sides, train_key: str) -> None:
        """Train against one abnormal set (an attack, an OOD set, or a set kept for training), test
        on every other OOD set.

        The seed's OOD setting trains the detector to tell the data set from the abnormal set,
        then tests it on the data set vs an unseen set: the clean training rows are drawn from the
        whole training side (as many as abnormal rows, by the seed alone), the population the
        clean test rows come from. An attack's own source images would not do: CW and APGD sets
        leave out the images the network already misclassifies
        (:func:`training.evaluation.context.perturbed`), so a detector fitted on their sources never saw a
        low-margin clean image, and flags the test side's. With the seed's one clean row per
        abnormal row, a detector fitted on a few hundred CW images learns clean from as few
        and flags the network's own low-margin clean images; ``ood_clean_ratio`` > 1 (None:
        every clean training row, the noised copies included when the run adds them) gives it
        more (docs/decisions.md, "OOD clean ratio")."""
        if train_key in self.attacks:
            source = self.attacks[train_key]
            train_abnormal = sides.split.train(source)
        elif train_key in self.ood_train_sets:
            source = train_abnormal = self.ood_train_sets[train_key]
        else:
            source = self.ood_sets[train_key]
            train_abnormal = _positional_half(source, sides.seed, first=True)
        train_clean, train_abnormal = balanced_draw(
            sides.train_clean,
            train_abnormal,
            np.random.default_rng(sides.seed),
            self.ood_clean_ratio,
        )
        detector = self._fit(prototype, sides, train_clean, train_abnormal)
        calibrated = calibrated_threshold(detector, sides.calibration_clean, self.target_fpr)
        for test_key, ood in self.ood_sets.items():
            if test_key == train_key:
                continue
            test_ood = _positional_half(ood, sides.seed, first=False) if ood is source else ood
            test_clean, test_ood = balanced_draw(
                sides.test_clean, test_ood, _test_draw(sides.seed, train_key, test_key)
            )
            outcome = self._evaluate(detector, sides, test_clean, test_ood, calibrated)
            self._record(detector, "ood", train_key, test_key, outcome)


def _test_draw(seed: int, train_key: str, test_key: str) -> np.random.Generator:
    """The generator of one OOD row's balanced test draw: by the seed and the row alone, so every
    detector is tested on the same rows (paired), whatever ran before it."""
    return np.random.default_rng([seed, zlib.crc32(f"{train_key}>{test_key}".encode())])


def _paired(clean: Samples, abnormal: Samples) -> tuple[Samples, Samples]:
    """The clean counterparts of an attacked set's source images (the seed's balanced pairs)."""
    return clean.take(np.isin(clean.indices, abnormal.indices)), abnormal


def _positional_half(samples: Samples, seed: int, *, first: bool) -> Samples:
    order = np.random.default_rng(seed).permutation(len(samples))
    half = len(order) // 2
    return samples.take(np.sort(order[:half] if first else order[half:]))


def calibrated_threshold(
    detector: Detector, calibration_clean: Samples, target_fpr: float
) -> float:
    """A fitted detector's threshold at ``target_fpr`` on held-out clean samples of the training
    side."""
    return calibrate_threshold(detector.score_samples(calibration_clean), target_fpr)


def evaluate_fitted(
    detector: Detector,
    calibration_clean: Samples,
    test_clean: Samples,
    test_abnormal: Samples,
    target_fpr: float,
    *,
    calibrated: float | None = None,
) -> Outcome:
    """Metrics of a fitted detector on a balanced test set, at its own decision and at the threshold
    calibrated on held-out clean samples of the training side (``calibrated``: that threshold,
    already computed from the same samples and target, for a detector tested on several sets)."""
    if calibrated is None:
        calibrated = calibrated_threshold(detector, calibration_clean, target_fpr)
    scores = np.concatenate(
        [detector.score_samples(test_clean), detector.score_samples(test_abnormal)]
    ).astype(np.float32)
    is_abnormal = np.concatenate(
        [np.zeros(len(test_clean), bool), np.ones(len(test_abnormal), bool)]
    )
    success = None
    if test_abnormal.success is not None:
        success = np.concatenate(
            [np.zeros(len(test_clean), bool), test_abnormal.success.astype(bool)]
        )
    own = detector.decision_threshold()
    threshold = own if own is not None else calibrated
    metrics = {
        k: float(v)
        for k, v in detection_metrics(
            is_abnormal, scores, threshold, attack_success=success
        ).items()
        if v is not None
    }
    at_calibrated = detection_metrics(is_abnormal, scores, calibrated)
    metrics["calibrated_tpr"] = float(at_calibrated["tpr"])
    metrics["calibrated_fpr"] = float(at_calibrated["fpr"])
    metrics["n_test"] = float(len(scores))
    return Outcome(metrics, is_abnormal, scores)


def on_all_cores(detector: Detector) -> Detector:
    """The detector fitting on every core when it has an ``n_jobs`` (same results, less time)."""
    if "n_jobs" in detector.get_params():
        detector.set_params(n_jobs=-1)
    return detector


def save_first_scores(records: Sequence[ExperimentRecord], directory: Path) -> None:
    """RUN/scores/<model>/<detector>/<setting>/<train>__<test>.npz of the first seed (for ROC curves)."""
    for rec in records:
        if not rec.outcomes:
            continue
        path = directory / rec.model / rec.detector / rec.setting / f"{rec.train}__{rec.test}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_npz(path, is_abnormal=rec.outcomes[0].is_abnormal, scores=rec.outcomes[0].scores)
