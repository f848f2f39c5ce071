"""Would the transport forests gain from the image's natural-scene statistics as extra columns?

    .venv/bin/python benchmarks/nss_group.py runs/quick

On the L-inf rows at eps=0.03 the transport detector (TR) and the NSS baseline (NS) tie
(session 44: LAP FGM eps=0.03, TR - NS = -0.16 points, p 0.53). NS reads the image's MSCN
statistics (:mod:`detector.nss`), TR the trajectory. This measures, on the deploy network's
seed-0 TRAINING side only (its test side and calibration slice are never read), whether TR's
forests fitted on the trajectory features plus NS's 36 columns beat both. The training side is
cut into a fit part and a validation quarter ``CUTS`` times at random
(``ensemble_parts.validation_cut``; cut 0 is the feature selection's); per cut and seen attack, each detector is fitted
on the fit part's attacked images and their clean sources and scored at its own decision on
the validation part's pairs (the seen protocol's balanced accuracy). Also the unseen analog:
fitted on FGM eps=0.1, scored on every other attack's validation pairs. Last, TR against NS
item by item on the seen pairs (the cuts pooled): the items only one of them decides right and
the exact McNemar p-value, so a gap at the ceiling can be told from noise. Chooses nothing.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

from detector.base import DEFAULT_VOTE_THRESHOLD, Detector
from detector.features import NSS_NAMES
from detector.nss import NSS_KEY, NSSDetector
from detector.registry import get_detector
from training.evaluation.context import add_precomputed
from training.evaluation.protocols import Samples, on_all_cores

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import (  # noqa: E402
    UNSEEN_TRAIN,
    masker,
    open_run,
    run_arguments,
    sources,
    validation_cut,
)
from forest_decision import accuracy as balanced_accuracy  # noqa: E402

CUTS = 3
VARIANTS = ("TR", "TR+NSS", "NS")


def with_nss(samples: Samples) -> Samples:
    """The samples with the NSS statistics appended to their trajectory features."""
    names = samples.feature_names
    return replace(
        samples,
        features=np.concatenate([samples.features, samples.extra[NSS_KEY]], axis=1),
        feature_names=None if names is None else (*names, *NSS_NAMES),
    )


def decided(detector: Detector, clean: Samples, attacked: Samples) -> tuple[float, np.ndarray]:
    """Balanced accuracy (%) at the detector's own decision (0.5 when it has none), and whether
    each item (the clean rows, then the attacked rows) is decided right."""
    threshold = detector.decision_threshold()
    threshold = DEFAULT_VOTE_THRESHOLD if threshold is None else threshold
    clean_scores, attacked_scores = detector.score_samples(clean), detector.score_samples(attacked)
    right = np.concatenate([clean_scores <= threshold, attacked_scores > threshold])
    return balanced_accuracy(clean_scores, attacked_scores, threshold)[0], right


def mcnemar(first: np.ndarray, second: np.ndarray) -> tuple[int, int, float]:
    """Items only ``first`` decides right, items only ``second`` does, and the exact two-sided
    McNemar p-value of the difference (1 when none differ)."""
    only_first, only_second = int(np.sum(first & ~second)), int(np.sum(second & ~first))
    differ = only_first + only_second
    p = binomtest(only_first, differ, 0.5).pvalue if differ else 1.0
    return only_first, only_second, float(p)


def view(variant: str, samples: Samples) -> Samples:
    """The columns the variant's detector reads (TR+NSS: the NSS statistics appended)."""
    return with_nss(samples) if variant == "TR+NSS" else samples


def fitted(variant: str, clean: Samples, attacked: Samples) -> Detector:
    detector = on_all_cores(get_detector("nss" if variant == "NS" else "transport"))
    return detector.fit_samples(view(variant, clean), view(variant, attacked))


def scored(
    variant: str, detector: Detector, clean: Samples, attacked: Samples
) -> tuple[float, np.ndarray]:
    return decided(detector, view(variant, clean), view(variant, attacked))


def main() -> None:
    run, name = open_run(run_arguments(__doc__.splitlines()[0]).parse_args())
    data = run.samples(name)
    add_precomputed(run, name, NSSDetector(), [data.clean, *data.attacks.values()])
    seen: dict[tuple[str, str], list[float]] = {}
    unseen: dict[tuple[str, str], list[float]] = {}
    right: dict[tuple[str, str], list[np.ndarray]] = {}
    for cut in range(CUTS):
        _, is_fit, is_val = validation_cut(run, name, cut=cut)
        fit, val = masker(is_fit), masker(is_val)
        pairs = {k: (sources(val(data.clean), val(a)), val(a)) for k, a in data.attacks.items()}
        for key, attack in data.attacks.items():
            attacked = fit(attack)
            clean = sources(fit(data.clean), attacked)
            for variant in VARIANTS:
                detector = fitted(variant, clean, attacked)
                value, decisions = scored(variant, detector, *pairs[key])
                seen.setdefault((key, variant), []).append(value)
                right.setdefault((key, variant), []).append(decisions)
                if key != UNSEEN_TRAIN:
                    continue
                for other, pair in pairs.items():
                    if other != key:
                        unseen.setdefault((other, variant), []).append(
                            scored(variant, detector, *pair)[0]
                        )
            print(f"cut {cut} {key}: " + ", ".join(f"{v} {seen[key, v][-1]:.2f}" for v in VARIANTS))
    print_tables(name, list(data.attacks), seen, unseen)
    print_paired(name, list(data.attacks), right)


def print_tables(
    name: str,
    attacks: list[str],
    seen: dict[tuple[str, str], list[float]],
    unseen: dict[tuple[str, str], list[float]],
) -> None:
    print(f"\nSeen analog ({name}, {CUTS} cuts of the seed-0 training side), accuracy (%):\n")
    print("| attack | " + " | ".join(VARIANTS) + " | TR+NSS - TR | TR+NSS - NS |")
    print("|---|" + "---:|" * (len(VARIANTS) + 2))
    for key in attacks:
        means = {v: np.mean(seen[key, v]) for v in VARIANTS}
        print(
            f"| {key} | "
            + " | ".join(f"{means[v]:.2f}" for v in VARIANTS)
            + f" | {means['TR+NSS'] - means['TR']:+.2f} | {means['TR+NSS'] - means['NS']:+.2f} |"
        )
    others = [k for k in attacks if k != UNSEEN_TRAIN]
    if not others:
        return
    print(f"\nUnseen analog (fitted on {UNSEEN_TRAIN}), accuracy (%):\n")
    print("| attack | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    for key in others:
        print(f"| {key} | " + " | ".join(f"{np.mean(unseen[key, v]):.2f}" for v in VARIANTS) + " |")
    means = [np.mean([np.mean(unseen[k, v]) for k in others]) for v in VARIANTS]
    lowest = [min(np.mean(unseen[k, v]) for k in others) for v in VARIANTS]
    print("| mean | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    print("| lowest | " + " | ".join(f"{m:.2f}" for m in lowest) + " |")


def print_paired(
    name: str, attacks: list[str], right: dict[tuple[str, str], list[np.ndarray]]
) -> None:
    """TR against NS item by item on the seen analog's validation pairs, the cuts pooled."""
    print(f"\nSeen analog ({name}), TR against NS on the same items, {CUTS} cuts pooled:\n")
    print("| attack | items | only TR right | only NS right | McNemar p |")
    print("|---|---:|---:|---:|---:|")
    for key in attacks:
        tr, ns = (np.concatenate(right[key, v]) for v in ("TR", "NS"))
        only_tr, only_ns, p = mcnemar(tr, ns)
        print(f"| {key} | {len(tr)} | {only_tr} | {only_ns} | {p:.3g} |")


if __name__ == "__main__":
    main()
