"""Would the forests flag fewer of the network's own mistakes if they weighed them more?

    .venv/bin/python benchmarks/hard_negatives.py runs/quick

A detector that learns CW flags many clean images the network misclassifies (session 41: the
ensemble fitted on CW flags 34-46% of them at 0.5): both sit just over a decision boundary. The
OOD protocol counts those flags as false positives, and they cap CW -> noise and CW -> digits.
Here the clean images the network gets wrong are repeated ``k`` times in the forests' fitting
rows (a sample weight, as the bootstrap reads it; each copy stays in its source's group), the
clean-only parts are fitted on each clean image once. Measured on the deploy network's seed-0
training side cut as in ``ensemble_parts.py`` (a validation quarter held out; the test side is
never read): per training attack, the clean side drawn at random from the fit part, as many
images as attacked ones (as the OOD protocol draws it, so it holds the network's mistakes), the
ensemble at 0.5: clean FPR (right / wrong), the seen analog (the attack's validation rows
against their sources), the unseen analog's mean and lowest attack, and the three OOD
stand-ins; then the pooled forests alone at their own out-of-bag point. Chooses nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from detector.ensemble import EnsembleDetector
from detector.forest import TransportDetector
from training.evaluation.context import add_precomputed
from training.evaluation.deployable import misclassified
from training.evaluation.protocols import Samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import ood_proxies, sources, training_side  # noqa: E402
from forest_decision import accuracy, fpr_cells  # noqa: E402

TRAIN_ATTACKS = ("fgm-eps0.1", "cw")
REPEATS = (1, 3, 10)


def fitted(clean: Samples, attacked: Samples, wrong: np.ndarray, k: int) -> EnsembleDetector:
    """The ensemble on ``clean`` vs ``attacked``; its pooled forests see each clean image the
    network gets wrong (``wrong``) ``k`` times."""
    rows = np.sort(np.concatenate([np.arange(len(clean))] + [np.flatnonzero(wrong)] * (k - 1)))
    ensemble = EnsembleDetector(n_jobs=-1)
    forests = TransportDetector(**ensemble.forest_params()).fit_samples(clean.take(rows), attacked)
    return ensemble.fit_samples(clean, attacked, forests=forests)


def main() -> None:
    run, name, data, fit, val = training_side(__doc__.splitlines()[0])
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    held_clean = val(data.clean)
    wrong = misclassified(run, name, held_clean)
    proxies = ood_proxies(run, name, held_clean)
    print(f"Validation clean images: {len(wrong)}, {wrong.sum()} of them misclassified.\n")
    print(
        "| fitted on | k | clean rows (wrong) | ensemble clean FPR at 0.5 (right / wrong) | seen "
        "| unseen mean | unseen lowest | stand-ins " + " / ".join(proxies) + " | forests alone "
        "at their point: clean FPR (right / wrong) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|---|")  # fmt: skip
    pairs = {k: (sources(held_clean, val(a)), val(a)) for k, a in data.attacks.items()}
    for train in TRAIN_ATTACKS:
        attacked = fit(data.attacks[train])
        pool = fit(data.clean)
        drawn = np.random.default_rng(0).permutation(len(pool))[: len(attacked)]
        clean = pool.take(np.sort(drawn))
        clean_wrong = misclassified(run, name, clean)
        for k in REPEATS:
            detector = fitted(clean, attacked, clean_wrong, k)
            acc = {
                key: accuracy(detector.score_samples(c), detector.score_samples(a), 0.5)[0]
                for key, (c, a) in pairs.items()
            }
            unseen = [v for key, v in acc.items() if key != train]
            scores = detector.score_samples(held_clean)
            stand_ins = [
                accuracy(scores, detector.score_samples(p), 0.5)[0] for p in proxies.values()
            ]
            forests = detector.forests_
            alone = forests.score_samples(held_clean) > forests.decision_threshold()
            cells = [train, str(k), f"{len(clean)} ({clean_wrong.sum()})"]
            cells += [fpr_cells(scores > 0.5, wrong), f"{acc[train]:.2f}", f"{np.mean(unseen):.2f}"]
            cells += [f"{min(unseen):.2f}", " / ".join(f"{v:.1f}" for v in stand_ins)]
            cells.append(f"{forests.decision_threshold():.3f}: {fpr_cells(alone, wrong)}")
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
