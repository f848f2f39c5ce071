"""How the deployed ensemble's part scores are combined, measured on the TRAINING side of a run.

The deployed analog of ``ensemble_parts.py`` (every attack in equal shares on the fit part of
the deploy network's seed-0 training side, with the penultimate part) gives each part's score
(``EnsembleScorer.parts``) on the validation quarter. The validation rows are cut in two halves
by source image; a combiner that learns (a logistic regression, class-balanced) learns on one
half and is measured on the other, then the halves swap. Each combiner's threshold is the one
that flags at most 5% of the calibration slice's clean images (``calibrate_threshold``). Cells:
the share of each attack's successful validation images flagged and of the three training-side
OOD stand-ins; the run's OOD sets are printed for information only (test side: never choose on
them).

    .venv/bin/python benchmarks/ensemble_combiners.py runs/quick
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from detector.calibration import calibrate_threshold
from detector.ensemble import EnsembleDetector
from detector.margin import MARGIN_FEATURE
from training.evaluation.context import add_precomputed
from training.evaluation.protocols import Samples
from training.reporting.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import (  # noqa: E402
    deployed_analog,
    masker,
    ood_proxies,
    open_run,
    run_arguments,
    validation_cut,
)

Scorer = Callable[[np.ndarray], np.ndarray]  # part scores [N, parts] -> combined [N]
CLEAN_ONLY = ("novelty", "margin", "penultimate")


def part_names(detector: EnsembleDetector, samples: Samples) -> list[str]:
    """The parts' names, in ``EnsembleScorer.parts`` order."""
    return list(_parts(detector, samples.take(np.arange(len(samples)) < 1)))


def part_matrix(detector: EnsembleDetector, samples: Samples) -> np.ndarray:
    """Each part's score (columns in :func:`part_names` order) of every row."""
    return np.stack([p.numpy() for p in _parts(detector, samples).values()], 1)


def _parts(detector: EnsembleDetector, samples: Samples) -> dict[str, torch.Tensor]:
    rows = torch.from_numpy(np.asarray(detector.serving_rows(samples), np.float32))
    with torch.inference_mode():
        return detector.to_torch().eval().parts(rows, torch.from_numpy(samples.predicted))


def stacked(columns: list[int], c: float, keep_max: list[int]) -> Callable[..., Scorer]:
    """A learner: a logistic regression on ``columns`` (C = ``c``), its probability then maxed
    with the raw ``keep_max`` columns."""

    def learn(clean: np.ndarray, attacks: list[np.ndarray]) -> Scorer:
        n = min(len(a) for a in attacks)
        rng = np.random.default_rng(0)
        abnormal = np.concatenate([a[rng.permutation(len(a))[:n]] for a in attacks])
        x = np.concatenate([clean, abnormal])[:, columns]
        y = np.r_[np.zeros(len(clean)), np.ones(len(abnormal))]
        weight = np.r_[np.full(len(clean), len(abnormal) / len(clean)), np.ones(len(abnormal))]
        model = LogisticRegression(C=c, max_iter=3000).fit(x, y, sample_weight=weight)

        def score(p: np.ndarray) -> np.ndarray:
            combined = model.predict_proba(p[:, columns])[:, 1]
            return np.maximum(combined, p[:, keep_max].max(1)) if keep_max else combined

        return score

    return learn


def clean_ranked(columns: list[int]) -> Callable[..., Scorer]:
    """A learner: each of ``columns`` mapped to its clean CDF (the share of the learning half's
    clean rows scoring strictly lower), so every part spends a like share of the false-positive
    budget; the combined score is their max (other columns as they are)."""

    def learn(clean: np.ndarray, attacks: list[np.ndarray]) -> Scorer:
        sorted_clean = {j: np.sort(clean[:, j]) for j in columns}

        def score(p: np.ndarray) -> np.ndarray:
            out = p.astype(np.float64).copy()
            for j, ranks in sorted_clean.items():
                out[:, j] = np.searchsorted(ranks, p[:, j], side="left") / len(ranks)
                out[:, j] += 1e-3 * p[:, j]  # orders scores that share a CDF value
            return out.max(1)

        return score

    return learn


def combiners(names: list[str]) -> dict[str, Callable[..., Scorer]]:
    every = list(range(len(names)))
    clean_only = [i for i, n in enumerate(names) if n in CLEAN_ONLY]
    forests = [i for i in every if i not in clean_only]
    return {
        "max of every part (shipped)": lambda clean, attacks: lambda p: p.max(1),
        "stacked, every part, C 0.1": stacked(every, 0.1, []),
        "stacked, every part, C 1": stacked(every, 1.0, []),
        "max(stacked forests C 0.1, clean-only parts)": stacked(forests, 0.1, clean_only),
        "max(stacked forests C 1, clean-only parts)": stacked(forests, 1.0, clean_only),
        "max of every part's clean CDF": clean_ranked(every),
        "max(forests' clean CDFs, clean-only parts)": clean_ranked(forests),
        "max of every part but the pooled forests": lambda clean, attacks: (
            lambda p: p[:, every[1:]].max(1)
        ),
        "max(pooled forests, clean-only parts)": lambda clean, attacks: (
            lambda p: p[:, [0, *clean_only]].max(1)
        ),
        "noisy-OR of every part": lambda clean, attacks: noisy_or,
        "sum of every part": lambda clean, attacks: lambda p: p.sum(1),
        "max(noisy-OR of the forest parts, clean-only parts)": lambda clean, attacks: (
            lambda p: np.maximum(noisy_or(p[:, forests]), p[:, clean_only].max(1))
        ),
    }


def noisy_or(parts: np.ndarray) -> np.ndarray:
    """1 - prod(1 - part): each part's score read as independent evidence."""
    return 1 - np.prod(1 - parts.astype(np.float64), axis=1)


def main() -> None:
    run, name = open_run(run_arguments(__doc__.splitlines()[0]).parse_args())
    data = run.samples(name)
    add_precomputed(
        run, name, EnsembleDetector(), [data.clean, *data.attacks.values(), *data.ood.values()]
    )
    split, _, is_validation = validation_cut(run, name)
    val = masker(is_validation)
    clean, attacks = val(data.clean), {k: val(a) for k, a in data.attacks.items()}
    proxies = ood_proxies(run, name, clean)
    detector, calibrated = deployed_analog(
        run, name, data.clean, data.attacks, penultimate_tail=0.025
    )
    parts = {"clean": part_matrix(detector, clean)} | {
        k: part_matrix(detector, a) for k, a in attacks.items()
    }
    names = part_names(detector, clean)
    success = {k: np.asarray(a.success, bool) for k, a in attacks.items()}
    halves = {k: s.indices % 2 == 0 for k, s in {"clean": clean, **attacks}.items()}
    calibration = part_matrix(detector, split.calibration(data.clean))
    others = {k: part_matrix(detector, s) for k, s in proxies.items()}
    info = {k: part_matrix(detector, s) for k, s in data.ood.items()}
    rows = []
    for label, learn in combiners(names).items():
        cells: dict[str, list[float]] = {}
        for half in (True, False):
            score = learn(
                parts["clean"][halves["clean"] == half],
                [parts[k][halves[k] == half] for k in attacks],
            )
            threshold = calibrate_threshold(score(calibration), 0.05)
            flagged = {
                "clean FPR": score(parts["clean"][halves["clean"] != half]) > threshold,
                **{
                    k: score(parts[k][(halves[k] != half) & success[k]]) > threshold
                    for k in attacks
                },
                **{k: score(p) > threshold for k, p in others.items()},
                **{f"{k} (info)": score(p) > threshold for k, p in info.items()},
            }
            for key, values in flagged.items():
                cells.setdefault(key, []).append(float(np.mean(values)))
        rows.append([label, *(f"{50 * sum(v):.2f}" for v in cells.values())])
    print(f"parts: {', '.join(names)}\n")
    print(markdown_table(["combiner", *cells], rows))
    print(missed(names, parts["cw"][success["cw"]], calibrated, attacks["cw"], clean))


def missed(
    names: list[str], parts: np.ndarray, threshold: float, attacked: Samples, clean: Samples
) -> str:
    """What the shipped max misses of an attack's successful validation images (``parts``)
    at the deployed analog's calibrated ``threshold``: each part's median score among them,
    and their median logit margin beside the clean images' 5th percentile."""
    miss = parts.max(1) <= threshold
    column = list(attacked.feature_names or []).index(MARGIN_FEATURE)
    margin = attacked.features[np.asarray(attacked.success, bool)][miss, column]
    medians = ", ".join(
        f"{n} {v:.2f}" for n, v in zip(names, np.median(parts[miss], 0), strict=True)
    )
    return (
        f"\n{attacked.name}: {miss.sum()} of {len(miss)} successful images missed at the "
        f"calibrated threshold {threshold:.3f}; their median part scores: {medians}; their "
        f"median logit margin {np.median(margin):.3f} (clean 5th percentile "
        f"{np.quantile(clean.features[:, column], 0.05):.3f})"
    )


if __name__ == "__main__":
    main()
