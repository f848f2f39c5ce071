"""Synthetic outliers: the six transforms, and the deployed ensemble that learns them as a family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from detector.errors import ConfigError, InputError
from training.data.synthetic_outliers import SYNTHETIC_TRANSFORMS, synthetic_outliers


def _images(n: int, c: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, c, h, w), dtype=np.float32)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (3, 16, 24)])
def test_outliers_keep_shape_and_range_and_cycle_through_the_transforms(shape) -> None:
    x = _images(14, *shape)
    out, kinds = synthetic_outliers(x, (0.0, 1.0), seed=3)
    assert out.shape == x.shape and out.dtype == np.float32
    assert out.min() >= 0.0 and out.max() <= 1.0
    names = list(SYNTHETIC_TRANSFORMS)
    assert kinds.tolist() == [names[i % 6] for i in range(14)]
    assert all(not np.allclose(out[i], x[i]) for i in range(14))  # every row is changed
    again, _ = synthetic_outliers(x, (0.0, 1.0), seed=3)
    np.testing.assert_array_equal(out, again)  # seeded: the same outliers every time


def test_each_transform_does_what_its_name_says() -> None:
    x = _images(12, 1, 28, 28)
    out, kinds = synthetic_outliers(x, (-1.0, 1.0))
    row = {name: int(np.flatnonzero(kinds == name)[0]) for name in SYNTHETIC_TRANSFORMS}
    i = row["rot90"]
    np.testing.assert_array_equal(out[i], np.rot90(x[i], 1, axes=(1, 2)))
    i = row["upside-down"]
    np.testing.assert_array_equal(out[i], x[i, :, ::-1])
    i = row["inverted"]
    np.testing.assert_allclose(out[i], np.clip(-x[i], -1, 1))  # low + high - x, range (-1, 1)
    i = row["tiles-shuffled"]  # the same 7 x 7 tiles, in another order

    def tiles(a: np.ndarray) -> list[bytes]:
        return sorted(
            a[0, r : r + 7, c : c + 7].tobytes() for r in range(0, 28, 7) for c in range(0, 28, 7)
        )

    assert tiles(out[i]) == tiles(x[i]) and not np.array_equal(out[i], x[i])
    i = row["zoomed"]  # the centre 14 x 14, each pixel now 2 x 2
    np.testing.assert_array_equal(out[i, 0, ::2, ::2], x[i, 0, 7:21, 7:21])
    i = row["shrunk"]  # a 14 x 14 copy on a blank canvas at the range's low end
    assert (out[i, 0, :7] == -1).all() and (out[i, 0, 21:] == -1).all()
    np.testing.assert_allclose(out[i, 0, 7, 7], x[i, 0, :2, :2].mean(), rtol=1e-5)


@pytest.mark.parametrize("bad", [np.zeros((4, 28, 28)), np.zeros((4, 1, 2, 2))])
def test_other_shapes_are_refused(bad) -> None:
    with pytest.raises(InputError, match="expected images"):
        synthetic_outliers(bad, (0.0, 1.0))


def _copy_with_synthetic(smoke_run: Path, out: Path, n: int) -> Path:
    """The smoke run's networks, attacks and features under ``out``, its config asking for ``n``
    synthetic outliers in the deployed ensemble."""
    for part in ("models", "attacks", "features"):
        shutil.copytree(smoke_run / part, out / part)
    config = json.loads((smoke_run / "pipeline_config.json").read_text())
    config["deploy_synthetic_outliers"] = n
    (out / "pipeline_config.json").write_text(json.dumps(config))
    return out


# The smoke networks' weak forests score some clean fitting images at 1.0 by the trees that never
# saw them (13 of 231 once), so the calibration may saturate and says so; this test reads AUROC.
@pytest.mark.filterwarnings("ignore::detector.calibration.CalibrationWarning")
def test_deployed_ensemble_learns_synthetic_outliers_of_images_it_never_saw(
    smoke_run, data_root, tmp_path
) -> None:
    """With synthetic outliers, the shipped ensemble holds a 'synthetic' family and flags the
    outliers made from held-out (test-side) clean images apart from held-out clean images far
    better than the smoke run's own ensemble does (AUROC); deployable.json records what it learnt."""
    from training.evaluation.context import PipelineRun
    from training.evaluation.deployable import SPLIT_SEED, fit_deployable, load_deployable
    from training.evaluation.protocols import Split

    run_dir = _copy_with_synthetic(smoke_run, tmp_path / "run", 200)
    run = PipelineRun.open(run_dir, root=data_root)
    fit_deployable(run)
    with_outliers, with_calibration, info = load_deployable(run_dir)
    without, without_calibration, plain = load_deployable(smoke_run)
    assert info["synthetic_outliers"] == {"rows": 200, "transforms": list(SYNTHETIC_TRANSFORMS)}
    assert info["families"] == ["fgm", "synthetic"] and plain["families"] == []
    assert plain["synthetic_outliers"]["rows"] == 0

    name = run.config.deploy_model
    clean = run.samples(name).clean
    split = Split(SPLIT_SEED, run.config.test_fraction, int(clean.indices.max()) + 1)
    held_out = split.test(clean)
    images, _ = synthetic_outliers(held_out.images, (0.0, 1.0), seed=1)
    samples = run.image_samples(name, "held-out-synthetic", images, held_out.indices)
    samples.extra.update(with_outliers.precompute(run.model(name), images))

    held_out.extra.update(with_outliers.precompute(run.model(name), held_out.images))
    truth = np.r_[np.zeros(len(held_out)), np.ones(len(samples))]

    def auroc(detector) -> float:
        scores = np.r_[detector.score_samples(held_out), detector.score_samples(samples)]
        return float(roc_auc_score(truth, scores))

    # Threshold-free: the smoke run's calibration images (120 of the slice, ~230 of its own
    # fitting images) can put the threshold at the score's maximum, 1.0, where nothing is
    # flagged (seen with torch 2.14's smoke networks).
    learnt, before = auroc(with_outliers), auroc(without)
    assert learnt > before + 0.1, (learnt, before)
    assert info["heldout"]["fpr"] < 0.2  # still a detector, not a flag on everything
    # ... and a threshold at the score's maximum is recorded as what it is
    assert info["calibration"]["saturated"] == (with_calibration.threshold >= 1.0)


def test_a_changed_count_refits_and_an_impossible_one_is_refused(
    smoke_run, data_root, tmp_path
) -> None:
    from training.evaluation.context import PipelineRun
    from training.evaluation.deployable import fit_deployable

    run_dir = _copy_with_synthetic(smoke_run, tmp_path / "run", 0)
    shutil.copytree(smoke_run / "detector", run_dir / "detector")
    before = (run_dir / "detector" / "deployable.json").read_text()
    fit_deployable(PipelineRun.open(run_dir, root=data_root))  # the same recipe: cached
    assert (run_dir / "detector" / "deployable.json").read_text() == before

    config = json.loads((run_dir / "pipeline_config.json").read_text())
    config["deploy_synthetic_outliers"] = 10**6
    (run_dir / "pipeline_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="training side has"):
        fit_deployable(PipelineRun.open(run_dir, root=data_root))
    assert (run_dir / "detector" / "deployable.json").read_text() == before  # nothing lost
