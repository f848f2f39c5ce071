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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm

from detector.calibration import calibrate_threshold
from detector.metrics import detection_metrics

CALIBRATION_FRACTION = 0.1
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

    def take(self, mask: np.ndarray) -> Samples:
        return Samples(
            self.name,
            self.images[mask],
            self.features[mask],
            self.predicted[mask],
            self.indices[mask],
            None if self.success is None else self.success[mask],
            {k: v[mask] for k, v in self.extra.items()},
        )

    def __len__(self) -> int:
        return len(self.indices)


def concat(parts: Sequence[Samples], name: str = "mixed") -> Samples:
    success = None
    if all(p.success is not None for p in parts):
        success = np.concatenate([p.success for p in parts])  # type: ignore[misc]
    shared = set.intersection(*(set(p.extra) for p in parts)) if parts else set()
    return Samples(
        name,
        np.concatenate([p.images for p in parts]),
        np.concatenate([p.features for p in parts]),
        np.concatenate([p.predicted for p in parts]),
        np.concatenate([p.indices for p in parts]),
        success,
        {k: np.concatenate([p.extra[k] for p in parts]) for k in shared},
    )


class DetectorRunner(Protocol):
    """What an experiment needs of a detector: fit on clean vs abnormal, then score (higher = abnormal)."""

    name: str
    default_threshold: (
        float | None
    )  # the detector's own decision (forest vote); None: use the calibrated one

    def fit(self, clean: Samples, abnormal: Samples, seed: int) -> None: ...

    def score(self, samples: Samples) -> np.ndarray: ...


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


def _fit_and_evaluate(
    runner: DetectorRunner,
    train_clean: Samples,
    train_abnormal: Samples,
    calibration_clean: Samples,
    test_clean: Samples,
    test_abnormal: Samples,
    seed: int,
    target_fpr: float,
) -> Outcome:
    runner.fit(train_clean, train_abnormal, seed)
    return _evaluate_fitted(runner, calibration_clean, test_clean, test_abnormal, target_fpr)


def _balanced(
    clean: Samples, abnormal: Samples, rng: np.random.Generator
) -> tuple[Samples, Samples]:
    """Trim the larger side so both have the same count (the seed's balanced sets)."""
    n = min(len(clean), len(abnormal))
    pick = lambda s: s if len(s) == n else s.take(np.sort(rng.choice(len(s), n, replace=False)))  # noqa: E731
    return pick(clean), pick(abnormal)


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
        for key in keys:
            values = np.array([o.metrics[key] for o in self.outcomes])
            row[key] = float(values.mean())
            row[f"{key}_std"] = float(values.std())
        row["runs"] = len(self.outcomes)
        row["n_test"] = int(np.mean([o.metrics["n_test"] for o in self.outcomes]))
        return row


def run_protocols(
    *,
    model: str,
    clean: Samples,
    attacks: dict[str, Samples],
    ood_sets: dict[str, Samples],
    runners: Sequence[Callable[[], DetectorRunner]],
    seen: Sequence[str],
    unseen_train: str | None,
    ood_train: Sequence[str],
    seeds: Sequence[int],
    test_fraction: float = 0.1,
    target_fpr: float = 0.05,
    noisy_copies: Samples | None = None,
    progress: bool = True,
) -> list[ExperimentRecord]:
    """Run seen, unseen and OOD experiments for every detector over ``seeds``.

    ``attacks`` and ``clean`` rows carry test-image indices; ``ood_sets`` are external (their
    rows are split by position). ``noisy_copies`` (noised clean images, labelled clean) are added
    to the training side when given.
    """
    universe = int(max(clean.indices.max(), *(a.indices.max() for a in attacks.values()))) + 1
    records: dict[tuple[str, str, str, str], ExperimentRecord] = {}
    jobs = len(seeds) * len(runners) * (len(seen) + (1 if unseen_train else 0) + len(ood_train))
    bar = tqdm(
        total=jobs,
        desc=f"detection experiments ({model})",
        disable=not progress,
        dynamic_ncols=True,
    )

    def record(detector: str, setting: str, train: str, test: str, outcome: Outcome) -> None:
        key = (detector, setting, train, test)
        records.setdefault(
            key, ExperimentRecord(model, detector, setting, train, test)
        ).outcomes.append(outcome)

    for seed in seeds:
        split = Split(seed, test_fraction, universe)
        rng = np.random.default_rng(seed)
        train_clean_all = split.train(clean)
        if noisy_copies is not None:
            train_clean_all = concat([train_clean_all, split.train(noisy_copies)], "clean+noise")
        calibration_clean = split.calibration(clean)
        test_clean_all = split.test(clean)
        for make_runner in runners:
            runner = make_runner()

            for key in seen:
                train_clean, train_abnormal = _paired(train_clean_all, split.train(attacks[key]))
                test_clean, test_abnormal = _paired(test_clean_all, split.test(attacks[key]))
                outcome = _fit_and_evaluate(
                    runner,
                    train_clean,
                    train_abnormal,
                    calibration_clean,
                    test_clean,
                    test_abnormal,
                    seed,
                    target_fpr,
                )
                record(runner.name, "seen", key, key, outcome)
                bar.update()
            if unseen_train:
                train_clean, train_abnormal = _paired(
                    train_clean_all, split.train(attacks[unseen_train])
                )
                runner.fit(train_clean, train_abnormal, seed)
                for key in attacks:
                    if key == unseen_train:
                        continue
                    test_clean, test_abnormal = _paired(test_clean_all, split.test(attacks[key]))
                    outcome = _evaluate_fitted(
                        runner, calibration_clean, test_clean, test_abnormal, target_fpr
                    )
                    record(runner.name, "unseen", unseen_train, key, outcome)
                bar.update()
            for train_key in ood_train:
                source = attacks[train_key] if train_key in attacks else ood_sets[train_key]
                if train_key in attacks:
                    train_clean, train_abnormal = _paired(
                        train_clean_all, split.train(attacks[train_key])
                    )
                else:
                    train_abnormal = _positional_half(source, seed, first=True)
                    train_clean, train_abnormal = _balanced(train_clean_all, train_abnormal, rng)
                runner.fit(train_clean, train_abnormal, seed)
                for test_key, ood in ood_sets.items():
                    if test_key == train_key:
                        continue
                    test_ood = _positional_half(ood, seed, first=False) if ood is source else ood
                    test_clean, test_ood = _balanced(test_clean_all, test_ood, rng)
                    outcome = _evaluate_fitted(
                        runner, calibration_clean, test_clean, test_ood, target_fpr
                    )
                    record(runner.name, "ood", train_key, test_key, outcome)
                bar.update()
    bar.close()
    return list(records.values())


def _paired(clean: Samples, abnormal: Samples) -> tuple[Samples, Samples]:
    """The clean counterparts of an attacked set's source images (the seed's balanced pairs)."""
    return clean.take(np.isin(clean.indices, abnormal.indices)), abnormal


def _positional_half(samples: Samples, seed: int, *, first: bool) -> Samples:
    order = np.random.default_rng(seed).permutation(len(samples))
    half = len(order) // 2
    return samples.take(np.sort(order[:half] if first else order[half:]))


def _evaluate_fitted(
    runner: DetectorRunner,
    calibration_clean: Samples,
    test_clean: Samples,
    test_abnormal: Samples,
    target_fpr: float,
) -> Outcome:
    """Metrics of a fitted runner on a balanced test set, at its own decision and at the threshold
    calibrated on held-out clean samples of the training side."""
    calibrated = calibrate_threshold(runner.score(calibration_clean), target_fpr)
    scores = np.concatenate([runner.score(test_clean), runner.score(test_abnormal)]).astype(
        np.float32
    )
    is_abnormal = np.concatenate(
        [np.zeros(len(test_clean), bool), np.ones(len(test_abnormal), bool)]
    )
    success = None
    if test_abnormal.success is not None:
        success = np.concatenate(
            [np.zeros(len(test_clean), bool), test_abnormal.success.astype(bool)]
        )
    threshold = runner.default_threshold if runner.default_threshold is not None else calibrated
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


def save_first_scores(records: Sequence[ExperimentRecord], directory: Path) -> None:
    """RUN/scores/<model>/<detector>/<setting>/<train>__<test>.npz of the first seed (for ROC curves)."""
    for rec in records:
        if not rec.outcomes:
            continue
        path = directory / rec.model / rec.detector / rec.setting / f"{rec.train}__{rec.test}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, is_abnormal=rec.outcomes[0].is_abnormal, scores=rec.outcomes[0].scores)
