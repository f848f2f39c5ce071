"""The offline pipeline: train -> attack -> features -> detection protocols -> deployable
detector -> report -> bundle. Every step is cached in the run directory and resumable; re-running
a finished step is a no-op.

Run directory::

    pipeline_config.json
    models/<name>/              trained networks (training/trainer.py)
    attacks/<name>/...          adversarial sets (training/adversarial.py)
    features/<name>/<set>.npz   transport features + logits of clean, attacked and OOD sets
    scores/...                  first-seed detection scores (ROC curves)
    evaluation.json             protocol results (written when the evaluation finishes)
    detector/                   the deployable detector and its calibration
    results.json, report.md, figures/
    bundle/                     what `lapguard serve` loads
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detector import networks
from detector.errors import ArtefactError, ConfigError
from detector.features import TransportFeatureExtractor, extract_features
from detector.forest import TransportDetector
from training import adversarial
from training.data import load_ood
from training.experiments import Samples, Split, concat, run_protocols, save_first_scores
from training.presets import get_train_preset
from training.presets.pipelines import PipelineConfig
from training.trainer import train

CONFIG_FILE = "pipeline_config.json"
EVALUATION_FILE = "evaluation.json"
RESULTS_FILE = "results.json"
DETECTOR_DIR = "detector"
BUNDLE_DIR = "bundle"


def read_pipeline_config(run: Path) -> PipelineConfig:
    path = run / CONFIG_FILE
    if not path.is_file():
        raise ArtefactError(
            f"{run} is not a pipeline run directory (no {CONFIG_FILE}); run `lapguard pipeline` first"
        )
    return PipelineConfig.model_validate_json(path.read_text())


def init_run(config: PipelineConfig, run: Path) -> None:
    """Write the config, or check that the run directory was made with the same one."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / CONFIG_FILE
    if path.is_file():
        saved = PipelineConfig.model_validate_json(path.read_text())
        if saved.model_dump(exclude={"device"}) != config.model_dump(exclude={"device"}):
            raise ConfigError(f"{run} holds a run of another pipeline config; choose a new --out")
    else:
        path.write_text(config.model_dump_json(indent=2))


# ---- steps -------------------------------------------------------------------------------------
def train_models(
    config: PipelineConfig, run: Path, *, root: Path | None = None, progress: bool = True
) -> None:
    for name, preset in config.models.items():
        train_config = get_train_preset(preset)
        train_config = train_config.model_copy(update={"device": config.device})
        train(train_config, run / "models" / name, root=root, progress=progress)


def _test_images(
    model_dir: Path, n: int, root: Path | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return adversarial.attack_images(model_dir, split="test", n=n, seed=0, root=root)


def generate_attacks(
    config: PipelineConfig, run: Path, *, root: Path | None = None, progress: bool = True
) -> dict[str, dict[str, adversarial.AdversarialSet]]:
    """Every configured attack on every network (cached: a finished set is loaded)."""
    n_max = max(a.n for a in config.attacks)
    sets: dict[str, dict[str, adversarial.AdversarialSet]] = {}
    for name in config.models:
        model_dir = run / "models" / name
        x, y, indices = _test_images(model_dir, n_max, root)
        model = networks.load(model_dir, device=networks.resolve_device(config.device))
        sets[name] = {}
        for spec in config.attacks:
            sets[name][spec.key] = adversarial.get_or_generate(
                run / "attacks" / name,
                model,
                x[: spec.n],
                y[: spec.n],
                indices[: spec.n],
                spec.attack,
                spec.params,
                seed=0,
                device=config.device,
                progress=progress,
            )
    return sets


def _cached_features(
    path: Path, source: str, model: torch.nn.Module, images: np.ndarray, device: str
) -> tuple[np.ndarray, np.ndarray, list[str], float]:
    """Transport features and logits of ``images``, cached in ``path`` under the ``source`` key."""
    if path.is_file():
        with np.load(path, allow_pickle=False) as cached:
            if str(cached["source"]) == source and len(cached["features"]) == len(images):
                return (
                    cached["features"],
                    cached["logits"],
                    [str(n) for n in cached["feature_names"]],
                    float(cached["seconds"]),
                )
    started = time.perf_counter()
    features, logits = extract_features(model, images, device=device)
    seconds = time.perf_counter() - started
    names = TransportFeatureExtractor(model).feature_names
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        features=features,
        logits=logits,
        feature_names=np.array(names),
        source=np.array(source),
        seconds=np.array(seconds),
    )
    tmp.replace(path)
    return features, logits, names, seconds


def collect_samples(
    config: PipelineConfig,
    run: Path,
    name: str,
    sets: dict[str, adversarial.AdversarialSet],
    *,
    root: Path | None = None,
) -> tuple[Samples, dict[str, Samples], dict[str, Samples], dict[str, float], torch.nn.Module]:
    """Clean, attacked and OOD samples of network ``name`` with their (cached) transport features."""
    model_dir = run / "models" / name
    device = str(networks.resolve_device(config.device))
    model = networks.load(model_dir, device=device)
    n_max = max(a.n for a in config.attacks)
    x, y, indices = _test_images(model_dir, n_max, root)
    feature_dir = run / "features" / name
    f, logits, _, seconds = _cached_features(
        feature_dir / "clean.npz", f"clean-{n_max}", model, x, device
    )
    clean = Samples("clean", x, f, logits.argmax(1), indices)
    timing = {"clean_images": float(len(x)), "transport_seconds": seconds}
    attacks: dict[str, Samples] = {}
    for key, adv in sets.items():
        f, logits, _, _ = _cached_features(
            feature_dir / f"{key}.npz", adv.manifest["key"], model, adv.x_adv, device
        )
        samples = Samples(key, adv.x_adv, f, logits.argmax(1), adv.indices, adv.success)
        attacks[key] = samples.take(perturbed(adv))
    ood: dict[str, Samples] = {}
    spec = model.config.input_spec  # type: ignore[union-attr]
    for ood_name in config.ood_test:
        images = load_ood(ood_name, spec, config.ood_n, seed=0, root=root)
        f, logits, _, _ = _cached_features(
            feature_dir / f"ood-{ood_name}.npz",
            f"ood-{ood_name}-{config.ood_n}",
            model,
            images,
            device,
        )
        ood[ood_name] = Samples(
            f"ood-{ood_name}", images, f, logits.argmax(1), np.arange(len(images))
        )
    return clean, attacks, ood, timing, model


def perturbed(adv: adversarial.AdversarialSet) -> np.ndarray:
    """Rows of an attacked set that differ from their source image. ART's APGD and CW return an
    image the network already misclassifies unchanged (~9% of Fashion-MNIST test images): such a
    row is a clean image, not an adversarial sample, and a detector can neither learn nor be
    judged on it, so detection sets leave it out (the seed pairs every image with "an
    adversarial sample generated" from it)."""
    return np.asarray(adv.linf) > 0


def _noisy_copies(clean: Samples, model: torch.nn.Module, eps: float, device: str) -> Samples:
    rng = np.random.default_rng(0)
    images = np.clip(
        clean.images + rng.uniform(-eps, eps, clean.images.shape).astype(np.float32), 0, 1
    )
    features, logits = extract_features(model, images, device=device)
    return Samples("noise", images, features, logits.argmax(1), clean.indices)


def evaluate(
    config: PipelineConfig, run: Path, *, root: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run the detection protocols on every network; writes evaluation.json and first-seed scores."""
    from detector.registry import get_detector
    from training.data import load_dataset, to_arrays

    path = run / EVALUATION_FILE
    if path.is_file():
        return json.loads(path.read_text())
    sets = generate_attacks(config, run, root=root, progress=progress)
    detection: list[dict[str, Any]] = []
    ood_rows: list[dict[str, Any]] = []
    timing: dict[str, Any] = {}
    for name in config.models:
        clean, attacks, ood, model_timing, model = collect_samples(
            config, run, name, sets[name], root=root
        )
        statistics = None
        params: dict[str, dict[str, Any]] = {
            "transport": {"n_jobs": -1},
            "mahalanobis": {"magnitudes": tuple(config.mahalanobis_magnitudes), "n_jobs": -1},
        }
        detectors = [get_detector(d, **params.get(d, {})) for d in config.detectors]
        for detector in detectors:
            if detector.info.reads != "network":
                continue
            # Statistics from clean training images (shared by every fit), then per-image-set
            # arrays computed once and cached on disk.
            clean_x, clean_y = to_arrays(
                load_dataset(config.dataset, "train", root=root), config.mahalanobis_clean_n, seed=1
            )
            statistics = detector.prepare(model, clean_x, clean_y)
            for samples in (clean, *attacks.values(), *ood.values()):
                _add_mahalanobis_features(
                    run / "features" / name / detector.info.name / f"{samples.name}.npz",
                    statistics,
                    model,
                    samples,
                )
        noisy = (
            _noisy_copies(clean, model, 0.1, str(networks.resolve_device(config.device)))
            if config.noisy_copies
            else None
        )
        records = run_protocols(
            model=name,
            clean=clean,
            attacks=attacks,
            ood_sets=ood,
            detectors=detectors,
            seen=config.seen_keys,
            unseen_train=config.unseen_train,
            ood_train=config.ood_train,
            seeds=list(range(config.seeds)),
            test_fraction=config.test_fraction,
            target_fpr=config.target_fpr,
            noisy_copies=noisy,
            progress=progress,
        )
        save_first_scores(records, run / "scores")
        for record in records:
            (ood_rows if record.setting == "ood" else detection).append(record.row())
        timing[name] = model_timing | _feature_timing(config, model, clean, statistics)
    result = {"detection": detection, "ood": ood_rows, "timing": timing}
    path.write_text(json.dumps(result, indent=2))
    return result


def _add_mahalanobis_features(
    path: Path, statistics: Any, model: torch.nn.Module, samples: Samples
) -> None:
    """Per-magnitude Mahalanobis features of a sample set, computed once and cached on disk."""
    from detector.mahalanobis import mahalanobis_key

    keys = [mahalanobis_key(m) for m in statistics.magnitudes]
    if path.is_file():
        with np.load(path, allow_pickle=False) as cached:
            if all(k in cached for k in keys) and len(cached[keys[0]]) == len(samples):
                samples.extra.update({k: cached[k] for k in keys})
                return
    path.parent.mkdir(parents=True, exist_ok=True)
    samples.extra.update(statistics.precompute(model, samples.images))
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **{k: samples.extra[k] for k in keys})
    tmp.replace(path)


def _feature_timing(
    config: PipelineConfig, model: torch.nn.Module, clean: Samples, statistics: Any, n: int = 1000
) -> dict[str, float]:
    """Transport vs Mahalanobis feature-extraction time on the same images (seed §5.4.6)."""
    images = clean.images[:n]
    device = str(networks.resolve_device(config.device))
    started = time.perf_counter()
    extract_features(model, images, device=device)
    timings = {
        "timing_images": float(len(images)),
        "transport_feature_seconds": time.perf_counter() - started,
    }
    if statistics is not None:
        from detector.mahalanobis import mahalanobis_features

        started = time.perf_counter()
        mahalanobis_features(model, images, statistics, magnitude=0.001)
        timings["mahalanobis_feature_seconds"] = time.perf_counter() - started
    return timings


def fit_deployable(
    config: PipelineConfig, run: Path, *, root: Path | None = None, progress: bool = True
) -> Path:
    """The detector that ships: class-conditional transport forests on the deploy network, trained
    on the training side (seed 0 split) of the chosen attacks, calibrated on held-out clean data."""
    from detector.calibration import Calibration

    out = run / DETECTOR_DIR
    if (out / "detector.json").is_file():
        return out
    sets = generate_attacks(config, run, root=root, progress=progress)
    name = config.deploy_model
    clean, attacks, _, _, _ = collect_samples(config, run, name, sets[name], root=root)
    keys = config.deploy_attacks or list(attacks)
    split = Split(0, config.test_fraction, int(clean.indices.max()) + 1)
    abnormal = concat([split.train(attacks[k]) for k in keys])
    train_clean = split.train(clean)
    detector = TransportDetector(random_state=0, n_jobs=-1).fit(
        np.concatenate([train_clean.features, abnormal.features]),
        np.concatenate([np.zeros(len(train_clean), bool), np.ones(len(abnormal), bool)]),
        np.concatenate([train_clean.predicted, abnormal.predicted]),
    )
    held_out = split.calibration(clean)
    calibration = Calibration.from_scores(
        detector.score(held_out.features, held_out.predicted), config.target_fpr
    )
    # What the shipped detector does on the test side it never saw (seed-0 B2): the flag rates a
    # deployment should reproduce, at the calibrated threshold.
    test_clean = split.test(clean)
    heldout = {
        "fpr": float(
            (
                detector.score(test_clean.features, test_clean.predicted) > calibration.threshold
            ).mean()
        ),
        "n_clean": len(test_clean),
        "flag_rate": {},
        "n": {},
    }
    for key in keys:
        test_attack = split.test(attacks[key])
        heldout["flag_rate"][key] = float(
            (
                detector.score(test_attack.features, test_attack.predicted) > calibration.threshold
            ).mean()
        )
        heldout["n"][key] = len(test_attack)
    arrays, params = detector.to_arrays()
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(
        {k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(out / "detector.safetensors")
    )
    (out / "detector.json").write_text(
        json.dumps(
            {
                "kind": "transport",
                "network": name,
                "train_attacks": keys,
                "params": params,
                "calibration": calibration.to_dict(),
                "heldout": heldout,
                "split_seed": 0,
                "test_fraction": config.test_fraction,
            },
            indent=2,
        )
    )
    return out


def write_results(
    config: PipelineConfig, run: Path, sets: dict[str, dict[str, adversarial.AdversarialSet]]
) -> dict[str, Any]:
    """results.json exactly as DESIGN.md §5, from the run directory's finished steps."""
    evaluation = json.loads((run / EVALUATION_FILE).read_text())
    models = {}
    for name in config.models:
        lines = [
            json.loads(line)
            for line in (run / "models" / name / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        models[name] = {
            "test_accuracy": lines[-1]["test_accuracy"],
            "epochs": lines[-1]["epoch"],
            "train_seconds": float(sum(r["epoch_seconds"] for r in lines)),
            "transport_cost": lines[-1]["test_transport"],
        }
    attacks: dict[str, dict[str, Any]] = {}
    for name in config.models:
        attacks[name] = {}
        for spec in config.attacks:
            found = sets[name][spec.key]
            summary = found.summary()
            attacks[name][spec.key] = {
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
    timing = evaluation["timing"]
    deploy_timing = timing.get(config.deploy_model, {})
    results = {
        "preset": config.name,
        "dataset": config.dataset,
        "models": models,
        "attacks": attacks,
        "detection": evaluation["detection"],
        "ood": evaluation["ood"],
        "timing": {
            "feature_extraction_seconds": {
                "transport": deploy_timing.get("transport_feature_seconds"),
                **(
                    {"mahalanobis": deploy_timing["mahalanobis_feature_seconds"]}
                    if "mahalanobis_feature_seconds" in deploy_timing
                    else {}
                ),
            },
            "images": deploy_timing.get("timing_images"),
            "per_model": timing,
        },
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads(),
        },
    }
    (run / RESULTS_FILE).write_text(json.dumps(results, indent=2))
    return results


def load_deployable(run: Path) -> tuple[TransportDetector, Any, dict[str, Any]]:
    """The detector written by :func:`fit_deployable`, its calibration and its description."""
    from safetensors.numpy import load_file

    from detector.calibration import Calibration

    directory = run / DETECTOR_DIR
    if not (directory / "detector.json").is_file():
        raise ArtefactError(
            f"no fitted detector in {directory}; run `lapguard fit --run {run}` first"
        )
    info = json.loads((directory / "detector.json").read_text())
    detector = TransportDetector.from_arrays(
        load_file(str(directory / "detector.safetensors")), info["params"]
    )
    calibration = Calibration.from_dict(info["calibration"])
    return detector, calibration, info


def write_run_bundle(run: Path, out: Path | None = None) -> Path:
    """The deployable bundle of a finished run (default RUN/bundle)."""
    from detector.bundle import write_bundle

    config = read_pipeline_config(run)
    detector, calibration, info = load_deployable(run)
    metrics: dict[str, float] = {"heldout_fpr": info["heldout"]["fpr"]}
    metrics.update(
        {f"heldout_flag_rate_{key}": rate for key, rate in info["heldout"]["flag_rate"].items()}
    )
    results_path = run / RESULTS_FILE
    if results_path.is_file():
        results = json.loads(results_path.read_text())
        network = info["network"]
        metrics["test_accuracy"] = float(results["models"][network]["test_accuracy"])
        seen = [
            r
            for r in results["detection"]
            if r["model"] == network and r["detector"] == "transport" and r["setting"] == "seen"
        ]
        if seen:
            metrics["seen_detection_accuracy_mean"] = float(np.mean([r["accuracy"] for r in seen]))
            metrics["seen_auroc_mean"] = float(np.mean([r["auroc"] for r in seen]))
    return write_bundle(
        out or run / BUNDLE_DIR,
        network_dir=run / "models" / info["network"],
        detector=detector,
        calibration=calibration,
        name=f"lapguard-{config.name}-{info['network']}",
        dataset=config.dataset,
        metrics=metrics,
    )


def run_pipeline(
    config: PipelineConfig, run: Path, *, root: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """All steps, each cached: re-running after an interruption resumes, a finished run is a no-op."""
    from training.report import write_report

    init_run(config, run)
    train_models(config, run, root=root, progress=progress)
    sets = generate_attacks(config, run, root=root, progress=progress)
    evaluate(config, run, root=root, progress=progress)
    fit_deployable(config, run, root=root, progress=progress)
    results = write_results(config, run, sets)
    write_report(run)
    write_run_bundle(run)
    return results
