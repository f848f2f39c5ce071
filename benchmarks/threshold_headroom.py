"""Where the deployed analog's calibrated threshold lands, and what each attack would get at other
clean FPRs: measured on the TRAINING side of a finished run (the deploy network's split, seed 0
unless ``--split``, cut as ensemble_parts.py cuts it).

The deployed analog (every attack in equal shares on the fit part, with the penultimate part)
is calibrated on the calibration slice as the bundle is (the config's FPR target and
confidence). Printed: the threshold and its FPR on the calibration slice and on the validation
quarter's clean images; then, per attack, the share of its successful validation images flagged
at the calibrated threshold and at the thresholds that flag 3, 4 and 5% of the validation clean
images. The gap between the calibrated column and the others is what a calibration that lands
closer to the target would buy; nothing here is a threshold to ship.

One such calibration, cross-fitted (``--folds K``, default 5; 0: none): K analogs, each fitted
without one fold of the fit part's source images, score that fold's clean images; the threshold
is calibrated (same target and confidence) on those out-of-fold scores together with the full
analog's calibration-slice scores, and applied to the full analog. The column "+ fitting
images" is the calibration ``training.evaluation.deployable.deploy`` ships: the slice's scores with the
fit part's clean images scored by what never saw them (``Detector.score_held_out``), no refit.

    .venv/bin/python benchmarks/threshold_headroom.py runs/quick [--split 1] [--folds 5]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from detector.calibration import Calibration, calibrate_threshold
from detector.ensemble import EnsembleDetector
from training.evaluation.context import NetworkSamples, PipelineRun, add_precomputed
from training.evaluation.protocols import Samples, Split
from training.reporting.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import deployed_analog, masker, open_run, run_arguments, validation_cut  # noqa: E402

VALIDATION_FPRS = (0.03, 0.04, 0.05)
FOLD_SEED = 1


def out_of_fold_clean(
    run: PipelineRun,
    name: str,
    data: NetworkSamples,
    split: Split,
    is_fit: np.ndarray,
    split_seed: int,
    folds: int,
) -> np.ndarray:
    """Scores of the fit part's clean images, each by an analog fitted without its fold."""
    fold = np.random.default_rng(FOLD_SEED).integers(0, folds, len(is_fit))
    scores = []
    for k in range(folds):
        keep = masker((is_fit & (fold != k)) | split.is_calibration)  # the analog calibrates too
        attacks = {key: keep(attacked) for key, attacked in data.attacks.items()}
        detector, _ = deployed_analog(
            run, name, keep(data.clean), attacks, split_seed=split_seed, penultimate_tail=0.025
        )
        scores.append(detector.score_samples(masker(is_fit & (fold == k))(data.clean)))
        print(f"fold {k + 1}/{folds} scored", flush=True)
    return np.concatenate(scores)


def with_fitting_images(
    detector: EnsembleDetector, fitting: Samples, calibration: np.ndarray, run: PipelineRun
) -> float:
    """The threshold calibrated (same target and confidence) on the calibration slice's scores
    and the fitting clean images' held-out scores (``Detector.score_held_out``), as
    ``training.evaluation.deployable.calibration_clean_scores`` gives them."""
    held_out = detector.score_held_out(fitting)
    assert held_out is not None
    scores = np.concatenate([calibration, held_out[np.isfinite(held_out)]])
    print(
        f"{np.isfinite(held_out).sum()} of {len(fitting)} fitting clean images have held-out scores"
    )
    return Calibration.from_scores(
        scores, run.config.target_fpr, confidence=run.config.calibration_confidence
    ).threshold


def main() -> None:
    parser = run_arguments(__doc__.splitlines()[0], split=True)
    parser.add_argument("--folds", type=int, default=5, help="cross-fitting folds (0: none)")
    args = parser.parse_args()
    run, name = open_run(args)
    data = run.samples(name)
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    split, is_fit, is_validation = validation_cut(run, name, args.split)
    val = masker(is_validation)
    detector, calibrated = deployed_analog(
        run, name, data.clean, data.attacks, split_seed=args.split, penultimate_tail=0.025
    )
    clean = detector.score_samples(val(data.clean))
    calibration = detector.score_samples(split.calibration(data.clean))
    print(
        f"split {args.split}: calibrated threshold {calibrated:.3f} flags "
        f"{100 * np.mean(calibration > calibrated):.2f}% of the {len(calibration)} calibration "
        f"and {100 * np.mean(clean > calibrated):.2f}% of the {len(clean)} validation clean images\n"
    )
    thresholds = [calibrated, *(calibrate_threshold(clean, f) for f in VALIDATION_FPRS)]
    header = ["attack", "n", f"calibrated ({calibrated:.3f})"]
    with_fitting = with_fitting_images(detector, masker(is_fit)(data.clean), calibration, run)
    thresholds.insert(1, with_fitting)
    header.append(f"+ fitting images ({with_fitting:.3f})")
    print(
        f"calibrated with the fitting clean images' held-out scores too (as deploy calibrates): "
        f"threshold {with_fitting:.3f} flags {100 * np.mean(clean > with_fitting):.2f}% of the "
        "validation clean images\n"
    )
    if args.folds:
        pooled = np.concatenate(
            [out_of_fold_clean(run, name, data, split, is_fit, args.split, args.folds), calibration]
        )
        crossed = Calibration.from_scores(
            pooled, run.config.target_fpr, confidence=run.config.calibration_confidence
        ).threshold
        print(
            f"cross-fitted threshold {crossed:.3f} ({len(pooled)} clean images) flags "
            f"{100 * np.mean(clean > crossed):.2f}% of the validation clean images\n"
        )
        thresholds.insert(2, crossed)
        header.append(f"cross-fitted ({crossed:.3f})")
    header += [
        f"val FPR {100 * f:.0f}% ({t:.3f})"
        for f, t in zip(VALIDATION_FPRS, thresholds[-len(VALIDATION_FPRS) :], strict=True)
    ]
    rows = []
    for key, attacked in data.attacks.items():
        rows_val = val(attacked)
        scores = detector.score_samples(rows_val)[np.asarray(rows_val.success, bool)]
        rows.append(
            [key, str(len(scores)), *(f"{100 * np.mean(scores > t):.1f}" for t in thresholds)]
        )
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
