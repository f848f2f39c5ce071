"""How many clean images the OOD protocol's detector should learn clean from, measured on the
TRAINING side of a finished run only.

    .venv/bin/python benchmarks/ood_clean_ratio.py runs/quick

The OOD protocol fits its detector against one abnormal set and clean images drawn from the whole
training side (``training.evaluation.protocols.balanced_draw``): as many as the abnormal rows in the seed,
up to ``ood_clean_ratio`` per abnormal row (None, the quick and full presets': every clean image
of the training side). With as many, an attack of a few hundred images (CW) leaves the forests a
few hundred clean images to learn clean from. This script cuts the deploy network's seed-0
training side as ``ensemble_parts.py`` does (a validation quarter held out; the test side is never
read) and, per training set of the config's OOD protocol and per ratio, fits the ensemble on the
fit part's attacked images and clean images drawn as the protocol draws them. Cells, at the
ensemble's decision 0.5: the validation clean FPR (%), each other attack's balanced accuracy
against every validation clean image (the unseen analog), their mean and lowest, and the three
training-side OOD stand-ins (inverted, rot90, shuffled). An OOD set flagged in full scores (2 -
clean FPR) / 2. Chooses nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from detector.ensemble import FAMILY_CLEAN_RATIO, EnsembleDetector
from training.evaluation.context import add_precomputed
from training.evaluation.protocols import balanced_draw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import balanced_accuracies, ood_proxies, training_side  # noqa: E402

RATIOS = (1.0, 2.0, FAMILY_CLEAN_RATIO, 8.0, None)  # None: every clean image


def main() -> None:
    run, name, data, fit, val = training_side(__doc__.splitlines()[0])
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    proxies = ood_proxies(run, name, val(data.clean))
    clean_fit, clean_val = fit(data.clean), val(data.clean)
    for train in (k for k in run.config.ood_train if k in data.attacks):
        attacked = fit(data.attacks[train])
        others = [k for k in data.attacks if k != train]
        header = ["clean rows per row", "clean rows", "validation clean FPR", *others]
        header += ["mean", "lowest", *proxies]
        print(f"\nEnsemble on {train} ({len(attacked)} fit-part images), decision 0.5:\n")
        print("| " + " | ".join(header) + " |\n|---" + "|---:" * (len(header) - 1) + "|")
        sets = [val(data.attacks[k]) for k in others] + list(proxies.values())
        for ratio in RATIOS:
            clean, abnormal = balanced_draw(clean_fit, attacked, np.random.default_rng(0), ratio)
            detector = EnsembleDetector(n_jobs=-1).fit_samples(clean, abnormal)
            fpr, accuracy = balanced_accuracies(detector, clean_val, sets)
            attacks = accuracy[: len(others)]
            row = ["every" if ratio is None else f"{ratio:g}", str(len(clean)), f"{fpr:.2f}"]
            row += [f"{a:.1f}" for a in attacks]
            row += [f"{np.mean(attacks):.1f}", f"{min(attacks):.1f}"]
            row += [f"{a:.1f}" for a in accuracy[len(others) :]]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
