"""Which successful adversarial images the deployed analog misses, and how they differ from the
ones it catches: measured on the TRAINING side of a finished run only.

The deployed analog (``ensemble_parts.deployed_analog``: the shipped recipe, with the
penultimate part, fitted on the fit part of the deploy network's training side of split
``--split``, default 0, the shipped split's) is read at its calibrated threshold and where it
flags each of ``--budgets`` of the validation clean images.
Per attack and threshold, of the attack's successful validation images: the share flagged, and,
for the caught and the missed ones apart, the medians of
- the perturbation's L2 norm (to the image's clean source),
- the source's logit margin and the attacked image's (``head_margin``, what the margin part
  reads),
- and (a mean, not a median) the share that the run's other network reads as the deploy network
  does (``second_agrees``, when the run's features hold the opinion).
The test side is never read; nothing here is chosen.

    .venv/bin/python benchmarks/missed_images.py runs/quick [--budgets 0.02] [--split 0]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from detector.calibration import calibrate_threshold
from detector.ensemble import PENULTIMATE_TAIL, EnsembleDetector
from detector.errors import ConfigError
from detector.margin import MARGIN_FEATURE
from detector.opinion import OPINION_NAMES
from training.evaluation.context import add_precomputed
from training.evaluation.protocols import Samples
from training.reporting.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import deployed_analog, masker, open_run, run_arguments, validation_cut  # noqa: E402

AGREES = OPINION_NAMES[0]  # the opinion's first column: the other network agrees (0 / 1)


def column(samples: Samples, name: str) -> np.ndarray | None:
    """The feature column ``name`` of ``samples``, or None when the run's features lack it."""
    names = list(samples.feature_names or ())
    return samples.features[:, names.index(name)] if name in names else None


def traits(attacked: Samples, clean: Samples) -> dict[str, np.ndarray]:
    """Per row of ``attacked`` (successful images whose sources are in ``clean``): the L2 to the
    source, the source's and the image's logit margins, and (when the features hold it) whether
    the other network agrees with the deploy network, in %."""
    row_of = {int(i): r for r, i in enumerate(clean.indices)}
    source = np.asarray([row_of[int(i)] for i in attacked.indices], np.int64)
    delta = (attacked.images - clean.images[source]).reshape(len(attacked), -1)
    margin, clean_margin = column(attacked, MARGIN_FEATURE), column(clean, MARGIN_FEATURE)
    if margin is None or clean_margin is None:
        raise ConfigError(f"the run's features hold no {MARGIN_FEATURE!r} column")
    found = {
        "L2": np.sqrt((delta**2).sum(1)),
        "source margin": clean_margin[source],
        "margin": margin,
    }
    agrees = column(attacked, AGREES)
    if agrees is not None:
        found["other agrees (%)"] = 100.0 * agrees
    return found


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
    parser = run_arguments(__doc__.splitlines()[0], split=True)
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.02])
    args = parser.parse_args()
    run, name = open_run(args)
    data = run.samples(name)
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    val = masker(validation_cut(run, name, args.split)[2])
    detector, calibrated = deployed_analog(
        run,
        name,
        data.clean,
        data.attacks,
        split_seed=args.split,
        penultimate_tail=PENULTIMATE_TAIL,
    )
    clean = val(data.clean)
    clean_scores = detector.score_samples(clean)
    scored = {}
    for key, attack in data.attacks.items():
        rows = val(attack)
        rows = rows.take(np.asarray(rows.success, bool))
        scored[key] = (detector.score_samples(rows), traits(rows, clean))
    thresholds = [("calibrated", calibrated)]
    thresholds += [
        (f"{100 * b:g}% of val. clean", calibrate_threshold(clean_scores, b)) for b in args.budgets
    ]
    table = []
    for label, threshold in thresholds:
        fpr = 100 * np.mean(clean_scores > threshold)
        table += rows_at(f"{label} ({threshold:.3f}, FPR {fpr:.2f}%)", threshold, scored)
    header = ["threshold", "attack", "n", "flagged (%)"]
    header += [f"{t}: caught / missed" for t in next(iter(scored.values()))[1]]
    print(
        f"Deployed analog ({name}, split {args.split}), successful validation images; medians, "
        "agreement a mean:\n"
    )
    print(markdown_table(header, table))
    quantiles = np.quantile(column(clean, MARGIN_FEATURE), [0.01, 0.02, 0.05, 0.1])
    print(
        f"\nValidation clean images ({len(clean)}): logit margin quantiles 1/2/5/10% "
        + " / ".join(f"{q:.3f}" for q in quantiles)
    )


if __name__ == "__main__":
    main()
