"""Synthetic outliers in the deployed ensemble, measured on the TRAINING side of a finished quick
run only (cut as ``ensemble_parts.py``: a fit part and a validation quarter; the test side is
never read).

1. Do forests that learn some transforms flag another? Transport forests (class OR general) on
   the fit part's clean images against synthetic outliers (:mod:`training.data.synthetic_outliers`)
   of all transforms but one; the share flagged at 0.5 of the left-out transform's outliers,
   made from validation images, and of the validation clean images.
2. The deployed analog (every attack in equal shares, threshold calibrated on the calibration
   slice) without and with ``N`` synthetic outliers as a family of their own (pooled forests on
   attacks only, as ``fit_deployable``): the successful validation images flagged per attack,
   and two stand-ins no transform makes (pixels shuffled; the 2 x 2 tiles shuffled).

    .venv/bin/python benchmarks/synthetic_outliers.py runs/quick [--n 1800]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from detector.ensemble import EnsembleDetector
from detector.forest import TransportDetector
from training.data.synthetic_outliers import SYNTHETIC_TRANSFORMS, synthetic_outliers
from training.evaluation.context import PipelineRun, add_precomputed
from training.evaluation.deployable import (
    attack_family,
    equal_shares,
    fit_with_outliers,
    with_family,
)
from training.evaluation.protocols import Samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import (  # noqa: E402
    deployed_cells,
    image_samples,
    masker,
    ood_proxies,
    open_run,
    run_arguments,
    validation_cut,
)


def quarters_shuffled(images: np.ndarray, seed: int = 0) -> np.ndarray:
    """Each image's 2 x 2 tiles in a random order (no synthetic transform makes this)."""
    rng, out = np.random.default_rng(seed), images.copy()
    h, w = images.shape[2] // 2, images.shape[3] // 2
    tiles = [(slice(0, h), slice(0, w)), (slice(0, h), slice(w, 2 * w))]
    tiles += [(slice(h, 2 * h), slice(0, w)), (slice(h, 2 * h), slice(w, 2 * w))]
    for i, order in enumerate(np.argsort(rng.random((len(images), 4)), axis=1)):
        for target, source in zip(tiles, (tiles[j] for j in order), strict=True):
            out[i, :, target[0], target[1]] = images[i, :, source[0], source[1]]
    return out


def left_out_table(run: PipelineRun, name: str, fit_images: np.ndarray, val: Samples) -> None:
    value_range = run.model(name).config.input_spec.value_range  # type: ignore[union-attr]
    made, kinds = synthetic_outliers(fit_images, value_range, seed=0)
    held, held_kinds = synthetic_outliers(np.repeat(val.images[:300], 6, axis=0), value_range)
    outliers = image_samples(run, name, "synthetic", made)
    tests = image_samples(run, name, "held-out", held)
    clean = run.samples(name).clean
    fit_clean = masker(validation_cut(run, name)[1])(clean)
    print("\n| left out | clean FPR at 0.5 | left-out transform flagged at 0.5 |\n|---|---:|---:|")
    for left in SYNTHETIC_TRANSFORMS:
        rows = outliers.take(kinds != left)
        detector = TransportDetector(class_conditional=True, n_jobs=-1).fit_samples(fit_clean, rows)
        fpr = np.mean(detector.score_samples(val) > 0.5)
        flagged = np.mean(detector.score_samples(tests.take(held_kinds == left)) > 0.5)
        print(f"| {left} | {100 * fpr:.2f} | {100 * flagged:.1f} |", flush=True)


def main() -> None:
    parser = run_arguments(__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1800, help="synthetic outliers (default 1800)")
    args = parser.parse_args()
    run, name = open_run(args)
    data = run.samples(name)
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    split, is_fit, is_val = validation_cut(run, name)
    fit, val = masker(is_fit), masker(is_val)
    chosen = np.random.default_rng(0).permutation(len(fit(data.clean)))[: args.n]
    fit_images = fit(data.clean).images[np.sort(chosen)]
    left_out_table(run, name, fit_images, val(data.clean))

    proxies = ood_proxies(run, name, val(data.clean))
    stand_ins = {"pixels shuffled": proxies["shuffled"]}
    quarters = quarters_shuffled(val(data.clean).images[:1000])
    stand_ins["2 x 2 tiles shuffled"] = image_samples(run, name, "quarters", quarters)
    value_range = run.model(name).config.input_spec.value_range  # type: ignore[union-attr]
    synthetic = image_samples(
        run, name, "synthetic", synthetic_outliers(fit_images, value_range)[0]
    )
    keys = list(data.attacks)
    print(f"\nDeployed analog ({name}), successful validation images flagged (%):\n")
    print("| synthetic | threshold | clean FPR | " + " | ".join([*keys, *stand_ins]) + " |")
    print("|---" + "|---:" * (len(keys) + len(stand_ins) + 2) + "|")
    attacks = [with_family(fit(a), attack_family(run.config, k)) for k, a in data.attacks.items()]
    for rows in (0, args.n):
        detector = fit_with_outliers(
            EnsembleDetector(n_jobs=-1),
            fit(data.clean),
            equal_shares(attacks, seed=0),
            with_family(synthetic, "synthetic") if rows else None,
        )
        threshold = calibrated(run, detector, split.calibration(data.clean))
        held_out = [val(data.attacks[k]) for k in keys]
        cells = [str(rows), *deployed_cells(detector, threshold, val(data.clean), held_out)]
        cells += [
            f"{100 * np.mean(detector.score_samples(s) > threshold):.1f}"
            for s in stand_ins.values()
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


def calibrated(run: PipelineRun, detector: EnsembleDetector, clean: Samples) -> float:
    """The threshold calibrated as the bundle's (the config's FPR target and confidence)."""
    from detector.calibration import Calibration

    scores = detector.score_samples(clean)
    config = run.config
    return Calibration.from_scores(
        scores, config.target_fpr, confidence=config.calibration_confidence
    ).threshold


if __name__ == "__main__":
    main()
