"""The adaptive attacker on a finished run: the deployed ensemble as its target reads the same
columns (trajectory features + penultimate embedding) in its Guard, in the attacker's
knowledge and in the surrogate it distils."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from detector.errors import ArtefactError
from detector.features import penultimate_width
from training.adaptive.experiment import build_attacker, part_flags, target_margins
from training.adaptive.target import TARGET_FILE, TargetSpec, fit_target, target_dir
from training.evaluation.context import PipelineRun

pytestmark = pytest.mark.slow  # the smoke run


def test_an_ensemble_target_and_its_attacker_read_the_penultimate_embedding(
    smoke_run: Path, tmp_path: Path
) -> None:
    run_dir = shutil.copytree(smoke_run, tmp_path / "run")
    run = PipelineRun.open(run_dir, progress=False)
    name = run.config.deploy_model
    target = fit_target(run, name, TargetSpec("ensemble"))
    width = penultimate_width(run.model(name))
    assert target.features.penultimate == width
    assert target.guard.feature_names[-width:] == [f"pen_{i}" for i in range(width)]

    attacker = build_attacker(run, name, target, surrogate=True)
    assert attacker.reference_features.shape[1] == len(target.guard.feature_names)
    assert attacker.surrogate_agreement is not None and attacker.surrogate_agreement > 0.5

    # What the attacker computes from rows is what the Guard answers for the images.
    clean = run.samples(name).clean.take(np.arange(30))
    rows = target.detectors[0].serving_rows(clean)
    expected = target.guard.predict(clean.images).scores - target.calibrations[0].threshold
    np.testing.assert_allclose(target_margins(target, rows, clean.predicted), expected, atol=1e-5)

    # Each part alone flags no more than the ensemble and together no less (max of the parts).
    images = run.samples(name).attacks[sorted(run.samples(name).attacks)[0]].images[:40]
    shares = part_flags(attacker, images, clean.images)
    assert list(shares)[0] == "forests" and "penultimate" in shares
    for i, x in enumerate((images, clean.images)):
        flagged = target.flagged(x)[1].mean()
        each = [share[i] for share in shares.values()]
        assert max(each) <= flagged + 1e-9 and flagged <= sum(each) + 1e-9

    # Resumed from disk (a fresh process), the target serves the same columns and scores.
    again = fit_target(PipelineRun.open(run_dir, progress=False), name, TargetSpec("ensemble"))
    assert again.features == target.features
    np.testing.assert_allclose(
        again.guard.predict(clean.images).scores, target.guard.predict(clean.images).scores
    )

    # A damaged cache is refused by name, not read into a wrong threshold.
    saved = target_dir(run, name, TargetSpec("ensemble")) / TARGET_FILE
    info = json.loads(saved.read_text())
    for calibrations in ([], [{**info["calibrations"][0], "threshold": None}]):
        saved.write_text(json.dumps({**info, "calibrations": calibrations}))
        with pytest.raises(ArtefactError, match="calibration"):
            fit_target(run, name, TargetSpec("ensemble"))
