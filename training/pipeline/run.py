"""The offline pipeline: train -> attack -> features -> detection protocols -> deployable
detector -> report -> bundle. Every step is cached in the run directory (layout:
:mod:`training.rundir`) and resumable; re-running a finished step is a no-op. The steps read
their networks, images and sample sets from one :class:`~training.evaluation.context.PipelineRun`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from training.data.datasets import load_dataset
from training.data.synthetic_outliers import SYNTHETIC_OOD, check_held_back
from training.evaluation.context import PipelineRun, init_run
from training.evaluation.deployable import fit_deployable, write_run_bundle
from training.evaluation.evaluate import evaluate
from training.evaluation.results import write_results
from training.pipeline.imported import check_imported, import_network
from training.pipeline.progress import PipelineProgress
from training.presets import get_train_preset
from training.presets.pipelines import PipelineConfig
from training.reporting.report import write_report
from training.timings import record_reference
from training.trainer.loop import train, train_and_validation_sets


# ---- steps -------------------------------------------------------------------------------------
def train_model(run: PipelineRun, name: str) -> None:
    """Train (or resume, or find finished) the config's network ``name``. The first network's
    step first checks the whole config (:func:`check_synthetic_ood`), once per run."""
    if name == next(iter(run.config.models)):
        check_synthetic_ood(run.config, root=run.root)
    preset = run.config.models[name]
    train_config = get_train_preset(preset).model_copy(update={"device": run.config.device})
    train(train_config, run.dir.model(name), root=run.root, progress=run.progress)


def check_synthetic_ood(config: PipelineConfig, *, root: Path | None = None) -> None:
    """With ``synthetic`` in ``ood_train``, every network's training preset must hold back at
    least ``ood_n`` validation images, which the OOD protocol's synthetic set is made from:
    checked in seconds on the data set's training split, at the start of the first network's
    training step, so before any network trains (a ConfigError naming the network and the way
    out)."""
    if SYNTHETIC_OOD not in config.ood_train:
        return
    full_train = load_dataset(config.dataset, "train", root=root, verify=False)
    for name, preset in config.models.items():
        held_back = train_and_validation_sets(get_train_preset(preset), full_train)[1]
        check_held_back(name, len(held_back), config.ood_n)  # type: ignore[arg-type]


def train_models(run: PipelineRun) -> None:
    """Train (or resume, or find finished) every network of the config."""
    for name in run.config.models:
        train_model(run, name)


def pipeline_steps(run: PipelineRun) -> list[tuple[str, Callable[[], Any]]]:
    """The steps of :func:`run_pipeline` in order, by name: one per network trained or imported,
    one per attack set (network x attack), then the evaluation, the deployable detector, results.json,
    the report and the bundle."""
    names = run.config.network_names
    keys = [spec.key for spec in run.config.attacks]
    return [
        *((f"train {name}", partial(train_model, run, name)) for name in run.config.models),
        *((f"import {name}", partial(import_network, run, name)) for name in run.config.imported),
        *(
            (f"attack {name}/{key}", partial(run.attack_set, name, key))
            for name in names
            for key in keys
        ),
        ("evaluate", partial(evaluate, run)),
        ("fit deployable", partial(fit_deployable, run)),
        ("results", partial(write_results, run)),
        ("report", partial(write_report, run.dir.path)),
        ("bundle", partial(write_run_bundle, run.dir.path)),
    ]


def run_pipeline(
    config: PipelineConfig, run: str | Path, *, root: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """All steps, each cached: re-running after an interruption resumes, a finished run is a
    no-op. ``RUN/progress.json`` says which step runs (:mod:`training.pipeline.progress`); returns the
    contents of results.json."""
    check_imported(config)
    init_run(config, run)
    pipeline = PipelineRun(config, run, root=root, progress=progress)
    steps = pipeline_steps(pipeline)
    timings = pipeline.dir.timings_file
    tracker = PipelineProgress(
        pipeline.dir.progress_file, preset=config.name, total=len(steps), timings=timings
    )
    record_reference(timings)
    outputs: dict[str, Any] = {}
    with tracker.run():
        for name, call in steps:
            with tracker.step(name):
                outputs[name] = call()
    return dict(outputs["results"])
