"""The evaluation step: the seen, unseen and OOD detection protocols on every network of a run
(seed 003 §5.4.2), written to ``evaluation.json`` with first-seed scores and feature timings."""

from __future__ import annotations

import time
from typing import Any

from detector import artefacts
from detector.base import Detector
from detector.mahalanobis import mahalanobis_features
from detector.registry import detector_info, get_detector
from training.data.datasets import load_dataset, to_arrays
from training.data.network_images import in_input_spec
from training.evaluation.context import NetworkSamples, PipelineRun, add_precomputed, noisy_copies
from training.evaluation.learning_curves import run_learning_curves
from training.evaluation.protocols import on_all_cores, run_protocols, save_first_scores


def evaluate(run: PipelineRun) -> dict[str, Any]:
    """The detection protocols on every network; writes evaluation.json and first-seed scores."""
    path = run.dir.evaluation_file
    if path.is_file():
        return dict(artefacts.read_json(path, what="evaluation"))
    detection: list[dict[str, Any]] = []
    ood_rows: list[dict[str, Any]] = []
    timing: dict[str, Any] = {}
    feature_sets: dict[str, dict[str, str]] = {}
    for name in run.config.network_names:
        network_reader = None
        for group in _feature_groups(run, name):
            data = run.samples(name, group[0])
            detectors = _protocol_detectors(run, name, data, group)
            records = run_protocols(
                model=name,
                clean=data.clean,
                attacks=data.attacks,
                ood_sets=data.ood,
                detectors=detectors,
                seen=run.config.seen_keys,
                unseen_train=run.config.unseen_train,
                ood_train=run.config.ood_train,
                seeds=list(range(run.config.seeds)),
                test_fraction=run.config.test_fraction,
                target_fpr=run.config.target_fpr,
                noisy_copies=noisy_copies(run, name, group[0]) if run.config.noisy_copies else None,
                ood_clean_ratio=run.config.ood_clean_ratio,
                ood_train_sets=data.ood_train,
                progress=run.progress,
            )
            save_first_scores(records, run.dir.scores)
            for record in records:
                (ood_rows if record.setting == "ood" else detection).append(record.row())
            reads_network = (d for d in detectors if d.info.reads == "network")
            network_reader = network_reader or next(reads_network, None)
        feature_sets[name] = {
            d: run.feature_spec(name, d).label()
            for d in run.config.detectors
            if detector_info(d).reads == "features"
        }
        timing[name] = run.samples(name).timing | _feature_timing(run, name, network_reader)
    result = {
        "detection": detection,
        "ood": ood_rows,
        "timing": timing,
        "feature_sets": feature_sets,
    }
    result["learning_curves"] = run_learning_curves(run)
    artefacts.write_json(path, result)
    return result


def _feature_groups(run: PipelineRun, name: str) -> list[list[str]]:
    """The config's detectors grouped by the feature set they read on network ``name``, in
    config order: one protocol run per group, so the ensemble reuses the transport forests
    whenever both read the same set."""
    groups: dict[str, list[str]] = {}
    for detector in run.config.detectors:
        groups.setdefault(run.feature_spec(name, detector).label(), []).append(detector)
    return list(groups.values())


def _protocol_detectors(
    run: PipelineRun, name: str, data: NetworkSamples, names: list[str]
) -> list[Detector]:
    """The detectors ``names`` from the registry. Those that read the network learn their clean
    statistics once; every detector with per-image arrays (``precompute``: Mahalanobis scores,
    NSS statistics) adds them, cached on disk, to every sample set once, for all its fits."""
    params = {"mahalanobis": {"magnitudes": tuple(run.config.mahalanobis_magnitudes)}}
    detectors = [on_all_cores(get_detector(d, **params.get(d, {}))) for d in names]
    for detector in detectors:
        if detector.info.reads == "network":
            clean_x, clean_y = to_arrays(
                load_dataset(run.config.dataset, "train", root=run.root),
                run.config.mahalanobis_clean_n,
                seed=1,
            )
            model = run.model(name)
            spec = model.config.input_spec  # type: ignore[union-attr]
            detector.prepare(model, in_input_spec(clean_x, spec), clean_y)
        sets = [data.clean, *data.attacks.values(), *data.ood.values(), *data.ood_train.values()]
        add_precomputed(run, name, detector, sets)
    return detectors


def _feature_timing(
    run: PipelineRun, name: str, network_reader: Any, n: int = 1000
) -> dict[str, float]:
    """Transport vs Mahalanobis feature-extraction time on the same images (seed §5.4.6)."""
    model, images = run.model(name), run.samples(name).clean.images[:n]
    started = time.perf_counter()
    run.extract(name, images)
    timings = {
        "timing_images": float(len(images)),
        "transport_feature_seconds": time.perf_counter() - started,
    }
    if network_reader is not None:
        started = time.perf_counter()
        mahalanobis_features(model, images, network_reader, magnitude=0.001)
        timings["mahalanobis_feature_seconds"] = time.perf_counter() - started
    return timings
