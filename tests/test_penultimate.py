"""The penultimate embedding (the extractor's last columns) and the ensemble's part on it: the
distance to the nearest clean image there, its clean CDF ramped over the far tail, in the bundle
and the Guard."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from detector import networks
from detector.bundle import load_bundle, write_bundle
from detector.calibration import Calibration
from detector.ensemble import EnsembleDetector
from detector.errors import ArtefactError, ConfigError, InputError
from detector.features import FeatureSpec, extract_features, penultimate_width
from detector.guard import Guard
from detector.penultimate import (
    PENULTIMATE_KEY,
    EmbeddingScorer,
    embedding_arrays,
    penultimate_embedding,
)
from tests.test_bundle_guard import _images
from training.evaluation.protocols import Samples


def test_the_last_columns_are_the_unit_input_of_the_last_linear_layer(
    tiny_network: torch.nn.Module,
) -> None:
    width = penultimate_width(tiny_network)
    spec = FeatureSpec(head=True, penultimate=width)
    x = _images(12, 0, False)
    features, _ = extract_features(tiny_network, x, spec=spec)
    with torch.no_grad():
        t = torch.from_numpy(x)
        hidden = tiny_network.head[:-1](
            tiny_network.blocks(tiny_network.stem(tiny_network.normalize(t)))
        )
    expected = (hidden / hidden.norm(dim=1, keepdim=True)).numpy()
    np.testing.assert_allclose(features[:, -width:], expected, atol=1e-5)
    names = spec.names(len(tiny_network.blocks))
    assert names[-width:] == [f"pen_{i}" for i in range(width)] and len(names) == features.shape[1]
    assert spec.label() == "residues+head+pen"
    # The same columns from the one helper the training side precomputes with.
    np.testing.assert_allclose(penultimate_embedding(tiny_network, x), features[:, -width:])
    with pytest.raises(ConfigError, match="another network"):
        extract_features(tiny_network, x, spec=FeatureSpec(penultimate=width + 1))
    with pytest.raises(InputError, match="penultimate"):
        FeatureSpec(penultimate=-1)


def test_the_part_scores_the_clean_cdf_of_the_nearest_clean_distance() -> None:
    rng = np.random.default_rng(0)
    clean = rng.normal(size=(200, 4)).astype(np.float32)
    arrays = embedding_arrays(clean)
    # Each clean row's reference distance is to its nearest OTHER row (brute force).
    d = ((clean[:, None, :] - clean[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    np.testing.assert_allclose(arrays["reference"], np.sort(d.min(1)), rtol=1e-4, atol=1e-5)
    scorer = EmbeddingScorer(arrays, 4)
    with torch.inference_mode():
        fresh = scorer(torch.from_numpy(rng.normal(size=(400, 4)).astype(np.float32)))
        far = scorer(torch.full((3, 4), 10.0))
        itself = scorer(torch.from_numpy(clean[:5]))
    assert 0.3 < float(fresh.mean()) < 0.7  # about uniform on clean inputs
    assert (far == 1.0).all() and (itself == 0.0).all()
    with pytest.raises(ArtefactError, match="points"):
        EmbeddingScorer({"points": clean[:, :3], "reference": arrays["reference"]}, 4)
    with pytest.raises(ArtefactError, match="must be"):
        EmbeddingScorer({"points": clean}, 4)
    with pytest.raises(InputError, match="4-wide"):
        scorer(torch.zeros(2, 3))


def _samples(name: str, features: np.ndarray, embedding: np.ndarray | None) -> Samples:
    n = len(features)
    extra = {} if embedding is None else {PENULTIMATE_KEY: embedding}
    return Samples(
        name, np.zeros((n, 1, 2, 2), np.float32), features, np.zeros(n, int), np.arange(n),
        extra=extra,
    )  # fmt: skip


def _fitted(with_embedding: bool) -> tuple[EnsembleDetector, np.ndarray, np.ndarray]:
    """An ensemble on 3 trajectory columns (+ a 4-wide embedding on the unit sphere)."""
    rng = np.random.default_rng(1)
    clean_x = rng.normal(size=(300, 3)).astype(np.float32)
    attacked_x = rng.normal(3.0, 1.0, size=(300, 3)).astype(np.float32)
    around = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    embedding = around + rng.normal(0, 0.05, (600, 4)).astype(np.float32)
    embedding /= np.linalg.norm(embedding, axis=1, keepdims=True)
    clean = _samples("clean", clean_x, embedding[:300] if with_embedding else None)
    attacked = _samples("attacked", attacked_x, embedding[300:] if with_embedding else None)
    detector = EnsembleDetector(n_estimators=10, min_class_samples=5).fit_samples(clean, attacked)
    return detector, clean_x, embedding


def test_the_ensemble_flags_an_input_far_from_clean_in_the_embedding_only() -> None:
    detector, clean_x, embedding = _fitted(with_embedding=True)
    assert detector.penultimate_width_ == 4 and detector.n_features_in_ == 7
    assert detector.forests_.n_features_in_ == 3  # the forests never read the embedding
    inside = _samples("inside", clean_x[:50], embedding[:50])
    elsewhere = np.tile(np.array([0.0, 1.0, 0.0, 0.0], np.float32), (50, 1))
    outside = _samples("outside", clean_x[:50], elsewhere)
    assert (detector.score_samples(outside) == 1.0).all()  # the same trajectory, another place
    assert np.mean(detector.score_samples(inside) > 0.5) < 0.2
    without, _, _ = _fitted(with_embedding=False)
    assert without.penultimate_width_ == 0 and without.n_features_in_ == 3
    assert np.mean(without.score(clean_x[:50], np.zeros(50, int)) > 0.5) < 0.2
    # The torch form reads the embedding from the features' last columns, as the Guard gives them.
    both = np.concatenate([clean_x[:50], elsewhere], axis=1)
    with torch.inference_mode():
        torch_scores = detector.to_torch()(
            torch.from_numpy(both), torch.zeros(50, dtype=torch.long)
        )
    np.testing.assert_allclose(torch_scores.numpy(), detector.score_samples(outside), atol=1e-6)
    assert detector.serving_features(FeatureSpec(head=True)) == FeatureSpec(
        head=True, penultimate=4
    )
    with pytest.raises(InputError, match="precompute"):
        detector.score_samples(_samples("bare", clean_x[:5], None))


def test_the_part_travels_as_arrays_and_old_ensembles_load_without_it() -> None:
    detector, clean_x, embedding = _fitted(with_embedding=True)
    arrays, params = detector.to_arrays()
    assert params["penultimate_width"] == 4 and arrays["penultimate.points"].shape == (300, 4)
    loaded = EnsembleDetector.from_arrays(arrays, params)
    both = np.concatenate([clean_x[:40], embedding[:40]], axis=1)
    labels = np.zeros(40, int)
    np.testing.assert_array_equal(loaded.score(both, labels), detector.score(both, labels))
    old_params = {
        k: v for k, v in params.items() if k not in ("penultimate_tail", "penultimate_width")
    }
    old_params["n_features_in"] = 3
    old_arrays = {k: v for k, v in arrays.items() if not k.startswith("penultimate.")}
    old = EnsembleDetector.from_arrays(old_arrays, old_params)
    assert old.penultimate_tail == 0.0 and old.penultimate_width_ == 0
    with pytest.raises(ArtefactError, match="penultimate"):
        EnsembleDetector.from_arrays(arrays, {**params, "penultimate_tail": 0.0})
    broken = {**arrays, "penultimate.points": arrays["penultimate.points"][:, :3]}
    with pytest.raises(ArtefactError, match="points"):
        EnsembleDetector.from_arrays(broken, params)
    with pytest.raises(InputError, match="penultimate_tail is 0"):
        EnsembleDetector(penultimate_tail=0.0, n_estimators=5).fit(
            np.concatenate([clean_x, embedding[:300]], 1), np.r_[np.zeros(150), np.ones(150)],
            np.zeros(300, int), penultimate_columns=4,
        )  # fmt: skip


def test_a_bundle_with_the_part_scores_in_the_guard_as_the_detector(
    tmp_path: Path, tiny_network: torch.nn.Module
) -> None:
    network_dir = networks.save(tiny_network, tmp_path / "network")
    spec = FeatureSpec(head=True)
    clean_x, noisy_x = _images(80, 0, False), _images(80, 1, True)

    def samples(name: str, x: np.ndarray) -> Samples:
        features, logits = extract_features(tiny_network, x, spec=spec)
        rows = Samples(name, x, features, logits.argmax(1), np.arange(len(x)))
        rows.feature_names = tuple(spec.names(len(tiny_network.blocks)))
        prototype = EnsembleDetector(n_estimators=10, min_class_samples=5)
        rows.extra.update(prototype.precompute(tiny_network, x))
        return rows

    detector = EnsembleDetector(n_estimators=10, min_class_samples=5).fit_samples(
        samples("clean", clean_x), samples("noisy", noisy_x)
    )
    served = detector.serving_features(spec)
    assert served.penultimate == penultimate_width(tiny_network)
    out = write_bundle(
        tmp_path / "bundle",
        network_dir=network_dir,
        detector=detector,
        calibration=Calibration.from_scores(detector.score_samples(samples("c", clean_x)), 0.1),
        name="pen",
        dataset="d",
        features=served,
    )
    assert load_bundle(out).manifest.detector.feature_spec == served
    x = np.concatenate([_images(10, 2, False), _images(10, 3, True)])
    guard = Guard.from_bundle(out, device="cpu")
    expected = detector.score_samples(samples("test", x))
    np.testing.assert_allclose(guard.predict(x).scores, expected, atol=1e-5)
    # Which part flags an input: the parts' max is the score, in any chunking.
    guard.batch_size = 7
    parts = guard.part_scores(x)
    assert list(parts)[0] == "forests" and "penultimate" in parts
    assert all(score.shape == (len(x),) for score in parts.values())
    np.testing.assert_allclose(np.max(np.stack(list(parts.values())), 0), expected, atol=1e-5)
