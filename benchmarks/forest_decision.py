"""The transport detector's own decision, measured on the TRAINING side of a run.

The seed's detector flags a score (the larger vote fraction of the predicted class's forest and
the general forest) > 0.5. ``decision="oob"`` flags a score above the threshold of the best
balanced accuracy of the out-of-bag votes on its own fitting rows (an attacked image and its
clean source out of a tree's bag together). Per attack, on the deploy network's seed-0 training
side cut as in ``ensemble_parts.py`` (a validation quarter held out; the test side is never
read), one fit each: the seen analog's balanced accuracy (pairs: the attacked images and their
clean sources) at 0.5 and at the learnt threshold. Then the unseen analog: fitted on FGM eps=0.1
(then CW) of the fit part, the balanced accuracy of every other attack's validation rows against
the validation clean images, at both decisions. Last, the time of the out-of-bag threshold
against the fit's.

    .venv/bin/python benchmarks/forest_decision.py runs/quick
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from detector.base import abnormal_labels, source_groups
from detector.forest import TransportDetector

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import sources, training_side  # noqa: E402

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


def main() -> None:
    _, name, data, fit, val = training_side(__doc__.splitlines()[0])
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
            f"clean FPR: {accuracy(clean, clean, 0.5)[1]:.2f} -> {accuracy(clean, clean, t)[1]:.2f}"
        )
    fit_s, oob_s = np.sum(timings, axis=0)
    print(f"\nfits {fit_s:.1f} s, out-of-bag thresholds {oob_s:.1f} s ({100 * oob_s / fit_s:.1f}%)")


if __name__ == "__main__":
    main()
