"""Clean-only candidates that look at the image or the classifier's embedding, each alone, on the
TRAINING side of a finished quick run (the test side is never read).

Cut as ``ensemble_parts.py``: fitted on the fit part's clean images, thresholded at 1.25% of the
validation quarter's clean images (the share one ensemble part spends at the decision 0.5), the
share flagged of the three training-side OOD stand-ins (inverted, rotated by 90 degrees, pixels
shuffled) and of every attack's validation rows. Candidates: the pixels' principal components
(reconstruction error, whitened nearest neighbour, probabilistic PCA), the nearest clean image on
the raw pixels, and the nearest clean image(s) in the network's penultimate embedding (unit length
as the extractor gives it, Euclidean k = 1, 10, 50; whitened; raw).

    .venv/bin/python benchmarks/clean_parts_screen.py runs/quick
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from sklearn.covariance import LedoitWolf
from sklearn.decomposition import PCA

from detector.calibration import calibrate_threshold
from detector.penultimate import penultimate_embedding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import ood_proxies, training_side  # noqa: E402

FPR = 0.0125
Scorer = Callable[[np.ndarray], np.ndarray]


def kth_distance(queries: np.ndarray, points: np.ndarray, k: int = 1) -> np.ndarray:
    """Euclidean distance of each query to its k-th nearest row of ``points``."""
    reference = torch.as_tensor(points, dtype=torch.float64)
    blocks = [
        torch.cdist(block, reference).topk(k, largest=False).values[:, -1]
        for block in torch.as_tensor(queries, dtype=torch.float64).split(1024)
    ]
    return torch.cat(blocks).numpy()


def pixel_candidates(clean: np.ndarray) -> dict[str, Scorer]:
    """Scorers on flattened pixels, fitted on the clean rows ``clean`` [N, P]."""
    out: dict[str, Scorer] = {"pixels, nearest": lambda a: kth_distance(a, clean)}
    for k in (10, 30, 60):
        pca = PCA(k, random_state=0).fit(clean)
        scale = np.sqrt(pca.explained_variance_)
        points = pca.transform(clean) / scale

        def residual(a: np.ndarray, pca: PCA = pca) -> np.ndarray:
            return a - pca.inverse_transform(pca.transform(a))

        out[f"PCA {k}, reconstruction"] = lambda a, r=residual: np.linalg.norm(r(a), axis=1)
        out[f"PCA {k}, whitened nearest"] = lambda a, p=pca, s=scale, q=points: kth_distance(
            p.transform(a) / s, q
        )
        out[f"PCA {k}, probabilistic"] = lambda a, p=pca, r=residual: (
            (p.transform(a) ** 2 / p.explained_variance_).sum(1)
            + (r(a) ** 2).sum(1) / p.noise_variance_
        )
    return out


def embedding_candidates(clean: np.ndarray) -> dict[str, Scorer]:
    """Scorers on unit-length penultimate embeddings, fitted on the clean rows ``clean``."""
    out: dict[str, Scorer] = {
        f"penultimate, nearest k={k}": lambda a, k=k: kth_distance(a, clean, k) for k in (1, 10, 50)
    }
    whiten = np.linalg.cholesky(LedoitWolf().fit(clean).precision_)
    out["penultimate, whitened nearest"] = lambda a: kth_distance(a @ whiten, clean @ whiten)
    return out


def main() -> None:
    run, name, data, fit, val = training_side(__doc__.splitlines()[0])
    sets = {"clean": val(data.clean).images, **{k: v.images for k, v in ood_proxies(
        run, name, val(data.clean)).items()}}  # fmt: skip
    sets.update({k: val(a).images for k, a in data.attacks.items()})
    model = run.model(name)
    pixels = {k: v.reshape(len(v), -1).astype(np.float64) for k, v in sets.items()}
    embedded = {k: penultimate_embedding(model, v).astype(np.float64) for k, v in sets.items()}
    clean_fit = fit(data.clean).images
    candidates = [
        (pixel_candidates(clean_fit.reshape(len(clean_fit), -1).astype(np.float64)), pixels),
        (
            embedding_candidates(penultimate_embedding(model, clean_fit).astype(np.float64)),
            embedded,
        ),
    ]
    keys = [k for k in sets if k != "clean"]
    print(f"Flagged at {100 * FPR:g}% validation clean FPR ({name}), %:\n")
    print("| candidate | " + " | ".join(keys) + " | stand-in mean |")
    print("|---" + "|---:" * (len(keys) + 1) + "|")
    for scorers, inputs in candidates:
        for label, scorer in scorers.items():
            scores = {k: scorer(v) for k, v in inputs.items()}
            threshold = calibrate_threshold(scores["clean"], FPR)
            flagged = {k: 100 * float(np.mean(scores[k] > threshold)) for k in keys}
            stand_ins = np.mean([flagged[k] for k in ("inverted", "rot90", "shuffled")])
            cells = [f"{flagged[k]:.1f}" for k in keys] + [f"{stand_ins:.1f}"]
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
