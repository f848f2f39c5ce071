"""The layout of a run directory and of a trained network's directory: every path, in one place.

Run directory (``lapguard pipeline --run RUN``)::

    pipeline_config.json
    progress.json                           the step under way, k of n (training/pipeline/progress.py)
    pipeline.log                            the output of a pipeline run in the background (demo)
    models/<name>/                          trained networks (a ModelDir each)
    attacks/<name>/<attack>-<key>/          adversarial sets (training/attacks/sets.py)
    features/<name>/<set>.npz               transport features + logits of a sample set
    features/<name>/<detector>/<set>.npz   a detector's precomputed arrays of the same set (mahalanobis, nss)
    scores/...                              first-seed detection scores (ROC curves)
    evaluation.json                         protocol results
    detector/                               the deployable detector and its calibration
    results.json, report.md, figures/
    diagnostics.json                        network dynamics (`lapguard diagnose`)
    bundle/                                 what `lapguard serve` loads

Model directory (``lapguard train --out DIR``, loadable by ``detector.networks.load``)::

    model.safetensors, config.json          the network (written when training finishes)
    train_config.json                       the TrainConfig, to re-run
    metrics.jsonl, steps.jsonl              per-epoch metrics and per-step loss terms
    training_curve.png
    checkpoint.safetensors + checkpoint.json   model + optimizer state after the last epoch

Nothing here writes files; the layout on disk is a contract (existing runs stay readable).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detector import artefacts
from detector.bundle import MANIFEST_FILE as BUNDLE_MANIFEST
from detector.errors import ArtefactError
from detector.networks import CONFIG_FILE as NETWORK_CONFIG_FILE
from detector.networks import WEIGHTS_FILE

CONFIG_FILE = "pipeline_config.json"
EVALUATION_FILE = "evaluation.json"
RESULTS_FILE = "results.json"
DIAGNOSTICS_FILE = "diagnostics.json"
REPORT_FILE = "report.md"
PROGRESS_FILE = "progress.json"
PIPELINE_LOG = "pipeline.log"
TIMINGS_FILE = "timings.jsonl"
FEATURE_COSTS_FILE = "feature_costs.json"  # what each candidate feature set costs
MODELS_DIR = "models"
ATTACKS_DIR = "attacks"
FEATURES_DIR = "features"
SCORES_DIR = "scores"
FIGURES_DIR = "figures"
DETECTOR_DIR = "detector"
BUNDLE_DIR = "bundle"
ADAPTIVE_DIR = "adaptive"
ADAPTIVE_ROW_FILE = "row.json"  # one per attack folder: adaptive/<model>/<target>/<attack>/
DEPLOYABLE_FILE = "deployable.json"  # in detector/: the deployable detector's summary
HELDOUT_SCORES_FILE = "heldout_scores.npz"  # in detector/: its held-out scores
DIAGNOSE_CONFIG_FILE = "diagnose_config.json"  # the `diagnose` preset's config, in its run
# figures/: the report's fixed figures (per-detector and per-set figures: RunDir's methods)
LEARNING_CURVE_FIGURE = "learning_curve.png"
OPERATING_POINTS_FIGURE = "operating_points.png"
ADAPTIVE_FIGURE = "adaptive_evasion.png"
NETWORKS_FIGURE = "dynamics_networks.png"
ATTACKS_FIGURE = "dynamics_attacks.png"

TRAIN_CONFIG_FILE = "train_config.json"
IMPORT_RECORD_FILE = "imported.json"  # an imported network: its source, data set, accuracy
METRICS_FILE = "metrics.jsonl"
STEPS_FILE = "steps.jsonl"
TRAINING_CURVE_FILE = "training_curve.png"
CHECKPOINT_WEIGHTS = "checkpoint.safetensors"
CHECKPOINT_STATE = "checkpoint.json"


@dataclass(frozen=True)
class ModelDir:
    """The files of one trained network's directory."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def network_config_file(self) -> Path:
        return self.path / NETWORK_CONFIG_FILE

    @property
    def train_config_file(self) -> Path:
        return self.path / TRAIN_CONFIG_FILE

    @property
    def import_record_file(self) -> Path:
        return self.path / IMPORT_RECORD_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def steps_file(self) -> Path:
        return self.path / STEPS_FILE

    @property
    def training_curve(self) -> Path:
        return self.path / TRAINING_CURVE_FILE

    @property
    def checkpoint_weights(self) -> Path:
        return self.path / CHECKPOINT_WEIGHTS

    @property
    def checkpoint_state(self) -> Path:
        return self.path / CHECKPOINT_STATE

    def has_network(self) -> bool:
        """Whether a saved network (config and weights) is there."""
        return self.network_config_file.is_file() and self.weights_file.is_file()

    def read_metrics(self) -> list[dict[str, Any]]:
        """Per-epoch metrics in epoch order ([] before the first epoch); a corrupt line is an
        ArtefactError naming the file and line."""
        return artefacts.read_jsonl(self.metrics_file)

    def read_steps(self) -> list[dict[str, Any]]:
        """Logged per-step loss terms ([] before the first epoch)."""
        return artefacts.read_jsonl(self.steps_file)


_OWN_SELECTION = "selection-"  # + <detector>.json: an own_feature_selection detector's table


@dataclass(frozen=True)
class RunDir:
    """Every path of a pipeline run directory. Paths are computed, never created."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    # ---- files at the top --------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def evaluation_file(self) -> Path:
        return self.path / EVALUATION_FILE

    @property
    def results_file(self) -> Path:
        return self.path / RESULTS_FILE

    @property
    def report_file(self) -> Path:
        return self.path / REPORT_FILE

    @property
    def diagnostics_file(self) -> Path:
        return self.path / DIAGNOSTICS_FILE

    @property
    def progress_file(self) -> Path:
        return self.path / PROGRESS_FILE

    @property
    def timings_file(self) -> Path:
        return self.path / TIMINGS_FILE

    @property
    def feature_costs_file(self) -> Path:
        return self.path / FEATURE_COSTS_FILE

    @property
    def pipeline_log(self) -> Path:
        return self.path / PIPELINE_LOG

    # ---- folders -----------------------------------------------------------------------------
    @property
    def models(self) -> Path:
        return self.path / MODELS_DIR

    @property
    def scores(self) -> Path:
        return self.path / SCORES_DIR

    @property
    def figures(self) -> Path:
        return self.path / FIGURES_DIR

    @property
    def detector_dir(self) -> Path:
        return self.path / DETECTOR_DIR

    def roc_figure(self, detector: str, setting: str) -> Path:
        return self.figures / f"roc_{detector}_{setting}.png"

    def transport_histogram_figure(self, kind: str) -> Path:
        return self.figures / f"transport_hist_{kind}.png"

    def trajectories_figure(self, kind: str) -> Path:
        return self.figures / f"trajectories_{kind}.png"

    @property
    def bundle_manifest(self) -> Path:
        """The bundle's manifest: it exists once the bundle is written."""
        return self.bundle / BUNDLE_MANIFEST

    @property
    def deployable_file(self) -> Path:
        return self.detector_dir / DEPLOYABLE_FILE

    @property
    def heldout_scores_file(self) -> Path:
        return self.detector_dir / HELDOUT_SCORES_FILE

    @property
    def diagnose_config_file(self) -> Path:
        return self.path / DIAGNOSE_CONFIG_FILE

    def adaptive_rows(self) -> list[dict[str, Any]]:
        """Every adaptive row written under ``adaptive/`` (one row.json per attack folder), in
        path order: the one source of results.json's ``"adaptive"`` list."""
        root = self.path / ADAPTIVE_DIR
        return [
            artefacts.read_json(p, what="adaptive row")
            for p in sorted(root.glob(f"*/*/*/{ADAPTIVE_ROW_FILE}"))
        ]

    @property
    def bundle(self) -> Path:
        return self.path / BUNDLE_DIR

    # ---- per network ---------------------------------------------------------------------------
    def model(self, name: str) -> Path:
        """``models/<name>/``: the trained network ``name``."""
        return self.models / name

    def model_dir(self, name: str) -> ModelDir:
        """The files of ``models/<name>/``."""
        return ModelDir(self.model(name))

    def attacks(self, name: str) -> Path:
        """``attacks/<name>/``: the adversarial set store of network ``name``."""
        return self.path / ATTACKS_DIR / name

    def feature_dir(self, name: str) -> Path:
        """``features/<name>/``: the feature files of network ``name``."""
        return self.path / FEATURES_DIR / name

    def features(self, name: str, set_name: str) -> Path:
        """``features/<name>/<set>.npz``."""
        return self.feature_dir(name) / f"{set_name}.npz"

    def feature_selection(self, name: str, detector: str | None = None) -> Path:
        """``features/<name>/selection.json``: the candidate feature sets' validation scores for
        the config's selection detector; ``selection-<detector>.json`` for a detector that
        chooses its own (``own_feature_selection``)."""
        return self.feature_dir(name) / (
            f"{_OWN_SELECTION}{detector}.json" if detector else "selection.json"
        )

    def own_feature_selections(self, name: str) -> list[Path]:
        """The :meth:`feature_selection` files of the detectors that chose their own set, sorted."""
        return sorted(self.feature_dir(name).glob(f"{_OWN_SELECTION}*.json"))

    def adaptive(self, name: str) -> Path:
        """``adaptive/<name>/``: targets, starting sets and results of the adaptive attacks."""
        return self.path / ADAPTIVE_DIR / name

    def precomputed(self, name: str, detector: str, set_name: str) -> Path:
        """``features/<name>/<detector>/<set>.npz``: a detector's precomputed per-image arrays."""
        return self.feature_dir(name) / detector / f"{set_name}.npz"

    def read_metrics(self, name: str) -> list[dict[str, Any]]:
        """Per-epoch training metrics of network ``name`` (see :meth:`ModelDir.read_metrics`)."""
        return self.model_dir(name).read_metrics()

    def networks(self, name: str | None = None) -> dict[str, Path]:
        """Trained networks by name (``models/<name>/`` holding config and weights), sorted;
        ``name`` picks one. None found, or ``name`` not trained, is an ArtefactError."""
        root = self.models
        found = {
            d.name: d
            for d in sorted(root.iterdir() if root.is_dir() else [])
            if ModelDir(d).has_network()
        }
        if name is not None:
            if name not in found:
                known = ", ".join(found) or "none"
                raise ArtefactError(
                    f"no trained network {name!r} in {root} (trained: {known}); train it first with `lapguard train`"
                )
            return {name: found[name]}
        if not found:
            raise ArtefactError(
                f"no trained network in {root}: expected {root}/<name>/ with {NETWORK_CONFIG_FILE} and "
                f"{WEIGHTS_FILE}; train one first with `lapguard train` or `lapguard pipeline`"
            )
        return found
