"""results.json (docs/architecture.md, "results.json"), from the run directory's finished steps."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
import torch

from detector import artefacts
from training.evaluation.context import PipelineRun, perturbed


def write_results(run: PipelineRun) -> dict[str, Any]:
    """Gather models, attacks, detection, OOD and timing into RUN/results.json."""
    evaluation = artefacts.read_json(run.dir.evaluation_file, what="evaluation")
    timing = evaluation["timing"]
    results = {
        "preset": run.config.name,
        "dataset": run.config.dataset,
        "models": {name: _model_row(run, name) for name in run.config.network_names},
        "attacks": {name: _attack_rows(run, name) for name in run.config.network_names},
        "detection": evaluation["detection"],
        "ood": evaluation["ood"],
        "learning_curves": evaluation.get("learning_curves", {}),
        "adaptive": run.dir.adaptive_rows(),
        "timing": _timing(timing, timing.get(run.config.deploy_model, {})),
        "machine": _machine(),
    }
    artefacts.write_json(run.dir.results_file, results)
    return results


def _model_row(run: PipelineRun, name: str) -> dict[str, Any]:
    if name in run.config.imported:
        record = artefacts.read_json(run.dir.model_dir(name).import_record_file, what="import")
        return {k: record[k] for k in ("test_accuracy", "test_images", "source")}
    epochs = run.dir.read_metrics(name)
    return {
        "test_accuracy": epochs[-1]["test_accuracy"],
        "epochs": epochs[-1]["epoch"],
        "train_seconds": float(sum(r["epoch_seconds"] for r in epochs)),
        "transport_cost": epochs[-1]["test_transport"],
    }


def _attack_rows(run: PipelineRun, name: str) -> dict[str, dict[str, Any]]:
    rows = {}
    sets = run.attack_sets(name)
    for spec in run.config.attacks:
        found = sets[spec.key]
        summary = found.summary()
        rows[spec.key] = {
            "n": int(summary["n"]),
            "unperturbed": int(np.count_nonzero(~perturbed(found))),
            "success_rate": summary["success_rate"],
            "success_rate_on_correct": summary["success_rate_on_correct"],
            "seconds": float(found.manifest.get("wall_seconds", 0.0)),
            "seconds_per_image": summary["seconds_per_image"],
            "median_l2": summary["median_l2"],
            "median_linf": summary["median_linf"],
            **spec.params,
        }
    return rows


def _timing(per_model: dict[str, Any], deploy: dict[str, Any]) -> dict[str, Any]:
    seconds = {"transport": deploy.get("transport_feature_seconds")}
    if "mahalanobis_feature_seconds" in deploy:
        seconds["mahalanobis"] = deploy["mahalanobis_feature_seconds"]
    return {
        "feature_extraction_seconds": seconds,
        "images": deploy.get("timing_images"),
        "per_model": per_model,
    }


def _machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
    }
