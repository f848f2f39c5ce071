"""Where the ensemble's own decision could sit: what a lower clean-FPR budget at the decision costs
the unseen attacks, measured on the TRAINING side of a finished run only.

    .venv/bin/python benchmarks/decision_budget.py runs/quick

The OOD protocol scores balanced accuracy at the ensemble's decision. An OOD set that is
flagged in full there scores (1 + 1 - clean FPR) / 2, so the issue's noise mark (>= 99) needs a
clean FPR <= 2% at the decision; at 0.5 the ensemble spends ~4% (its three clean-only parts each
flag about half of their 2.5% tail). This script measures the trade on the deploy network's
seed-0 training side, cut as ``ensemble_parts.py`` cuts it (a validation quarter held out; the
test side is never read). Per training attack (the unseen analog's FGM eps=0.1, and CW), the
ensemble is fitted on the fit part's attacked images and clean fit-part images drawn as the OOD
protocol draws them (the run's ``ood_clean_ratio``), and:

1. **the shipped score, its decision moved**: the decision is placed where the score flags
   ``budget`` of the fitting clean images' held-out scores (:meth:`EnsembleDetector.
   held_out_scores`: out-of-bag votes, the nearest clean image of another source), or of the
   seed's calibration slice (held-out clean images of the training side, already scored by the
   protocols for the calibrated threshold), as a deployment would place a design budget without
   reading any test image;
2. **every part read through its clean CDF**: the pooled forests' vote is read as the share of
   the fitting clean images' out-of-bag votes at most it (the clean-only parts already are), each
   part ramped over its own clean tail (``forest tail`` / ``clean tail``), the max, decision 0.5.

Cells: the held-out and the validation clean FPR at the decision (%), each other attack's
balanced accuracy on the validation rows against every validation clean image (as the OOD
protocol's clean side, the network's own mistakes included), their mean and lowest, and the
three training-side OOD stand-ins. Chooses nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detector.calibration import calibrate_threshold
from detector.ensemble import EnsembleDetector, tail_ramp
from training.evaluation.context import add_precomputed
from training.evaluation.protocols import Samples, balanced_draw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import ood_proxies, training_side, validation_cut  # noqa: E402

TRAIN_ATTACKS = ("fgm-eps0.1", "cw")
BUDGETS = (0.03, 0.025, 0.02, 0.015, 0.01)
FOREST_TAILS = (0.005, 0.01, 0.02, 0.025)
CLEAN_TAILS = (0.005, 0.01, 0.02, 0.025)
CLEAN_PARTS = ("novelty", "margin", "penultimate")
WHOLE = 0.99999  # a tail that leaves a part's clean CDF as it is
Parts = dict[str, np.ndarray]


def ramp(u: np.ndarray, tail: float) -> np.ndarray:
    """The ensemble's tail ramp (:func:`detector.ensemble.tail_ramp`) of a numpy array."""
    return tail_ramp(torch.from_numpy(u), tail).numpy().astype(np.float64)


def part_reader(clean: Samples, attacked: Samples) -> tuple[Callable[[Samples], Parts], Parts]:
    """A reader of each part's raw score (the forests' vote, the clean-only parts' clean CDF) of
    an ensemble fitted on ``clean`` vs ``attacked``, and the fitting clean rows' held-out parts
    (rows where some forest had no out-of-bag tree dropped)."""
    detector = EnsembleDetector(
        n_jobs=-1, tail=WHOLE, margin_tail=WHOLE, penultimate_tail=WHOLE
    ).fit_samples(clean, attacked)
    scorer = detector.to_torch()

    def read(samples: Samples) -> Parts:
        rows = torch.from_numpy(detector.serving_rows(samples).astype(np.float32))
        with torch.inference_mode():
            parts = scorer.parts(rows, torch.from_numpy(samples.predicted))
        return {k: v.numpy().astype(np.float64) for k, v in parts.items()}

    rows = detector.serving_rows(clean)
    width = detector.penultimate_width_
    x = rows[:, : rows.shape[1] - width].astype(np.float32)
    votes, trees = detector.forests_.held_out_scores(x, clean.predicted, clean.indices)
    ramps = detector._ramps(x, rows[:, x.shape[1] :], clean.predicted, clean.indices)
    held = {"forests": votes, **dict(zip(CLEAN_PARTS, ramps, strict=True))}
    return read, {k: np.asarray(v, np.float64)[trees > 0] for k, v in held.items()}


def shipped(parts: Parts, tail: float = 0.025) -> np.ndarray:
    """The shipped combination: the forests' vote OR each clean-only part's tail ramp."""
    return np.maximum(parts["forests"], np.max([ramp(parts[c], tail) for c in CLEAN_PARTS], 0))


def through_cdf(
    reference: np.ndarray, forest_tail: float, clean_tail: float
) -> Callable[[Parts], np.ndarray]:
    """The combination with the forests' vote read as its share of the sorted held-out clean
    ``reference`` votes, every part over its own tail."""

    def score(parts: Parts) -> np.ndarray:
        u = np.searchsorted(reference, parts["forests"], side="right") / len(reference)
        clean = np.max([ramp(parts[c], clean_tail) for c in CLEAN_PARTS], 0)
        return np.maximum(ramp(u, forest_tail), clean)

    return score


def row(
    label: str,
    score: Callable[[Parts], np.ndarray],
    threshold: float,
    held: Parts,
    sets: dict[str, Parts],
    n_attacks: int,
) -> str:
    """A table row: held-out and validation clean FPR, each set's balanced accuracy, the
    attacks' mean and lowest (the first ``n_attacks`` sets after 'clean')."""
    fpr = float(np.mean(score(sets["clean"]) > threshold))
    held_fpr = float(np.mean(score(held) > threshold))
    names = [k for k in sets if k != "clean"]
    accuracy = [100 * (np.mean(score(sets[k]) > threshold) + 1 - fpr) / 2 for k in names]
    attacks = accuracy[:n_attacks]
    cells = [label, f"{threshold:.3f}", f"{100 * held_fpr:.2f}", f"{100 * fpr:.2f}"]
    cells += [f"{a:.1f}" for a in attacks] + [f"{np.mean(attacks):.1f}", f"{min(attacks):.1f}"]
    cells += [f"{a:.1f}" for a in accuracy[n_attacks:]]
    return "| " + " | ".join(cells) + " |"


def tables(
    train: str,
    data: Any,
    fit: Callable[[Samples], Samples],
    val: Callable[[Samples], Samples],
    proxies: dict[str, Samples],
    calibration: Samples,
    clean_ratio: float | None,
) -> None:
    """Both tables for the ensemble fitted on ``train`` against clean fit-part images drawn as
    the OOD protocol draws them (``clean_ratio``: the run's ``ood_clean_ratio``)."""
    attacked = fit(data.attacks[train])
    clean, _ = balanced_draw(fit(data.clean), attacked, np.random.default_rng(0), clean_ratio)
    read, held = part_reader(clean, attacked)
    others = [k for k in data.attacks if k != train]
    sets = {"clean": read(val(data.clean))}
    sets |= {k: read(val(data.attacks[k])) for k in others}
    sets |= {k: read(v) for k, v in proxies.items()}
    header = ["rule", "decision", "held-out clean FPR", "validation clean FPR", *others]
    header += ["mean", "lowest", *proxies]
    print(f"\nForests on {train} ({len(held['forests'])} held-out clean fitting images):\n")
    print("| " + " | ".join(header) + " |\n|---" + "|---:" * (len(header) - 1) + "|")
    held_scores = shipped(held)
    print(row("shipped, at 0.5", shipped, 0.5, held, sets, len(others)))
    for budget in BUDGETS:
        threshold = calibrate_threshold(held_scores, budget)
        print(row(f"shipped, {budget:g} budget", shipped, threshold, held, sets, len(others)))
    slice_scores = shipped(read(calibration))
    for budget in BUDGETS:
        threshold = calibrate_threshold(slice_scores, budget)
        label = f"shipped, {budget:g} of the calibration slice"
        print(row(label, shipped, threshold, held, sets, len(others)))
    reference = np.sort(held["forests"])
    for forest_tail in FOREST_TAILS:
        for clean_tail in CLEAN_TAILS:
            score = through_cdf(reference, forest_tail, clean_tail)
            label = f"through the CDF, forest tail {forest_tail:g}, clean tail {clean_tail:g}"
            print(row(label, score, 0.5, held, sets, len(others)), flush=True)


def main() -> None:
    run, name, data, fit, val = training_side(__doc__.splitlines()[0])
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    proxies = ood_proxies(run, name, val(data.clean))
    calibration = validation_cut(run, name)[0].calibration(data.clean)
    for train in TRAIN_ATTACKS:
        tables(train, data, fit, val, proxies, calibration, run.config.ood_clean_ratio)


if __name__ == "__main__":
    main()
