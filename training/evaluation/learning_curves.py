"""Learning curves: seen-setting detection accuracy vs the number of training pairs.

For each seed, the seen protocol's split (:class:`~training.evaluation.protocols.Sides`) gives an attack's
B1 pairs (attacked image + its clean source) and its B2 test side. The detector is fitted on
growing, nested subsets of the B1 pairs and tested on the whole B2 side, so the curve's last
point ("all" pairs) is the seen protocol's own result. Points are mean ± std over the seeds.

``results.json`` holds them under ``learning_curves``::

    {"lap": {"cw": [{"pairs": 25, "accuracy": 0.61, "accuracy_std": 0.05, "runs": 5,
                     "auroc": 0.66, "auroc_std": 0.04}, ...]}}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from detector.base import Detector
from detector.registry import get_detector
from training.evaluation.context import PipelineRun, noisy_copies
from training.evaluation.protocols import (
    Samples,
    Sides,
    evaluate_fitted,
    index_universe,
    on_all_cores,
)

SIZES = (25, 50, 100, 200, 400, 800, 1600, 3200, 6400)
CURVE_DETECTOR = "transport"
CURVE_METRICS = ("accuracy", "auroc")


def curve_sizes(available: int, sizes: Sequence[int] = SIZES) -> list[int]:
    """The sizes below ``available`` training pairs, then ``available`` itself ("all")."""
    return [n for n in sorted(sizes) if n < available] + [available]


def _point(pairs: float, outcomes: list[dict[str, float]]) -> dict[str, Any]:
    """Mean ± std of each metric over the seeds' outcomes at one size."""
    point: dict[str, Any] = {"pairs": int(round(pairs))}
    for key in CURVE_METRICS:
        values = np.array([o[key] for o in outcomes])
        point[key], point[f"{key}_std"] = float(values.mean()), float(values.std())
    point["runs"] = len(outcomes)
    return point


def learning_curve(
    prototype: Detector,
    sides: Sequence[Sides],
    attack: Samples,
    *,
    target_fpr: float = 0.05,
    sizes: Sequence[int] = SIZES,
) -> list[dict[str, Any]]:
    """One point per training-set size: the detector fitted on that many B1 pairs of ``attack``
    (per seed of ``sides``), tested on the attack's whole B2 side. Sizes are those below the
    smallest B1 side over the seeds, then "all" (``pairs``: the mean B1 count)."""
    available = [len(side.split.train(attack)) for side in sides]
    steps: list[int | None] = [*curve_sizes(min(available), sizes)[:-1], None]
    points = []
    for n in steps:
        outcomes = []
        for side in sides:
            (train_clean, train_abnormal), (test_clean, test_abnormal) = side.pairs(attack, n)
            detector = prototype.with_seed(side.seed).fit_samples(train_clean, train_abnormal)
            outcome = evaluate_fitted(
                detector, side.calibration_clean, test_clean, test_abnormal, target_fpr
            )
            outcomes.append(outcome.metrics)
        points.append(_point(n if n is not None else float(np.mean(available)), outcomes))
    return points


def run_learning_curves(run: PipelineRun) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The config's learning curves on the deploy network, with the seen protocol's splits."""
    config, name = run.config, run.config.deploy_model
    if not config.learning_curve_attacks:
        return {}
    data = run.samples(name, CURVE_DETECTOR)
    noisy = noisy_copies(run, name, CURVE_DETECTOR) if config.noisy_copies else None
    universe = index_universe(data.clean, data.attacks)
    sides = [
        Sides.of(seed, config.test_fraction, universe, data.clean, noisy)
        for seed in range(config.seeds)
    ]
    prototype = on_all_cores(get_detector(CURVE_DETECTOR))
    curves = {}
    for key in tqdm(
        config.learning_curve_attacks, desc=f"learning curves ({name})", disable=not run.progress
    ):
        curves[key] = learning_curve(
            prototype, sides, data.attacks[key], target_fpr=config.target_fpr
        )
    return {name: curves}
