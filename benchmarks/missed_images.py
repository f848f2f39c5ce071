"""Which successful adversarial images the deployed analog misses, and how they differ from the
ones it catches: measured on the TRAINING side of a finished run only.

The deployed analog (``ensemble_parts.deployed_analog``: the shipped recipe, with the
penultimate part, fitted on the fit part of the deploy network's seed-0 training side) is read at
its calibrated threshold and where it flags each of ``--budgets`` of the validation clean images.
Per attack and threshold, of the attack's successful validation images: the share flagged, and,
for the caught and the missed ones apart, the medians of
- the perturbation's L2 norm (to the image's clean source),
- the source's margin (the network's top-two probability gap on the clean source),
- the margin on the attacked image itself,
- and (a mean, not a median) the share that the run's other network reads as the deploy network
  does (its opinion).
The test side is never read; nothing here is chosen.

    .venv/bin/python benchmarks/missed_images.py runs/quick [--budgets 0.02]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from detector.novelty import PENULTIMATE_TAIL, EnsembleDetector
from training.experiments import Samples
from training.pipeline import add_precomputed
from training.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import deployed_analog, masker, open_run, run_arguments, validation_cut  # noqa: E402

BATCH = 512


def probabilities(model: torch.nn.Module, images: np.ndarray) -> np.ndarray:
    """[N, classes] softmax of ``model`` on ``images``."""
    with torch.inference_mode():
        return torch.cat(
            [
                model(torch.from_numpy(images[i : i + BATCH])).float().softmax(1)
                for i in range(0, len(images), BATCH)
            ]
        ).numpy()


def top_two_gap(p: np.ndarray) -> np.ndarray:
    """The gap between each row's two largest probabilities."""
    top = np.sort(p, 1)
    return top[:, -1] - top[:, -2]


def traits(
    attacked: Samples, clean: Samples, model: torch.nn.Module, other: torch.nn.Module
) -> dict[str, np.ndarray]:
    """Per row of ``attacked`` (successful images whose sources are in ``clean``): the L2 to the
    source, the source's margin, the image's margin, and whether ``other`` agrees with ``model``."""
    row_of = {int(i): r for r, i in enumerate(clean.indices)}
    source = np.asarray([row_of[int(i)] for i in attacked.indices], np.int64)
    delta = (attacked.images - clean.images[source]).reshape(len(attacked), -1)
    return {
        "L2": np.sqrt((delta**2).sum(1)),
        "source margin": top_two_gap(probabilities(model, clean.images[source])),
        "margin": top_two_gap(probabilities(model, attacked.images)),
        "other agrees (%)": 100.0
        * (probabilities(other, attacked.images).argmax(1) == attacked.predicted),
    }


def key_is_share(trait: str) -> bool:
    """Whether a trait is a 0/100 indicator, summarised by its mean (the others by the median)."""
    return trait.endswith("(%)")


def rows_at(
    label: str, threshold: float, scored: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]
) -> list[list[str]]:
    """One table row per attack at ``threshold``: flagged share, then caught / missed medians."""
    rows = []
    for key, (scores, by_trait) in scored.items():
        flagged = scores > threshold
        cells = [label, key, str(len(scores)), f"{100 * flagged.mean():.1f}"]
        for trait, values in by_trait.items():
            caught, missed = values[flagged], values[~flagged]
            share = key_is_share(trait)
            cells.append(
                " / ".join(
                    ("–" if not len(v) else f"{np.mean(v):.1f}" if share else f"{np.median(v):.3f}")
                    for v in (caught, missed)
                )
            )
        rows.append(cells)
    return rows


def main() -> None:
    parser = run_arguments(__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.02])
    args = parser.parse_args()
    run, name = open_run(args)
    data = run.samples(name)
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    val = masker(validation_cut(run, name)[2])
    detector, calibrated = deployed_analog(
        run, name, data.clean, data.attacks, penultimate_tail=PENULTIMATE_TAIL
    )
    clean = val(data.clean)
    clean_scores = detector.score_samples(clean)
    model, other = run.model(name), run.model(run.config.second_network(name))
    scored = {}
    for key, attack in data.attacks.items():
        rows = val(attack)
        rows = rows.take(np.asarray(rows.success, bool))
        scored[key] = (detector.score_samples(rows), traits(rows, clean, model, other))
    thresholds = [("calibrated", calibrated)]
    thresholds += [
        (f"{100 * b:g}% of val. clean", float(np.quantile(clean_scores, 1 - b)))
        for b in args.budgets
    ]
    table = []
    for label, threshold in thresholds:
        fpr = 100 * np.mean(clean_scores > threshold)
        table += rows_at(f"{label} ({threshold:.3f}, FPR {fpr:.2f}%)", threshold, scored)
    trait_names = next(iter(scored.values()))[1]
    header = ["threshold", "attack", "n", "flagged (%)"]
    header += [f"{t}: caught / missed" for t in trait_names]
    print(f"Deployed analog ({name}), successful validation images; medians, agreement a mean:\n")
    print(markdown_table(header, table))
    print(
        f"\nValidation clean images ({len(clean)}): margin quantiles 1/2/5/10% "
        + " / ".join(
            f"{q:.3f}"
            for q in np.quantile(
                top_two_gap(probabilities(model, clean.images)), [0.01, 0.02, 0.05, 0.1]
            )
        )
    )


if __name__ == "__main__":
    main()
