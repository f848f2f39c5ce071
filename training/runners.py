"""Adapters from the detectors of ``detector/`` to the experiments' ``DetectorRunner`` protocol.

Transport and quantile detectors read the trajectory features; Mahalanobis and NSS read images
(Mahalanobis also needs the network and clean training images for its class statistics).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from detector.forest import TransportDetector
from detector.mahalanobis import MahalanobisDetector
from detector.nss import NSSDetector
from detector.quantile import QuantileDetector
from training.experiments import DetectorRunner, Samples

VOTE_THRESHOLD = 0.5  # forests flag an input when more than half of the trees vote abnormal
SHORT_NAMES = {"transport": "TR", "mahalanobis": "MH", "nss": "NS", "quantile": "QT"}


def _labels(clean: Samples, abnormal: Samples) -> np.ndarray:
    return np.concatenate([np.zeros(len(clean), bool), np.ones(len(abnormal), bool)])


class TransportRunner:
    name = "transport"
    default_threshold: float | None = VOTE_THRESHOLD

    def __init__(self, n_estimators: int = 100) -> None:
        self.n_estimators = n_estimators
        self.detector: TransportDetector | None = None

    def fit(self, clean: Samples, abnormal: Samples, seed: int) -> None:
        self.detector = TransportDetector(
            n_estimators=self.n_estimators, random_state=seed, n_jobs=-1
        ).fit(
            np.concatenate([clean.features, abnormal.features]),
            _labels(clean, abnormal),
            np.concatenate([clean.predicted, abnormal.predicted]),
        )

    def score(self, samples: Samples) -> np.ndarray:
        assert self.detector is not None, "fit first"
        return self.detector.score(samples.features, samples.predicted)


class QuantileRunner:
    """Zero-shot: fitted on the clean side only; the abnormal training set is ignored."""

    name = "quantile"
    default_threshold: float | None = None  # its decision is the calibrated threshold

    def __init__(self) -> None:
        self.detector: QuantileDetector | None = None

    def fit(self, clean: Samples, abnormal: Samples, seed: int) -> None:
        self.detector = QuantileDetector().fit(clean.features)

    def score(self, samples: Samples) -> np.ndarray:
        assert self.detector is not None, "fit first"
        return self.detector.score(samples.features)


def mahalanobis_key(magnitude: float) -> str:
    """Name of the precomputed Mahalanobis features at ``magnitude`` in ``Samples.extra``."""
    return f"mahalanobis@{magnitude:g}"


class MahalanobisRunner:
    """Reads per-magnitude Mahalanobis features precomputed once per image set (``Samples.extra``):
    each fit only chooses the magnitude on its training side and grows a forest."""

    name = "mahalanobis"
    default_threshold: float | None = VOTE_THRESHOLD

    def __init__(self, statistics: MahalanobisDetector) -> None:
        self.statistics = (
            statistics  # fitted with fit_clean on clean training images, shared across fits
        )
        self.detector: MahalanobisDetector | None = None

    def fit(self, clean: Samples, abnormal: Samples, seed: int) -> None:
        detector = self.statistics.copy_statistics(random_state=seed, n_jobs=-1)
        features = {
            float(m): np.concatenate(
                [clean.extra[mahalanobis_key(m)], abnormal.extra[mahalanobis_key(m)]]
            )
            for m in detector.magnitudes
        }
        self.detector = detector.fit_features(features, _labels(clean, abnormal))

    def score(self, samples: Samples) -> np.ndarray:
        assert self.detector is not None, "fit first"
        return self.detector.score_features(
            samples.extra[mahalanobis_key(self.detector.magnitude_)]
        )


class NSSRunner:
    name = "nss"
    default_threshold: float | None = VOTE_THRESHOLD

    def __init__(self) -> None:
        self.detector: NSSDetector | None = None

    def fit(self, clean: Samples, abnormal: Samples, seed: int) -> None:
        self.detector = NSSDetector(random_state=seed).fit(
            np.concatenate([clean.images, abnormal.images]), _labels(clean, abnormal)
        )

    def score(self, samples: Samples) -> np.ndarray:
        assert self.detector is not None, "fit first"
        return self.detector.score(samples.images)


def runner_factories(
    names: list[str], *, mahalanobis_statistics: MahalanobisDetector | None = None
) -> list[Callable[[], DetectorRunner]]:
    """One factory per detector name; Mahalanobis needs statistics from ``fit_clean`` (built once)."""
    factories: list[Callable[[], DetectorRunner]] = []
    for name in names:
        if name == "transport":
            factories.append(TransportRunner)
        elif name == "quantile":
            factories.append(QuantileRunner)
        elif name == "nss":
            factories.append(NSSRunner)
        elif name == "mahalanobis":
            if mahalanobis_statistics is None:
                raise ValueError(
                    "the mahalanobis runner needs statistics fitted with MahalanobisDetector.fit_clean"
                )
            factories.append(lambda s=mahalanobis_statistics: MahalanobisRunner(s))
        else:
            raise ValueError(f"unknown detector {name!r}")
    return factories
