"""Where the OOD protocol's own decision lands, by what its training outliers hold: measured on
the TRAINING side of a finished quick run only (the test side is never read).

The quick preset's third OOD experiment trains on synthetic outliers of the network's own
validation images (``ood_train: synthetic``, seed 003 §5.4.4 experiment 1). The transport
forests decide at the best balanced accuracy of their out-of-bag votes, the ensemble at 0.5.
A far-OOD test set flagged in full scores (2 - clean FPR) / 2 at that decision, so the clean FPR
the decision spends sets the row. This script cuts the deploy network's seed-0 training side as
``ensemble_parts.py`` does (a fit part and a validation quarter), splits the synthetic set in two
halves (every transform in both), and fits each detector on the fit part's clean images against
half A of: all six transforms, each five of them, the four that do not rotate, and 1,000 crops of
scikit-learn's two bundled photographs (images found in the wild). Cells: the decision, the
validation clean FPR at it (%), and the share flagged (%) of each transform's half-B outliers, of
the three training-side stand-ins (inverted, rot90, pixels shuffled) and of 1,000 other crops.
Chooses nothing.

    .venv/bin/python benchmarks/ood_decision.py runs/quick
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_sample_images

from detector.base import Detector
from detector.ensemble import EnsembleDetector
from detector.forest import TransportDetector
from training.data.synthetic_outliers import SYNTHETIC_OOD, SYNTHETIC_TRANSFORMS
from training.evaluation.context import add_precomputed
from training.evaluation.protocols import Samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import image_samples, ood_proxies, training_side  # noqa: E402

PHOTO_CROPS = 2000  # half fitted on, half read


def photo_crops(n: int, size: int, seed: int = 0) -> np.ndarray:
    """``n`` grey square crops [N, 1, size, size] in [0, 1] of scikit-learn's bundled photographs,
    each of a random side between ``size`` and half the photograph's height."""
    rng = np.random.default_rng(seed)
    photos = [img.mean(axis=2).astype(np.float32) / 255 for img in load_sample_images().images]
    out = np.empty((n, 1, size, size), np.float32)
    for i in range(n):
        photo = photos[i % len(photos)]
        h, w = photo.shape
        side = int(rng.integers(size, min(h, w) // 2))
        top, left = int(rng.integers(0, h - side)), int(rng.integers(0, w - side))
        crop = torch.from_numpy(np.ascontiguousarray(photo[top : top + side, left : left + side]))
        out[i] = F.interpolate(crop[None, None], size=(size, size), mode="area")[0].numpy()
    return out


def training_sets(synthetic: Samples, kinds: np.ndarray, half_a: np.ndarray) -> dict[str, Samples]:
    """The rows each detector is fitted on: half A of each subset of the transforms."""
    names = list(SYNTHETIC_TRANSFORMS)
    subsets = {"all six": names} | {f"all but {k}": [n for n in names if n != k] for k in names}
    subsets["the four that do not rotate"] = [n for n in names if n not in ("rot90", "upside-down")]
    return {k: synthetic.take(half_a & np.isin(kinds, v)) for k, v in subsets.items()}


def cells(detector: Detector, clean: Samples, sets: dict[str, Samples]) -> list[str]:
    """The decision, ``clean``'s FPR at it and each set's share flagged (%)."""
    decision = detector.decision_threshold()
    decision = 0.5 if decision is None else decision
    row = [f"{decision:.3f}", f"{100 * np.mean(detector.score_samples(clean) > decision):.2f}"]
    return row + [
        f"{100 * np.mean(detector.score_samples(s) > decision):.1f}" for s in sets.values()
    ]


def main() -> None:
    run, name, data, fit, val = training_side(__doc__.splitlines()[0])
    clean_fit, clean_val = fit(data.clean), val(data.clean)
    synthetic = data.ood_train[SYNTHETIC_OOD]
    names = list(SYNTHETIC_TRANSFORMS)
    kinds = np.array([names[i % len(names)] for i in range(len(synthetic))])  # as made
    half_a = (np.arange(len(synthetic)) // len(names)) % 2 == 0
    add_precomputed(run, name, EnsembleDetector(), [data.clean, synthetic])
    size = data.clean.images.shape[-1]
    photos = image_samples(
        run, name, "photos", photo_crops(PHOTO_CROPS, size), data.clean.feature_names
    )
    is_a = np.arange(PHOTO_CROPS) < PHOTO_CROPS // 2
    read = {k: synthetic.take(~half_a & (kinds == k)) for k in names}
    proxies = ood_proxies(run, name, clean_val)
    read |= {f"stand-in {k}": v for k, v in proxies.items()} | {"photos": photos.take(~is_a)}
    fitted_on = training_sets(synthetic, kinds, half_a) | {"photographs": photos.take(is_a)}
    header = ["detector", "trained on", "decision", "val. clean FPR", *read]
    print("| " + " | ".join(header) + " |\n|---|---" + "|---:" * (len(header) - 2) + "|")
    for label, abnormal in fitted_on.items():
        forests = TransportDetector(n_jobs=-1).fit_samples(clean_fit, abnormal)
        ensemble = EnsembleDetector(n_jobs=-1).fit_samples(
            clean_fit, abnormal, forests=forests, clean_reference=clean_fit
        )
        for short, detector in (("TR", forests), ("TR+NV", ensemble)):
            row = [short, label, *cells(detector, clean_val, read)]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
