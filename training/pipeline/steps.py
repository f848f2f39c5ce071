"""The pipeline's commands on one run directory, as ``lapguard pipeline|fit|evaluate|report``
run them: a whole preset (timed), or one step of a run whose config is already saved there."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detector.artefacts import read_json
from detector.cost import DEFAULT_BUDGET
from training.evaluation.context import PipelineRun
from training.evaluation.deployable import fit_deployable
from training.evaluation.evaluate import evaluate
from training.evaluation.results import write_results
from training.pipeline.run import run_pipeline
from training.presets.pipelines import PipelineConfig, get_pipeline_preset, validated
from training.reporting.report import write_report
from training.rundir import RunDir


@dataclass(frozen=True)
class PipelineOutcome:
    """A finished pipeline: its config, run directory, ``results.json`` and wall time."""

    config: PipelineConfig
    run: Path
    results: dict[str, Any]
    seconds: float


def preset_config(
    preset: str,
    *,
    device: str | None = None,
    network: Path | None = None,
    cost_budget: float | None = None,
) -> PipelineConfig:
    """The named pipeline preset, on ``device`` when one is given; on the imported ``network``
    instead of its own when one is given (:meth:`PipelineConfig.on_network`); with its features
    chosen under ``cost_budget`` when one is given."""
    config = get_pipeline_preset(preset)
    if network is not None:
        config = config.on_network(network, budget=cost_budget or DEFAULT_BUDGET)
    elif cost_budget is not None:
        config = validated(config, cost_budget=cost_budget)
    return config.model_copy(update={"device": device}) if device else config


def default_run_dir(config: PipelineConfig) -> Path:
    """``runs/<preset name>``, where a run goes when no directory is given."""
    return Path("runs") / config.name


def run_preset(
    config: PipelineConfig, run: Path | None, *, root: Path | None = None, progress: bool = True
) -> PipelineOutcome:
    """Every step of the pipeline ``config`` in ``run`` (default ``runs/<name>``), resumed."""
    run = run or default_run_dir(config)
    started = time.perf_counter()
    results = run_pipeline(config, run, root=root, progress=progress)
    return PipelineOutcome(config, run, results, time.perf_counter() - started)


def fit_run(
    run: Path, *, detector: str | None = None, root: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Fit the deployable ``detector`` (default: the config's ``deploy_detector``) of ``run``;
    return its threshold calibration."""
    fit_deployable(PipelineRun.open(run, root=root, progress=progress), detector)
    info = read_json(RunDir(run).deployable_file, what="deployable detector")
    return dict(info["calibration"])


def evaluate_run(run: Path, *, root: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """The seen/unseen/OOD protocols of ``run`` (cached in its ``evaluation.json``)."""
    return evaluate(PipelineRun.open(run, root=root, progress=progress))


def report_run(run: Path, *, root: Path | None = None, progress: bool = True) -> Path:
    """Write ``results.json``, ``report.md`` and the figures of ``run``; return report.md."""
    write_results(PipelineRun.open(run, root=root, progress=progress))
    return write_report(run)
