"""The pipeline step that takes in a network made by ``lapguard import`` instead of training one:
its weights and config are checked (it loads and classifies the data set's images through its
input spec), copied into ``RUN/models/<name>/``, and recorded with the data set it is judged on
and its accuracy there, so every later step reads it as it reads a trained network.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from detector import artefacts, networks
from detector.errors import ConfigError
from training.attacks.registry import predict_labels
from training.data.datasets import dataset_info, load_dataset, to_arrays
from training.data.network_images import in_input_spec
from training.evaluation.context import PipelineRun
from training.presets.pipelines import PipelineConfig
from training.rundir import ModelDir


def check_imported(config: PipelineConfig) -> None:
    """Every imported network of ``config`` is a network directory (config and weights) with one
    class per class of the config's data set: checked in milliseconds, before a run directory is
    written (ConfigError or ArtefactError naming the network and what to do)."""
    wanted = len(dataset_info(config.dataset).class_names)
    for name, path in config.imported.items():
        source = ModelDir(path)
        if not source.weights_file.is_file():
            raise ConfigError(
                f"no network at {source.path} (no {source.weights_file.name}): "
                "make one with `lapguard import`"
            )
        classes = networks.read_config(source.path).num_classes
        if classes != wanted:
            raise ConfigError(
                f"network {name!r} ({source.path}) has {classes} classes, {config.dataset} has "
                f"{wanted}: import it with --classes naming the data set's classes"
            )


def import_network(run: PipelineRun, name: str) -> dict[str, Any]:
    """Bring imported network ``name`` into the run (once: a run holding it already keeps it;
    one holding other weights under that name is a ConfigError). Returns its import record."""
    source = ModelDir(run.config.imported[name])
    target = ModelDir(run.dir.model(name))
    digest = artefacts.sha256_file(source.weights_file)
    if target.import_record_file.is_file():
        record = dict(artefacts.read_json(target.import_record_file, what="import record"))
        if record.get("weights_sha256") != digest:
            raise ConfigError(
                f"{target.path} holds another network than {source.path}; choose a new --out"
            )
        return record
    model = networks.load(source.path, device=run.device)
    record = {
        "source": str(source.path),
        "dataset": run.config.dataset,
        "weights_sha256": digest,
        **_accuracy(run, name, model),
    }
    _copy_network(source, target)
    artefacts.write_json(target.import_record_file, record)  # last: the step's mark of done
    return record


def _accuracy(run: PipelineRun, name: str, model: networks.Network) -> dict[str, Any]:
    """Accuracy on the test images the run's attacks and clean samples use."""
    n = run.test_count(name)
    x, y = to_arrays(load_dataset(run.config.dataset, "test", root=run.root), n, seed=0)
    spec = model.config.input_spec  # type: ignore[union-attr]
    predicted = predict_labels(model, in_input_spec(x, spec), device=run.device)
    return {"test_accuracy": float(np.mean(predicted == y)), "test_images": int(len(y))}


def _copy_network(source: ModelDir, target: ModelDir) -> None:
    """Copy the network's weights and config into ``target`` (created in one rename)."""
    target.path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.path.name}.", dir=target.path.parent))
    try:
        for file in (source.weights_file, source.network_config_file):
            shutil.copyfile(file, staging / file.name)
        shutil.rmtree(target.path, ignore_errors=True)  # a copy an interrupted step left
        staging.rename(target.path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
