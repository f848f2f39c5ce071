"""Learning curves: nested training subsets of the seen protocol's split, ending at its result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from detector.forest import TransportDetector
from training.evaluation.learning_curves import curve_sizes, learning_curve
from training.evaluation.protocols import Samples, Sides, index_universe, run_protocols
from training.plots import plot_learning_curves
from training.presets.pipelines import PipelineConfig, get_pipeline_preset

SEEDS = (0, 1, 2)


def _samples(name: str, indices: np.ndarray, rng: np.random.Generator) -> Samples:
    """Gaussian features where clean rows have sign(f0) == sign(f1) and attacked rows the
    opposite: an XOR a forest learns only from enough pairs."""
    n = len(indices)
    features = rng.normal(0.0, 1.0, size=(n, 6)).astype(np.float32)
    features[:, 1] = (
        np.abs(features[:, 1]) * np.sign(features[:, 0]) * (1 if name == "clean" else -1)
    )
    return Samples(
        name,
        np.zeros((n, 1, 2, 2), np.float32),
        features,
        rng.integers(0, 3, n),
        indices.astype(np.int64),
        None if name == "clean" else rng.random(n) < 0.9,
    )


@pytest.fixture
def world() -> tuple[Samples, dict[str, Samples]]:
    """Clean images 0..599, an attack on all of them and one on the first 180 only (its
    training side: about 120 images, the calibration slice and the test side left out)."""
    rng = np.random.default_rng(0)
    universe = np.arange(600)
    clean = _samples("clean", universe, rng)
    attacks = {"fgm": _samples("fgm", universe, rng), "cw": _samples("cw", universe[:180], rng)}
    return clean, attacks


def _sides(clean: Samples, attacks: dict[str, Samples]) -> list[Sides]:
    universe = index_universe(clean, attacks)
    return [Sides.of(seed, 0.1, universe, clean, None) for seed in SEEDS]


def test_curve_sizes() -> None:
    assert curve_sizes(73) == [25, 50, 73]
    assert curve_sizes(400) == [25, 50, 100, 200, 400]
    assert curve_sizes(20) == [20]


def test_training_subsets_are_nested_pairs_and_the_test_side_is_fixed(world) -> None:
    clean, attacks = world
    side = _sides(clean, attacks)[0]
    (_, all_attacked), (all_test_clean, all_test) = side.pairs(attacks["fgm"])
    previous: set[int] = set()
    for n in (25, 50, 100):
        (train_clean, train_attacked), (test_clean, test_attacked) = side.pairs(attacks["fgm"], n)
        indices = set(train_attacked.indices.tolist())
        assert len(train_attacked) == n and previous <= indices
        assert set(train_clean.indices.tolist()) == indices  # each with its clean source
        assert indices <= set(all_attacked.indices.tolist())
        np.testing.assert_array_equal(test_attacked.indices, all_test.indices)
        np.testing.assert_array_equal(test_clean.indices, all_test_clean.indices)
        previous = indices


def test_curve_grows_to_the_seen_protocol_result(world) -> None:
    clean, attacks = world
    prototype = TransportDetector(n_estimators=20)
    points = learning_curve(prototype, _sides(clean, attacks), attacks["fgm"])
    pairs = [p["pairs"] for p in points]
    assert pairs[:-1] == [25, 50, 100, 200, 400] and pairs[-1] > 400
    assert all(0 <= p["accuracy"] <= 1 and 0 <= p["auroc"] <= 1 for p in points)
    assert all(p["runs"] == len(SEEDS) and p["accuracy_std"] >= 0 for p in points)
    assert points[-1]["accuracy"] > points[0]["accuracy"] + 0.2  # the XOR needs many pairs
    records = run_protocols(
        model="lap",
        clean=clean,
        attacks=attacks,
        ood_sets={},
        detectors=[prototype],
        seen=["fgm"],
        unseen_train=None,
        ood_train=[],
        seeds=SEEDS,
        progress=False,
    )
    seen = records[0].row()
    assert points[-1]["accuracy"] == seen["accuracy"]  # "all" pairs is the seen protocol
    assert points[-1]["accuracy_std"] == seen["accuracy_std"]


def test_small_attack_set_gives_sizes_below_its_smallest_training_side(world) -> None:
    clean, attacks = world
    sides = _sides(clean, attacks)
    available = [len(s.split.train(attacks["cw"])) for s in sides]
    points = learning_curve(TransportDetector(n_estimators=10), sides, attacks["cw"])
    assert [p["pairs"] for p in points] == [25, 50, 100, round(np.mean(available))]
    assert max(p["pairs"] for p in points[:-1]) < min(available)


def test_config_checks_learning_curve_attack_keys() -> None:
    config = get_pipeline_preset("smoke")
    assert config.learning_curve_attacks == []
    data = config.model_dump() | {"learning_curve_attacks": ["fgm-eps0.1"]}
    assert PipelineConfig.model_validate(data).learning_curve_attacks == ["fgm-eps0.1"]
    with pytest.raises(ValidationError, match="not one of the attack keys"):
        PipelineConfig.model_validate(config.model_dump() | {"learning_curve_attacks": ["cw"]})


def test_plot_learning_curves_writes_a_png(tmp_path: Path) -> None:
    points = [{"pairs": n, "accuracy": a, "accuracy_std": 0.02} for n, a in ((25, 0.6), (80, 0.7))]
    path = plot_learning_curves({"LAP": {"CW": points, "DF": points[:1]}}, tmp_path / "lc.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
