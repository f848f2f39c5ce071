"""The transport detector's own decision, measured on the TRAINING side of a run.

The seed's detector flags a score (the larger vote fraction of the predicted class's forest and
the general forest) > 0.5. ``decision="oob"`` flags a score above the threshold of the best
balanced accuracy of the out-of-bag votes on its own fitting rows (an attacked image and its
clean source out of a tree's bag together). Per attack, on the deploy network's seed-0 training
side cut as in ``ensemble_parts.py`` (a validation quarter held out; the test side is never
read), one fit each: the seen analog's balanced accuracy (pairs: the attacked images and their
clean sources) at 0.5 and at the learnt threshold. Then the unseen analog: fitted on FGM eps=0.1
(then CW) of the fit part, the balanced accuracy of every other attack's validation rows against
the validation clean images, at both decisions. Then the ensemble (TR+NV, whose protocols read
it at 0.5) fitted the same two ways, read at 0.5 and with its forest part read at the forests'
own out-of-bag point (their vote mapped piecewise linearly so that point falls on 0.5; the
clean-only tails unchanged): clean FPR, the seen analog, the unseen analog's mean and lowest
attack (each attack's validation rows against their clean sources) and three training-side OOD
stand-ins. Every clean FPR is also split by whether the network classifies the image right.
Last, the time of the out-of-bag threshold against the fit's.

    .venv/bin/python benchmarks/forest_decision.py runs/quick
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from detector.base import abnormal_labels, source_groups
from detector.ensemble import EnsembleDetector
from detector.forest import TransportDetector
from training.evaluation.context import add_precomputed
from training.evaluation.deployable import misclassified

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_combiners import part_matrix, part_names  # noqa: E402
from ensemble_parts import ood_proxies, sources, training_side  # noqa: E402

UNSEEN_TRAIN = ("fgm-eps0.1", "cw")


def accuracy(clean: np.ndarray, abnormal: np.ndarray, threshold: float) -> tuple[float, ...]:
    """Balanced accuracy, clean FPR and TPR (%) at ``threshold`` (flag = score > threshold)."""
    fpr, tpr = float(np.mean(clean > threshold)), float(np.mean(abnormal > threshold))
    return 50 * (tpr + 1 - fpr), 100 * fpr, 100 * tpr


def fitted(clean: Any, abnormal: Any, timings: list[tuple[float, float]]) -> TransportDetector:
    """A transport detector with the out-of-bag decision, fitted, then its decision learnt;
    ``timings`` gets the (fit, out-of-bag decision) seconds."""
    detector = TransportDetector(class_conditional=True, decision="majority", n_jobs=-1)
    start = time.perf_counter()
    detector.fit_samples(clean, abnormal)
    fit_seconds = time.perf_counter() - start
    x = np.concatenate([clean.features, abnormal.features])
    predicted = np.concatenate([clean.predicted, abnormal.predicted])
    groups = source_groups(clean, abnormal)
    start = time.perf_counter()
    detector.set_params(decision="oob")._learn_decision(
        lambda: detector._oob_scores(x, predicted, groups), abnormal_labels(clean, abnormal)
    )
    timings.append((fit_seconds, time.perf_counter() - start))
    return detector


def decision_ramp(votes: np.ndarray, threshold: float) -> np.ndarray:
    """Votes mapped piecewise linearly so that ``threshold`` falls on 0.5 (0 and 1 stay)."""
    return np.where(
        votes <= threshold,
        0.5 * votes / threshold,
        0.5 + 0.5 * (votes - threshold) / (1 - threshold),
    )


def read_at(parts: np.ndarray, forest: int, point: float) -> np.ndarray:
    """The ensemble's score from its part scores, the forest part (column ``forest``) read at
    ``point`` (:func:`decision_ramp`), the others as they are."""
    ramped = decision_ramp(parts[:, forest], point)
    return np.maximum(ramped, np.delete(parts, forest, axis=1).max(1))


def fpr_cells(flagged: np.ndarray, wrong: np.ndarray) -> str:
    """The share of clean images flagged (%): every one, then (those the network classifies
    right / those it gets wrong)."""
    shares = (flagged.mean(), flagged[~wrong].mean(), flagged[wrong].mean())
    return "{:.2f} ({:.2f} / {:.2f})".format(*(100 * v for v in shares))


def ensemble_table(run: Any, name: str, data: Any, fit: Any, val: Any, wrong: np.ndarray) -> None:
    """The ensemble read at 0.5, and with its forests read at their out-of-bag point; ``wrong``:
    the validation clean images the network misclassifies."""
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    held_clean = val(data.clean)
    proxies = ood_proxies(run, name, held_clean)
    print("\nThe ensemble (TR+NV), balanced accuracy % at 0.5:\n")
    print(
        "| fitted on | forests read at | clean FPR (right / wrong) | seen | unseen mean "
        "| unseen lowest | stand-ins " + " / ".join(proxies) + " |"
    )
    print("|---|---|---:|---:|---:|---:|---|")  # fmt: skip
    for train in UNSEEN_TRAIN:
        attacked = fit(data.attacks[train])
        clean = sources(fit(data.clean), attacked)
        detector = EnsembleDetector(n_jobs=-1).fit_samples(clean, attacked)
        t = detector.forests_.decision_threshold()  # grouped, as the transport detector's
        first = part_names(detector, held_clean).index("forests")
        pairs = {k: (sources(held_clean, val(a)), val(a)) for k, a in data.attacks.items()}
        parts = {
            k: (part_matrix(detector, c), part_matrix(detector, a)) for k, (c, a) in pairs.items()
        }
        every_clean = part_matrix(detector, held_clean)
        outside = [part_matrix(detector, p) for p in proxies.values()]
        for label, point in (("0.5 (as shipped)", 0.5), (f"their point {t:.3f}", t)):
            score = partial(read_at, forest=first, point=point)
            acc = {k: accuracy(score(c), score(a), 0.5)[0] for k, (c, a) in parts.items()}
            unseen = [v for k, v in acc.items() if k != train]
            clean_scores = score(every_clean)
            fpr = fpr_cells(clean_scores > 0.5, wrong)
            stand_ins = [accuracy(clean_scores, score(p), 0.5)[0] for p in outside]
            cells = [train, label, fpr, f"{acc[train]:.2f}", f"{np.mean(unseen):.2f}"]
            cells += [f"{min(unseen):.2f}", " / ".join(f"{v:.1f}" for v in stand_ins)]
            print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    run, name, data, fit, val = training_side(__doc__.splitlines()[0])
    wrong = misclassified(run, name, val(data.clean))
    print(f"Validation clean images: {len(wrong)}, {wrong.sum()} of them misclassified.\n")
    timings: list[tuple[float, float]] = []
    print(f"Seen analog ({name}): balanced accuracy % (clean FPR / TPR) at 0.5 and learnt\n")
    print("| attack | threshold | at 0.5 | at the out-of-bag point |\n|---|---:|---:|---:|")
    means: list[tuple[float, float]] = []
    for key, attack in data.attacks.items():
        attacked, held = fit(attack), val(attack)
        detector = fitted(sources(fit(data.clean), attacked), attacked, timings)
        clean_rows = sources(val(data.clean), held)
        cs, ab = detector.score_samples(clean_rows), detector.score_samples(held)
        t = detector.decision_threshold()
        half, learnt = accuracy(cs, ab, 0.5), accuracy(cs, ab, t)
        means.append((half[0], learnt[0]))
        cells = [f"{a:.2f} ({f:.2f} / {p:.2f})" for a, f, p in (half, learnt)]
        print(f"| {key} | {t:.3f} | " + " | ".join(cells) + " |", flush=True)
    print("| mean | | " + " | ".join(f"{v:.2f}" for v in np.mean(means, axis=0)) + " |")
    for train in UNSEEN_TRAIN:
        attacked = fit(data.attacks[train])
        detector = fitted(sources(fit(data.clean), attacked), attacked, timings)
        clean = detector.score_samples(val(data.clean))
        t = detector.decision_threshold()
        print(f"\nUnseen analog, fitted on {train} (threshold {t:.3f}): balanced accuracy %\n")
        print("| attack | at 0.5 | at the out-of-bag point |\n|---|---:|---:|")
        rows = []
        for key, attack in data.attacks.items():
            if key == train:
                continue
            scores = detector.score_samples(val(attack))
            rows.append((accuracy(clean, scores, 0.5)[0], accuracy(clean, scores, t)[0]))
            print(f"| {key} | {rows[-1][0]:.2f} | {rows[-1][1]:.2f} |")
        print("| mean | " + " | ".join(f"{v:.2f}" for v in np.mean(rows, axis=0)) + " |")
        print(
            "clean FPR (right / wrong): "
            + " -> ".join(fpr_cells(clean > p, wrong) for p in (0.5, t))
        )
    ensemble_table(run, name, data, fit, val, wrong)
    fit_s, oob_s = np.sum(timings, axis=0)
    print(f"\nfits {fit_s:.1f} s, out-of-bag thresholds {oob_s:.1f} s ({100 * oob_s / fit_s:.1f}%)")


if __name__ == "__main__":
    main()
