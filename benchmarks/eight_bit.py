"""What the detector catches when adversarial images arrive as 8-bit images (PNG), as most
clients send them, and whether a stronger learner's gain survives that.

    .venv/bin/python benchmarks/eight_bit.py runs/quick [--split 0] [--budgets 0.04 0.02]

The attack sets are stored as float32. A minimal-perturbation attack (CW, DeepFool) leaves values
of a fraction of a grey level, on the flat background too, where every clean Fashion-MNIST image
is exactly 0; a PNG rounds them away (:func:`detector.preprocessing.quantize_uint8`, the tensor the
service decodes from that PNG). An image counts as successful when the network's label of what is
sent differs from the true label, so rounding can undo an attack.

1. **The shipped bundle** (``RUN/bundle``, the Guard, the server's scoring path) on the held-out
   test side of split seed 0 (the one its manifest's rates come from), at its calibrated
   threshold: the flag rate of each attack's successful images, as float32 and as 8-bit (the
   pipeline now records the 8-bit rates in the manifest, by the same function).
2. **Two learners on the training side** (the fit part of split seed ``--split``'s training
   side against its validation quarter; the test side is never read): the transport forests
   (the shipped recipe's class OR general forests) and scikit-learn's histogram gradient
   boosting, each fitted on the fit part's clean
   images against every attack in equal shares, once on the float32 attacked images and once on
   their 8-bit copies; each read where it flags ``--budgets`` of the validation clean images, on
   the successful validation images as float32 and as 8-bit.
3. **The same learners inside the shipped ensemble** (the deployed recipe, fitted on the 8-bit
   attacked images of the same fit part): the shipped ensemble, and its clean-only parts OR'd
   with gradient boosting instead of the forests; read at the threshold calibrated on the
   calibration slice (the config's target FPR and confidence, as the bundle is) and at
   ``--budgets`` of the validation clean images, on the successful 8-bit validation images and
   on the training-side OOD stand-ins (``ensemble_parts.ood_proxies``).

Chooses nothing: the figures are for reading.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from sklearn.ensemble import HistGradientBoostingClassifier

from detector.calibration import Calibration, calibrate_threshold
from detector.ensemble import PENULTIMATE_TAIL, EnsembleDetector
from detector.forest import TransportDetector
from detector.guard import Guard
from detector.preprocessing import quantize_uint8
from training.evaluation.context import PipelineRun, add_precomputed
from training.evaluation.deployable import (
    attack_family,
    equal_shares,
    sent_as_png,
    true_labels,
    with_family,
)
from training.evaluation.protocols import Samples, Split
from training.reporting.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import (  # noqa: E402
    masker,
    ood_proxies,
    open_run,
    run_arguments,
    validation_cut,
)

Scorer = Callable[[Samples], np.ndarray]
CLEAN_PARTS = ("novelty", "margin", "penultimate")  # the shipped ensemble's clean-only parts


def value_range(run: PipelineRun, name: str) -> tuple[float, float]:
    """The value range of network ``name``'s input."""
    return run.model(name).config.input_spec.value_range  # type: ignore[union-attr]


def as_8bit(run: PipelineRun, name: str, samples: Samples) -> Samples:
    """``samples`` as 8-bit images: features and labels recomputed by the run's network, and
    ``success`` (when the set has it) re-read as the new label differing from the true one."""
    images = quantize_uint8(samples.images, value_range(run, name))
    features, logits = run.extract(name, images, run.feature_spec(name))
    predicted = logits.argmax(1)
    success = None
    if samples.success is not None:
        success = predicted != true_labels(run, name, samples)
    extra = EnsembleDetector().precompute(run.model(name), images)
    return replace(
        samples, images=images, features=features, predicted=predicted, success=success, extra=extra
    )


def successful(samples: Samples) -> Samples:
    """The rows whose attack succeeded."""
    return samples.take(np.asarray(samples.success, bool))


def still_perturbed(samples: Samples, clean: Samples, value_range: tuple[float, float]) -> Samples:
    """The 8-bit rows that still differ from their clean source sent as 8-bit (the float sets'
    rule, :func:`training.evaluation.context.perturbed`, after rounding)."""
    row_of = {int(i): r for r, i in enumerate(clean.indices)}
    sources = clean.images[[row_of[int(i)] for i in samples.indices]]
    sources = quantize_uint8(sources, value_range)
    differs = (samples.images != sources).reshape(len(samples), -1).any(axis=1)
    return samples.take(differs)


def shipped_table(run: PipelineRun, name: str) -> list[list[str]]:
    """Per held-out attack set: n successful and the flagged share, float32 then 8-bit
    (:func:`training.evaluation.deployable.sent_as_png`, what the manifest records)."""
    guard = Guard.from_bundle(run.dir.bundle, device=run.device)
    data = run.samples(name)
    split = Split(0, run.config.test_fraction, int(data.clean.indices.max()) + 1)
    clean = guard.predict(split.test(data.clean).images)
    rows = [["clean (FPR)", str(len(clean.flagged)), f"{100 * clean.flagged.mean():.2f}", "", ""]]
    held_out = {k: split.test(v) for k, v in data.attacks.items()}
    png_scores, png_successful = sent_as_png(run, name, guard, held_out)
    for key, samples in held_out.items():
        fooled = np.asarray(samples.success, bool)
        flagged = guard.predict(samples.images[fooled]).flagged
        png_flagged = png_scores[key][png_successful[key]] > guard.threshold
        rows.append(
            [key, str(len(flagged)), f"{100 * flagged.mean():.2f}"]
            + [str(len(png_flagged)), f"{100 * png_flagged.mean():.2f}"]
        )
    return rows


@dataclass
class TrainingSide:
    """One split's training side: the fit part's clean images and attacked images (each attack
    marked with its family, float32 and 8-bit), the calibration slice, and the validation
    quarter's clean images and successful attacked images (float32 and 8-bit)."""

    fit_clean: Samples
    fit_float: list[Samples]
    fit_8bit: list[Samples]
    calibration_clean: Samples
    val_clean: Samples
    val_sets: dict[str, tuple[Samples, Samples]]

    @classmethod
    def of(cls, run: PipelineRun, name: str, split_seed: int) -> TrainingSide:
        data = run.samples(name)
        add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
        split, is_fit, is_val = validation_cut(run, name, split_seed)
        fit, val = masker(is_fit), masker(is_val)
        fit_float, fit_8bit, val_sets = [], [], {}
        for key, attack in data.attacks.items():
            family = attack_family(run.config, key)
            rounded = as_8bit(run, name, fit(attack))
            fit_float.append(with_family(fit(attack), family))
            fit_8bit.append(
                with_family(still_perturbed(rounded, data.clean, value_range(run, name)), family)
            )
            rows = val(attack)
            val_sets[key] = (successful(rows), successful(as_8bit(run, name, rows)))
        return cls(
            fit(data.clean),
            fit_float,
            fit_8bit,
            split.calibration(data.clean),
            val(data.clean),
            val_sets,
        )


def fitted_boosting(clean: Samples, abnormal: Samples) -> Scorer:
    """scikit-learn's histogram gradient boosting on ``clean`` against ``abnormal``: its score."""
    boosted = HistGradientBoostingClassifier(max_iter=300, random_state=0).fit(
        np.concatenate([clean.features, abnormal.features]),
        np.r_[np.zeros(len(clean)), np.ones(len(abnormal))],
    )
    return lambda s: boosted.predict_proba(s.features)[:, 1]


def flagged_cells(score: Scorer, sets: list[Samples], threshold: float) -> list[str]:
    """The share of each set scoring above ``threshold`` (%)."""
    return [f"{100 * np.mean(score(s) > threshold):.1f}" for s in sets]


def learners_table(side: TrainingSide, budgets: list[float]) -> tuple[list[str], list[list[str]]]:
    """The learners alone (header, rows), fitted on float32 then on 8-bit attacked images, read
    on the successful validation images, float32 / 8-bit."""
    rows = []
    for trained_on, parts in (("float32", side.fit_float), ("8-bit", side.fit_8bit)):
        abnormal = equal_shares(parts, seed=0)
        learners = {
            "transport forests": TransportDetector(n_jobs=-1)
            .fit_samples(side.fit_clean, abnormal)
            .score_samples,
            "gradient boosting": fitted_boosting(side.fit_clean, abnormal),
        }
        for learner, score in learners.items():
            clean_scores = score(side.val_clean)
            for budget in budgets:
                threshold = calibrate_threshold(clean_scores, budget)
                cells = [learner, trained_on, f"{100 * np.mean(clean_scores > threshold):.2f}"]
                for pair in side.val_sets.values():
                    cells.append(" / ".join(flagged_cells(score, list(pair), threshold)))
                rows.append(cells)
    header = ["learner", "attacked images fitted", "val. clean FPR (%)"]
    return header + [f"{k}: float / 8-bit" for k in side.val_sets], rows


def ensemble_scorers(side: TrainingSide) -> dict[str, Scorer]:
    """The shipped recipe fitted on the 8-bit attacked images, and its clean-only parts OR'd
    with gradient boosting fitted on the same rows instead of the forests."""
    abnormal = equal_shares(side.fit_8bit, seed=0)
    ensemble = EnsembleDetector(n_jobs=-1, penultimate_tail=PENULTIMATE_TAIL)
    ensemble = ensemble.fit_samples(side.fit_clean, abnormal)
    scorer, boosting = ensemble.to_torch(), fitted_boosting(side.fit_clean, abnormal)

    def clean_parts(samples: Samples) -> np.ndarray:
        columns = torch.from_numpy(EnsembleDetector._columns(samples, True)).float()
        with torch.inference_mode():
            parts = scorer.parts(columns, torch.from_numpy(samples.predicted))
        return torch.stack([parts[k] for k in CLEAN_PARTS]).amax(0).numpy()

    return {
        "shipped ensemble": ensemble.score_samples,
        "boosting OR the clean parts": lambda s: np.maximum(boosting(s), clean_parts(s)),
    }


def ensemble_table(
    run: PipelineRun, name: str, side: TrainingSide, budgets: list[float]
) -> tuple[list[str], list[list[str]]]:
    """Each ensemble variant (header, rows) at its calibrated threshold and at ``budgets`` of the
    validation clean images: successful 8-bit validation images and OOD stand-ins flagged."""
    proxies = ood_proxies(run, name, side.val_clean)
    sets = [rounded for _, rounded in side.val_sets.values()] + list(proxies.values())
    rows = []
    for variant, score in ensemble_scorers(side).items():
        calibration = Calibration.from_scores(
            score(side.calibration_clean),
            run.config.target_fpr,
            confidence=run.config.calibration_confidence,
        )
        clean_scores = score(side.val_clean)
        thresholds = [("calibrated", calibration.threshold)]
        thresholds += [
            (f"{100 * b:g}% of val. clean", calibrate_threshold(clean_scores, b)) for b in budgets
        ]
        for label, threshold in thresholds:
            fpr = f"{100 * np.mean(clean_scores > threshold):.2f}"
            rows.append([variant, label, fpr, *flagged_cells(score, sets, threshold)])
    header = ["detector", "threshold", "val. clean FPR (%)", *side.val_sets, *proxies]
    return header, rows


def main() -> None:
    parser = run_arguments(__doc__.splitlines()[0], split=True)
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.04, 0.02])
    args = parser.parse_args()
    run, name = open_run(args)
    clean = run.samples(name).clean
    gap = np.abs(quantize_uint8(clean.images, value_range(run, name)) - clean.images).max()
    print(f"Clean test images against their 8-bit copies: largest difference {gap:.1e}\n")
    print(f"The shipped bundle ({name}), held-out side of split 0, successful images:\n")
    header = ["set", "n float32", "flagged (%)", "n 8-bit", "flagged 8-bit (%)"]
    print(markdown_table(header, shipped_table(run, name)))
    side = TrainingSide.of(run, name, args.split)
    where = f"{name}, split {args.split}"
    print(f"\nTraining side ({where}): successful validation images flagged (%):\n")
    print(markdown_table(*learners_table(side, args.budgets)))
    print(f"\nThe ensembles fitted on 8-bit attacked images ({where}): flagged (%):\n")
    print(markdown_table(*ensemble_table(run, name, side, args.budgets)))


if __name__ == "__main__":
    main()
