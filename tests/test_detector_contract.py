"""Every registered detector through the one contract: fit_samples / score_samples on a tiny
network's samples, higher = more abnormal, and the torch form equal to the numpy one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from detector.base import Detector
from detector.bundle import DetectorSpec, detector_kind
from detector.errors import ArtefactError, ConfigError
from detector.features import FeatureSpec, extract_features
from detector.registry import (
    detector_info,
    detector_name,
    get_detector,
    list_detectors,
    load_detector,
)
from training.evaluation.protocols import Samples

SMALL = {
    "transport": {"n_estimators": 20},
    "mahalanobis": {"magnitudes": (0.0, 0.01), "n_estimators": 20, "selection_samples": 100},
    "nss": {"n_estimators": 20},
    "quantile": {},
    "novelty": {},
    "ensemble": {"n_estimators": 20},
}


def _samples(model: torch.nn.Module, images: np.ndarray, name: str) -> Samples:
    features, logits = extract_features(model, images)
    return Samples(name, images, features, logits.argmax(1), np.arange(len(images)))


@pytest.fixture(scope="module")
def image_sets() -> dict[str, np.ndarray]:
    """Smooth 'clean' images (blurred blobs) and uniform noise: easy to tell apart."""
    rng = np.random.default_rng(0)
    base = rng.random((240, 1, 7, 7), dtype=np.float32)
    smooth = np.kron(base, np.ones((1, 1, 4, 4), np.float32)) * 0.5 + 0.25
    noise = rng.random((120, 1, 28, 28), dtype=np.float32)
    return {"clean": smooth, "noise": noise}


def test_registry_lists_every_detector_with_its_metadata() -> None:
    assert list_detectors() == [
        "ensemble",
        "mahalanobis",
        "novelty",
        "nss",
        "quantile",
        "transport",
    ]
    assert list_detectors(servable=True) == ["ensemble", "novelty", "quantile", "transport"]
    assert {n: detector_info(n).short_name for n in list_detectors()} == {
        "ensemble": "TR+NV",
        "novelty": "NV",
        "mahalanobis": "MH",
        "nss": "NS",
        "quantile": "QT",
        "transport": "TR",
    }
    assert detector_info("transport").default_threshold == 0.5
    assert detector_info("quantile").default_threshold is None
    assert not detector_info("quantile").supervised
    assert detector_info("mahalanobis").reads == "network"
    with pytest.raises(ConfigError, match="unknown detector 'forest'"):
        get_detector("forest")
    with pytest.raises(ConfigError, match="bad parameters"):
        get_detector("quantile", n_estimators=3)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_detector_fits_and_scores_through_the_contract(
    name: str, tiny_network: torch.nn.Module, image_sets: dict[str, np.ndarray], tmp_path: Path
) -> None:
    assert sorted(SMALL) == list_detectors()  # a new detector needs its row here
    clean = _samples(tiny_network, image_sets["clean"][:120], "clean")
    held_out = _samples(tiny_network, image_sets["clean"][120:], "clean")
    noise = _samples(tiny_network, image_sets["noise"], "noise")
    train_noise, test_noise = noise.take(np.arange(60)), noise.take(np.arange(60, 120))
    prototype = get_detector(name, **SMALL[name])
    assert isinstance(prototype, Detector) and detector_name(prototype) == name
    prototype.prepare(tiny_network, clean.images, clean.predicted)
    for samples in (clean, held_out, noise, train_noise, test_noise):
        samples.extra.update(prototype.precompute(tiny_network, samples.images))

    detector = prototype.with_seed(3).fit_samples(clean, train_noise)
    again = prototype.with_seed(3).fit_samples(clean, train_noise)
    scores_clean = detector.score_samples(held_out)
    scores_noise = detector.score_samples(test_noise)
    assert scores_clean.dtype == np.float64 and scores_clean.shape == (120,)
    assert scores_noise.mean() > scores_clean.mean()  # HIGHER = MORE ABNORMAL
    np.testing.assert_array_equal(again.score_samples(test_noise), scores_noise)
    own = detector.decision_threshold()
    assert own == again.decision_threshold()
    if "decision" in detector.get_params():  # the forest detectors learn their own decision
        assert own is not None and 0 <= own <= 1
        majority = prototype.with_seed(3).set_params(decision="majority")
        assert majority.fit_samples(clean, train_noise).decision_threshold() == 0.5
    else:
        assert own == detector.info.default_threshold

    if not detector.info.servable:
        with pytest.raises(ConfigError, match="no torch form"):
            detector.to_torch()
        return
    both = [held_out, test_noise]
    numpy_scores = np.concatenate([detector.score_samples(s) for s in both])
    features = torch.from_numpy(np.concatenate([detector.serving_rows(s) for s in both]))
    predicted = torch.from_numpy(np.concatenate([s.predicted for s in both]))
    with torch.inference_mode():
        torch_scores = detector.to_torch()(features, predicted).numpy()
    assert torch_scores.dtype == np.float32
    assert np.array_equal(torch_scores, numpy_scores.astype(np.float32))
    restored = load_detector(detector.save(tmp_path / name))
    assert type(restored) is type(detector)
    assert restored.decision_threshold() == own
    assert np.array_equal(
        np.concatenate([restored.score_samples(s) for s in both]).astype(np.float32),
        torch_scores,
    )


def test_bundles_hold_only_servable_detectors() -> None:
    assert detector_kind(get_detector("quantile")) == "quantile"
    with pytest.raises(
        ArtefactError, match="bundles hold ensemble or novelty or quantile or transport detectors"
    ):
        detector_kind(get_detector("nss"))
    spec = {"params": {}, "feature_names": ["msq_0", "cos_0"]}
    assert DetectorSpec(kind="transport", **spec).feature_spec == FeatureSpec()
    with pytest.raises(ValidationError, match="detector kind must be one of"):
        DetectorSpec(kind="mahalanobis", **spec)
