"""The detector that ships: fitted on the training side of a run, then calibrated and measured
through :class:`~detector.guard.Guard` -- the same torch scoring path the server and batch
scoring run, so the threshold and the held-out flag rates are those a deployment reproduces.

``RUN/detector/`` holds the detector (``detector.safetensors`` + ``detector.json``, written by
:meth:`Detector.save`), ``deployable.json`` (network, training attacks, calibration, held-out
flag rates, split) and ``heldout_scores.npz`` (the Guard's score of every held-out image, per set;
``png-<attack>``: of the attacked images as a client sending 8-bit PNGs sends them).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from detector import artefacts
from detector.base import Detector
from detector.bundle import write_bundle
from detector.calibration import Calibration, CalibrationWarning
from detector.cost import measure_cost, noise_batch
from detector.ensemble import EnsembleDetector
from detector.errors import ArtefactError, ConfigError
from detector.features import FeatureSpec
from detector.forest import TransportDetector
from detector.guard import Guard
from detector.preprocessing import quantize_uint8
from detector.registry import get_detector, list_detectors, load_detector
from training.data.synthetic_outliers import SYNTHETIC_TRANSFORMS, synthetic_outliers
from training.evaluation.context import (
    PipelineRun,
    add_precomputed,
    read_pipeline_config,
    validation_images,
)
from training.evaluation.explain_assets import explain_assets
from training.evaluation.protocols import Samples, Split, concat, on_all_cores
from training.presets.pipelines import PipelineConfig
from training.rundir import RunDir

SPLIT_SEED = 0
PNG_PREFIX = "png-"  # heldout_scores.npz: an attack's held-out images sent as 8-bit PNGs
SYNTHETIC_FAMILY = "synthetic"  # the family name of the synthetic outliers' rows
#: Further targets every deployed detector is also calibrated at, beside the config's, on the
#: same clean scores with the same confidence: an operator who wants fewer false alarms (or more
#: detections, for a monitoring tier) serves one (``lapguard serve --target-fpr 0.01``) without
#: refitting, and deployable.json records what each catches on the held-out side. A point whose
#: threshold saturates (too few clean scores, or ties at their maximum: it would flag nothing)
#: is recorded but not offered in the bundle.
OPERATING_FPRS = (0.01, 0.02, 0.1)


@dataclass(frozen=True)
class Deployed:
    """A deployable detector fitted and calibrated on one split, with the Guard's scores of that
    split's held-out side (``scores``: 'clean', each attack, ``ood-<name>``)."""

    detector: Detector
    calibration: Calibration
    calibration_images: dict[str, int]  # clean images per source (calibration_clean_scores)
    calibration_fpr: dict[str, float]  # per source, the share flagged at the calibrated threshold
    features: FeatureSpec
    train_attacks: list[str]
    train_pairs_per_attack: int
    synthetic_rows: int
    scores: dict[str, np.ndarray]
    successful: dict[str, np.ndarray]  # per attack, which held-out images fool the network
    misclassified: np.ndarray  # per held-out clean image, whether the network gets it wrong
    png_scores: dict[str, np.ndarray]  # per attack, the held-out images sent as 8-bit PNGs
    png_successful: dict[str, np.ndarray]  # which of those still fool the network
    operating_points: list[Calibration]  # by target FPR, the calibration's own among them

    def heldout(self, threshold: float | None = None) -> dict[str, Any]:
        """Held-out flag rates at ``threshold`` (default: the calibrated one; ``deployable.json``'s
        'heldout'): per set, then split by the network's answer on clean images, then each
        attack's successful images as a PNG client sends them."""
        threshold = self.calibration.threshold if threshold is None else threshold
        flagged = self.scores["clean"] > threshold
        return (
            _heldout_rates(self.scores, self.successful, threshold)
            | _clean_by_prediction(flagged, self.misclassified)
            | _rates_on(self.png_scores, self.png_successful, threshold, "png_successful")
        )

    def operating_heldout(self) -> list[dict[str, Any]]:
        """``deployable.json``'s 'operating_points': each point's calibration and its held-out
        rates (:meth:`heldout` at its threshold), by target FPR."""
        return [
            {"calibration": point.to_dict(), "heldout": self.heldout(point.threshold)}
            for point in self.operating_points
        ]


def fit_deployable(run: PipelineRun, detector: str | None = None) -> Path:
    """Fit detector ``detector`` (default: the config's ``deploy_detector``) as
    :func:`deploy` does on the seed-0 split, and write it with its calibration and held-out
    rates to ``RUN/detector/``. Cached per detector."""
    detector = detector or run.config.deploy_detector
    out = run.dir.detector_dir
    saved = run.dir.deployable_file
    n_synthetic = run.config.deploy_synthetic_outliers if detector == "ensemble" else 0
    if _fitted_as(saved, detector, n_synthetic):
        return out
    deployed = deploy(run, detector, SPLIT_SEED)
    deployed.detector.save(out)
    png = {f"{PNG_PREFIX}{k}": v for k, v in deployed.png_scores.items()}
    artefacts.save_npz(run.dir.heldout_scores_file, **deployed.scores, **png)
    artefacts.write_json(
        saved,
        {
            "kind": detector,
            "network": run.config.deploy_model,
            "train_attacks": deployed.train_attacks,
            "train_pairs_per_attack": deployed.train_pairs_per_attack,
            "families": list(getattr(deployed.detector, "family_names_", [])),
            "synthetic_outliers": {
                "rows": deployed.synthetic_rows,
                "transforms": list(SYNTHETIC_TRANSFORMS) if deployed.synthetic_rows else [],
            },
            "calibration": deployed.calibration.to_dict(),
            "calibration_images": deployed.calibration_images,
            "calibration_fpr": deployed.calibration_fpr,
            "features": asdict(deployed.features),
            "heldout": deployed.heldout(),
            "operating_points": deployed.operating_heldout(),
            "split_seed": SPLIT_SEED,
            "test_fraction": run.config.test_fraction,
        },
    )
    return out


def deploy(run: PipelineRun, detector: str, split_seed: int) -> Deployed:
    """Fit detector ``detector`` on the deploy network's training side of split ``split_seed``
    (every deploy attack in equal shares, :func:`equal_shares`, each row marked with its attack
    family: the ensemble also fits one forest set per family; with the config's synthetic
    outliers for the ensemble), in the feature set chosen for that network; calibrate it at the
    config's target FPR (with its confidence) on the split's calibration clean images, the
    network's own validation images and its own clean fitting images' held-out scores
    (:func:`calibration_clean_scores`); and score
    the held-out side of every attack set and every OOD set, all through the Guard."""
    servable = list_detectors(servable=True)  # a torch form the Guard serves
    if detector not in servable:
        raise ConfigError(f"detector {detector!r} cannot be deployed; choose one of {servable}")
    config, name = run.config, run.config.deploy_model
    n_synthetic = config.deploy_synthetic_outliers if detector == "ensemble" else 0
    data = run.samples(name)
    keys = deploy_keys(config, data.attacks)
    split = Split(split_seed, config.test_fraction, int(data.clean.indices.max()) + 1)
    unfitted = on_all_cores(get_detector(detector))
    add_precomputed(run, name, unfitted, [data.clean, *data.attacks.values(), *data.ood.values()])
    abnormal = equal_shares(deploy_parts(config, data.attacks, split), seed=split_seed)
    synthetic = synthetic_part(run, name, split, n_synthetic, seed=split_seed)
    if synthetic is not None:
        add_precomputed(run, name, unfitted, [synthetic])
    fitted = fit_with_outliers(unfitted, split.train(data.clean), abnormal, synthetic)
    spec = fitted.serving_features(run.feature_spec(name))
    guard = Guard.from_run(
        run.model(name),
        fitted,
        np.inf,
        features=spec,
        device=run.device,
        second=run.second_model(name, spec),
    )
    own = fitted.decision_threshold()  # None: it decides at the calibrated threshold
    calibration_scores = calibration_clean_scores(
        guard, fitted, data.clean, split, validation_images(run, name)
    )
    points = operating_points(
        np.concatenate(list(calibration_scores.values())),
        config.target_fpr,
        default_vote_threshold=0.5 if own is None else own,
        confidence=config.calibration_confidence,
    )
    calibration = next(p for p in points if p.target_fpr == config.target_fpr)
    held_out_clean = split.test(data.clean)
    held_out = {k: split.test(v) for k, v in data.attacks.items()}
    scores = {"clean": _guard_scores(guard, held_out_clean)}
    scores.update({k: _guard_scores(guard, v) for k, v in held_out.items()})
    scores.update({f"ood-{k}": _guard_scores(guard, v) for k, v in data.ood.items()})
    png_scores, png_successful = sent_as_png(run, name, guard, held_out)
    return Deployed(
        fitted,
        calibration,
        {k: len(v) for k, v in calibration_scores.items()},
        {k: float(np.mean(v > calibration.threshold)) for k, v in calibration_scores.items()},
        spec,
        keys,
        len(abnormal) // len(keys),
        0 if synthetic is None else len(synthetic),
        scores,
        {k: np.asarray(v.success, bool) for k, v in held_out.items()},
        misclassified(run, name, held_out_clean),
        png_scores,
        png_successful,
        points,
    )


def operating_points(
    clean_scores: np.ndarray,
    target_fpr: float,
    *,
    default_vote_threshold: float,
    confidence: float | None,
) -> list[Calibration]:
    """The clean scores calibrated at ``target_fpr`` and at each :data:`OPERATING_FPRS` target,
    by target FPR (a target too strict for the number of clean scores at that confidence comes
    back ``saturated``: see :class:`Calibration`)."""
    points = []
    for target in sorted({*OPERATING_FPRS, float(target_fpr)}):
        with warnings.catch_warnings():
            if target != target_fpr:  # a further point may saturate: recorded, not warned
                warnings.simplefilter("ignore", CalibrationWarning)
            points.append(
                Calibration.from_scores(
                    clean_scores,
                    target,
                    default_vote_threshold=default_vote_threshold,
                    confidence=confidence,
                )
            )
    return points


def calibration_clean_scores(
    guard: Guard,
    fitted: Detector,
    clean: Samples,
    split: Split,
    validation: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The clean scores the threshold is calibrated on: 'slice', the Guard's scores of the
    split's calibration images, which nothing was fitted on; 'fitting', the detector's
    held-out scores of its own clean fitting images (:meth:`Detector.score_held_out`: each
    forest's out-of-bag votes, grouped by source image, and the nearest clean image of another
    source), those that are not NaN; and 'validation', the Guard's scores of ``validation``
    (the network's own held-back images, :func:`validation_images`), which neither the network
    nor the detector learnt from. The more images, the tighter the confidence bound, and the
    closer the threshold to the target FPR (docs/decisions.md, "Calibration sources" and
    "Validation images in the calibration")."""
    scores = {"slice": _guard_scores(guard, split.calibration(clean)).astype(np.float64)}
    held_out = fitted.score_held_out(split.train(clean))
    if held_out is not None:
        scores["fitting"] = held_out[np.isfinite(held_out)]
    if validation is not None:
        held_back = guard.predict(validation).scores if len(validation) else np.empty(0)
        scores["validation"] = np.asarray(held_back, np.float64)
    return scores


def _fitted_as(saved: Path, detector: str, n_synthetic: int) -> bool:
    """Whether ``saved`` (a deployable.json) describes detector ``detector`` fitted with
    ``n_synthetic`` synthetic outliers, calibrated and measured as :func:`deploy` does (one
    written before the network's validation images joined the calibration has no 'validation'
    count, one written before the PNG rates no 'n_png_successful', one written before the
    operating points none, one written before the per-source calibration FPRs none)."""
    if not saved.is_file():
        return False
    previous = artefacts.read_json(saved)
    rows = previous.get("synthetic_outliers", {}).get("rows", 0)
    same = previous.get("kind") == detector and rows == n_synthetic
    calibrated = "validation" in (previous.get("calibration_images") or {})
    measured = "n_png_successful" in (previous.get("heldout") or {})
    recorded = "operating_points" in previous and "calibration_fpr" in previous
    return bool(same and calibrated and measured and recorded)


def synthetic_part(
    run: PipelineRun, name: str, split: Split, n: int, *, seed: int = SPLIT_SEED
) -> Samples | None:
    """``n`` synthetic outliers (:mod:`training.data.synthetic_outliers`, one row per source image)
    of training-side clean images of network ``name`` drawn by ``seed``, each row marked as of
    family ``synthetic``; None when ``n`` is 0. Their features are cached in the run."""
    if not n:
        return None
    clean = split.train(run.samples(name).clean)
    if n > len(clean):
        raise ConfigError(
            f"deploy_synthetic_outliers is {n}, but the training side has {len(clean)} clean images"
        )
    chosen = np.sort(np.random.default_rng(seed).permutation(len(clean))[:n])
    spec = run.model(name).config.input_spec  # type: ignore[union-attr]
    images, _ = synthetic_outliers(clean.images[chosen], spec.value_range, seed=seed)
    indices = clean.indices[chosen]
    digest = hashlib.sha256(np.ascontiguousarray(indices, np.int64).tobytes()).hexdigest()[:12]
    key = f"synthetic-{n}-{digest}" + ("" if seed == SPLIT_SEED else f"-seed{seed}")
    samples = run.image_samples(name, key, images, indices)
    return with_family(replace(samples, success=np.ones(n, bool)), SYNTHETIC_FAMILY)


def fit_with_outliers(
    unfitted: Detector, clean: Samples, abnormal: Samples, synthetic: Samples | None
) -> Detector:
    """``unfitted`` fitted on the clean and abnormal rows; with synthetic outliers (an ensemble
    only; their precomputed arrays already added), they train their own family's forests but not
    the pooled ones, which see the attacks only (pooled forests trained on both flag fewer
    minimal-perturbation images: docs/decisions.md, "Synthetic outliers")."""
    if synthetic is None:
        return unfitted.fit_samples(clean, abnormal)
    if not isinstance(unfitted, EnsembleDetector):
        raise ConfigError("synthetic outliers are a family of the ensemble detector only")
    forests = TransportDetector(**unfitted.forest_params()).fit_samples(clean, abnormal)
    both = concat([abnormal, synthetic], "abnormal")
    return unfitted.fit_samples(clean, both, forests=forests)


def deploy_parts(
    config: PipelineConfig, attacks: dict[str, Samples], split: Split
) -> list[Samples]:
    """The training side of each attack the deployed detector learns (:func:`deploy_keys`), every
    row marked with its attack family."""
    return [
        with_family(split.train(attacks[k]), attack_family(config, k))
        for k in deploy_keys(config, attacks)
    ]


def deploy_keys(config: PipelineConfig, attacks: dict[str, Samples]) -> list[str]:
    """The attack sets the deployed detector learns: the config's ``deploy_attacks``, default
    every set of the network."""
    return config.deploy_attacks or list(attacks)


def attack_family(config: PipelineConfig, key: str) -> str:
    """The family of attack set ``key``: its attack (FGM at eps 0.1 and 0.03 are one family)."""
    return next(spec.attack for spec in config.attacks if spec.key == key)


def with_family(samples: Samples, family: str) -> Samples:
    """The same samples, every row marked as of attack family ``family``."""
    return replace(samples, families=np.full(len(samples), family))


def equal_shares(parts: list[Samples], *, seed: int) -> Samples:
    """Every attack weighs the same in the deployed detector: each part is subsampled (seeded)
    to the smallest part's size, so the cheap attacks' large sets do not drown the slow ones."""
    size = min(len(p) for p in parts)
    rng = np.random.default_rng(seed)
    return concat([p.subsample(size, rng) for p in parts], "abnormal")


def _guard_scores(guard: Guard, samples: Samples) -> np.ndarray:
    """The Guard's float32 scores of a sample set's images (one forward pass per batch)."""
    return guard.predict(samples.images).scores


def _heldout_rates(
    scores: dict[str, np.ndarray], successful: dict[str, np.ndarray], threshold: float
) -> dict[str, Any]:
    """FPR on held-out clean images; the flag rate of each attack's held-out images and of each
    OOD set (keys ``ood-<name>``); and each attack's flag rate on its successful images only."""
    sets = {k: v for k, v in scores.items() if k != "clean"}
    return {
        "fpr": float(np.mean(scores["clean"] > threshold)),
        "n_clean": len(scores["clean"]),
        "flag_rate": {k: float(np.mean(v > threshold)) for k, v in sets.items()},
        "n": {k: len(v) for k, v in sets.items()},
    } | _rates_on(scores, successful, threshold, "successful")


def _rates_on(
    scores: dict[str, np.ndarray], rows: dict[str, np.ndarray], threshold: float, name: str
) -> dict[str, Any]:
    """``<name>_flag_rate``: each set's flag rate on the rows ``rows`` keeps (None on none),
    and ``n_<name>``: how many rows it keeps."""
    return {
        f"{name}_flag_rate": {
            k: float(np.mean(scores[k][m] > threshold)) if m.any() else None
            for k, m in rows.items()
        },
        f"n_{name}": {k: int(m.sum()) for k, m in rows.items()},
    }


def true_labels(run: PipelineRun, name: str, samples: Samples) -> np.ndarray:
    """The true label of each row's source test image (int64 [N])."""
    _, labels, indices = run.test_images(name)
    label_of = dict(zip(indices.tolist(), labels.tolist(), strict=True))
    return np.array([label_of[int(i)] for i in samples.indices], dtype=np.int64)


def misclassified(run: PipelineRun, name: str, clean: Samples) -> np.ndarray:
    """True where network ``name`` gets a clean sample's label wrong."""
    return np.asarray(clean.predicted) != true_labels(run, name, clean)


def sent_as_png(
    run: PipelineRun, name: str, guard: Guard, held_out: dict[str, Samples]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each held-out attack set as a client sending 8-bit PNGs sends it
    (:func:`~detector.preprocessing.quantize_uint8`: the tensor the server decodes from that
    PNG): the Guard's scores, and which images still fool the network (its label is not the
    true one). Rounding can undo a minimal perturbation (CW, DeepFool)."""
    scores, successful = {}, {}
    for key, samples in held_out.items():
        result = guard.predict(quantize_uint8(samples.images, guard.input_spec.value_range))
        scores[key] = result.scores
        successful[key] = result.labels != true_labels(run, name, samples)
    return scores, successful


def _clean_by_prediction(flagged: np.ndarray, misclassified: np.ndarray) -> dict[str, Any]:
    """The held-out clean images' flag rate split by whether the network classifies them right:
    a flag on an image it gets wrong also stops a wrong answer; ``fpr_correct`` is the rate an
    operator pays on answers that were right."""

    def rate(rows: np.ndarray) -> float | None:
        return float(np.mean(flagged[rows])) if rows.any() else None

    return {
        "fpr_correct": rate(~misclassified),
        "fpr_misclassified": rate(misclassified),
        "n_misclassified": int(misclassified.sum()),
    }


def load_deployable(run: str | Path) -> tuple[Detector, Calibration, dict[str, Any]]:
    """The detector written by :func:`fit_deployable`, its calibration and its description."""
    directory, path = RunDir(run).detector_dir, RunDir(run).deployable_file
    if not path.is_file():
        raise ArtefactError(
            f"no fitted detector in {directory}; run `lapguard fit --run {run}` first"
        )
    info = artefacts.read_json(path, what="deployable detector")
    if not isinstance(info, dict):
        raise ArtefactError(f"{path} must hold a JSON object")
    return load_detector(directory), Calibration.from_dict(info.get("calibration")), info


def bundle_metrics(run: str | Path, info: dict[str, Any]) -> dict[str, float]:
    """Headline metrics of the bundle: held-out rates, test accuracy, seen detection means."""
    heldout = info["heldout"]
    metrics: dict[str, float] = {"heldout_fpr": heldout["fpr"]}
    metrics.update(
        {
            f"heldout_{key}": heldout[key]
            for key in ("fpr_correct", "fpr_misclassified")
            if heldout.get(key) is not None
        }
    )
    metrics.update({f"heldout_flag_rate_{key}": rate for key, rate in heldout["flag_rate"].items()})
    for rates in ("successful_flag_rate", "png_successful_flag_rate"):
        metrics.update(
            {
                f"heldout_{rates}_{key}": rate
                for key, rate in heldout.get(rates, {}).items()
                if rate is not None
            }
        )
    results_path = RunDir(run).results_file
    if results_path.is_file():
        results = artefacts.read_json(results_path, what="results")
        network = info["network"]
        metrics["test_accuracy"] = float(results["models"][network]["test_accuracy"])
        seen = [
            r
            for r in results["detection"]
            if r["model"] == network and r["detector"] == info["kind"] and r["setting"] == "seen"
        ]
        if seen:
            metrics["seen_detection_accuracy_mean"] = float(np.mean([r["accuracy"] for r in seen]))
            metrics["seen_auroc_mean"] = float(np.mean([r["auroc"] for r in seen]))
    return metrics


def is_offered(calibration: Mapping[str, Any], own_target: float | None) -> bool:
    """Whether the bundle offers an operating point (its calibration, as deployable.json holds
    it): every one whose threshold did not saturate, and the config's own target always (it is
    the bundle's threshold)."""
    return not calibration.get("saturated") or calibration.get("target_fpr") == own_target


def offered_points(info: dict[str, Any]) -> list[Calibration]:
    """The operating points of a deployable.json the bundle offers (:func:`is_offered`)."""
    own = (info.get("calibration") or {}).get("target_fpr")
    points = [p.get("calibration") or {} for p in info.get("operating_points", [])]
    return [Calibration.from_dict(p) for p in points if is_offered(p, own)]


def write_run_bundle(run: str | Path, out: Path | None = None) -> Path:
    """The deployable bundle of a finished run (default RUN/bundle), with the clean band and the
    gallery that ``/v1/explain`` and the page show (:mod:`training.evaluation.explain_assets`),
    and the Guard's cost measured here (:func:`detector.cost.measure_cost`, on seeded uniform
    images: a forward pass costs the same whatever the pixels)."""
    config = read_pipeline_config(run)
    detector, calibration, info = load_deployable(run)
    band, gallery = explain_assets(run, info)
    features = FeatureSpec(**info.get("features", {}))
    second = config.second_network(info["network"]) if features.second else None
    network_dir = RunDir(run).model(info["network"])
    second_dir = RunDir(run).model(second) if second else None
    guard = Guard.from_run(
        network_dir,
        detector,
        calibration,
        features=features,
        device=config.device,
        second=second_dir,
    )
    return write_bundle(
        out or RunDir(run).bundle,
        network_dir=network_dir,
        detector=detector,
        calibration=calibration,
        name=f"lapguard-{config.name}-{info['network']}",
        dataset=config.dataset,
        metrics=bundle_metrics(run, info),
        features=features,
        band=band,
        gallery=gallery,
        second_network_dir=second_dir,
        operating_points=offered_points(info),
        cost=measure_cost(guard, noise_batch(guard.input_spec), budget=config.cost_budget),
    )
