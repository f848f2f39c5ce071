"""How the transport detector's two forests are combined, measured on the TRAINING side of a run.

The transport detector scores an input by the max of two vote fractions, its predicted class's
forest and the general forest (seed 003 §5.4.2: "an input is considered an attack if at least one
detector says so"). Per attack, on the deploy network's seed-0 training side cut as in
``ensemble_parts.py`` (a validation quarter held out; the test side is never read), the seen
analog's balanced accuracy at 0.5 (pairs: the attacked images and their clean sources) for the
max, the mean, the general forest alone and the class forest alone -- one fit per attack. Then
the unseen analog: fitted on one attack (FGM eps=0.1, then CW) of the fit part, the balanced
accuracy at 0.5 on every other attack's validation rows (against the validation clean images)
and on the three training-side OOD stand-ins of ``ensemble_parts.py``.

    .venv/bin/python benchmarks/forest_combination.py runs/quick
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from detector.forest import TransportDetector

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import ood_proxies, sources, training_side  # noqa: E402

RULES = ("max", "mean", "general", "class")


def combined(general: np.ndarray, own: np.ndarray) -> dict[str, np.ndarray]:
    """Each rule's score from the two forests' vote fractions."""
    return {
        "max": np.maximum(general, own),
        "mean": (general + own) / 2,
        "general": general,
        "class": own,
    }


def main() -> None:
    run, name, data, fit, val = training_side(__doc__.splitlines()[0])
    print(f"Seen analog ({name}), balanced accuracy at 0.5 (%), clean FPR / TPR in brackets:\n")
    print("| attack | " + " | ".join(RULES) + " |")
    print("|---" + "|---:" * len(RULES) + "|")
    means: dict[str, list[float]] = {rule: [] for rule in RULES}
    for key, attack in data.attacks.items():
        attacked, held = fit(attack), val(attack)
        detector = TransportDetector(class_conditional=True, n_jobs=-1).fit_samples(
            sources(fit(data.clean), attacked), attacked
        )
        clean_rows = sources(val(data.clean), held)
        clean_scores = combined(*detector.votes(clean_rows.features, clean_rows.predicted))
        attack_scores = combined(*detector.votes(held.features, held.predicted))
        cells = []
        for rule in RULES:
            fpr = float(np.mean(clean_scores[rule] > 0.5))
            tpr = float(np.mean(attack_scores[rule] > 0.5))
            means[rule].append(50 * (tpr + 1 - fpr))
            cells.append(f"{means[rule][-1]:.2f} ({100 * fpr:.2f} / {100 * tpr:.2f})")
        print(f"| {key} | " + " | ".join(cells) + " |", flush=True)
    print("| mean | " + " | ".join(f"{np.mean(v):.2f}" for v in means.values()) + " |")
    proxies = ood_proxies(run, name, val(data.clean))
    for train in UNSEEN_TRAIN:
        unseen_table(data, fit, val, train, proxies)


UNSEEN_TRAIN = ("fgm-eps0.1", "cw")


def unseen_table(data: Any, fit: Any, val: Any, train: str, proxies: dict[str, Any]) -> None:
    """Fitted on ``train``'s fit rows and their sources; balanced accuracy at 0.5 elsewhere."""
    attacked = fit(data.attacks[train])
    detector = TransportDetector(class_conditional=True, n_jobs=-1).fit_samples(
        sources(fit(data.clean), attacked), attacked
    )
    clean = val(data.clean)
    clean_scores = combined(*detector.votes(clean.features, clean.predicted))
    fpr = {rule: float(np.mean(clean_scores[rule] > 0.5)) for rule in RULES}
    print(f"\nUnseen analog, fitted on {train}: balanced accuracy at 0.5 (%); clean FPR " +
          ", ".join(f"{rule} {100 * v:.2f}" for rule, v in fpr.items()) + "\n")  # fmt: skip
    print("| set | " + " | ".join(RULES) + " |")
    print("|---" + "|---:" * len(RULES) + "|")
    means: dict[str, list[float]] = {rule: [] for rule in RULES}
    others = {k: val(a) for k, a in data.attacks.items() if k != train}
    for key, rows in {**others, **proxies}.items():
        scores = combined(*detector.votes(rows.features, rows.predicted))
        accuracy = {r: 50 * (float(np.mean(scores[r] > 0.5)) + 1 - fpr[r]) for r in RULES}
        if key in others:
            for rule in RULES:
                means[rule].append(accuracy[rule])
        print(f"| {key} | " + " | ".join(f"{accuracy[r]:.2f}" for r in RULES) + " |")
    print("| attack mean | " + " | ".join(f"{np.mean(v):.2f}" for v in means.values()) + " |")


if __name__ == "__main__":
    main()
