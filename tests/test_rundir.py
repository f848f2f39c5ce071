"""The run-directory layout: paths as existing runs have them on disk, and the metrics reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detector.errors import ArtefactError
from training.rundir import ModelDir, RunDir


def test_layout_matches_the_documented_run_directory(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path))
    relative = {
        "config": run.config_file,
        "evaluation": run.evaluation_file,
        "results": run.results_file,
        "report": run.report_file,
        "scores": run.scores,
        "figures": run.figures,
        "detector": run.detector_dir,
        "bundle": run.bundle,
        "model": run.model("lap"),
        "attacks": run.attacks("lap"),
        "features": run.features("lap", "fgm-test"),
        "mahalanobis": run.precomputed("lap", "mahalanobis", "fgm-test"),
        "nss": run.precomputed("lap", "nss", "fgm-test"),
    }
    assert {k: p.relative_to(tmp_path).as_posix() for k, p in relative.items()} == {
        "config": "pipeline_config.json",
        "evaluation": "evaluation.json",
        "results": "results.json",
        "report": "report.md",
        "scores": "scores",
        "figures": "figures",
        "detector": "detector",
        "bundle": "bundle",
        "model": "models/lap",
        "attacks": "attacks/lap",
        "features": "features/lap/fgm-test.npz",
        "mahalanobis": "features/lap/mahalanobis/fgm-test.npz",
        "nss": "features/lap/nss/fgm-test.npz",
    }
    model = run.model_dir("lap")
    assert model == ModelDir(tmp_path / "models" / "lap")
    assert [p.name for p in (model.metrics_file, model.steps_file, model.train_config_file)] == [
        "metrics.jsonl",
        "steps.jsonl",
        "train_config.json",
    ]
    assert not tmp_path.joinpath("models").exists()  # paths are computed, never created


def test_read_metrics_reads_every_epoch_and_names_a_corrupt_line(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.read_metrics("lap") == []  # not trained yet
    metrics = run.model_dir("lap").metrics_file
    metrics.parent.mkdir(parents=True)
    epochs = [{"epoch": 1, "test_transport": 2.5}, {"epoch": 2, "test_transport": 1.25}]
    metrics.write_text("".join(json.dumps(e) + "\n" for e in epochs) + "\n")
    assert run.read_metrics("lap") == epochs
    metrics.write_text(json.dumps(epochs[0]) + '\n{"epoch": 2, "test_tr\n')
    with pytest.raises(ArtefactError, match=r"metrics\.jsonl:2 is not valid JSON"):
        run.read_metrics("lap")


def test_networks_lists_only_directories_with_config_and_weights(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    with pytest.raises(ArtefactError, match="no trained network in"):
        run.networks()
    for name, files in {
        "lap": ("config.json", "model.safetensors"),
        "rce": ("config.json",),
    }.items():
        run.model(name).mkdir(parents=True)
        for file in files:
            (run.model(name) / file).write_text("{}")
    assert run.networks() == {"lap": run.model("lap")}
    assert run.networks("lap") == {"lap": run.model("lap")}
    with pytest.raises(ArtefactError, match=r"no trained network 'rce' .*trained: lap"):
        run.networks("rce")
