"""Which ensemble parts and tails, measured on the TRAINING side of a finished quick run only.

The deploy network's seed-0 split: its training side (B1 without the calibration slice) is cut
again into a validation quarter and three quarters to fit (as the feature selection cuts it);
the test side (B2) is never read. Two tables, each row one ensemble configuration:

1. unseen / OOD analog: forests on FGM eps=0.1 of the fit part, balanced accuracy at the
   ensemble's own decision 0.5 (as the unseen and OOD protocols) on every other attack's
   validation rows and on three training-side OOD stand-ins made from the validation clean
   images (inverted, rotated by 90 degrees, pixels shuffled), per forest rule (the class forest
   OR the general forest, as seed 003 §5.4.2, or the general forest alone), clean-only
   distance (to the class mean, or to the nearest clean sample) and clean tails, with and
   without the penultimate part (the nearest clean image in the network's penultimate
   embedding);
2. deployed analog: every attack in equal shares (as ``fit_deployable``), the threshold
   calibrated on the calibration slice (the config's FPR target and confidence), the share of
   each attack's successful validation images flagged, and of the three OOD stand-ins;
   the run's OOD sets are printed for information (test-side sets: never choose on them).

    .venv/bin/python benchmarks/ensemble_parts.py runs/quick
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from detector.base import Detector
from detector.calibration import Calibration
from detector.ensemble import EnsembleDetector
from detector.forest import TransportDetector
from detector.novelty import NOVELTY_DISTANCES
from training.evaluation.context import PipelineRun, add_precomputed
from training.evaluation.deployable import attack_family, equal_shares, with_family
from training.evaluation.protocols import Samples, Split

UNSEEN_TRAIN = "fgm-eps0.1"
# (novelty tail, margin tail) pairs of the unseen table; the deployed table's rows below.
TAILS = [(0.05, 0.0), (0.025, 0.025), (0.02, 0.02), (0.015, 0.015), (0.01, 0.01), (0.02, 0.01)]
# (novelty, margin, penultimate) tails of the unseen table's rows with the penultimate part.
PENULTIMATE_TAILS = [
    (0.025, 0.025, 0.025),
    (0.02, 0.02, 0.01),
    (1 / 60, 1 / 60, 1 / 60),
    (0.015, 0.015, 0.015),
    (0.0125, 0.0125, 0.025),
]
FOREST_RULES = {"class OR general": True, "general alone": False}  # -> class_conditional
DEPLOYED = {
    "class OR general, class mean 0.025 + margin 0.025": dict(
        class_conditional=True, novelty_distance="class-mean"
    ),
    "class OR general, nearest 0.025 + margin 0.025": dict(
        class_conditional=True, novelty_distance="nearest"
    ),
    "class OR general, nearest 0.025 + margin 0.025 + penultimate 0.025": dict(
        class_conditional=True, novelty_distance="nearest", penultimate_tail=0.025
    ),
    "general alone, class mean 0.025 + margin 0.025": dict(
        class_conditional=False, novelty_distance="class-mean"
    ),
    "general alone, class mean 0.015 + margin 0.015": dict(
        class_conditional=False, tail=0.015, margin_tail=0.015, novelty_distance="class-mean"
    ),
    "general alone, class mean 0.01 + margin 0.01": dict(
        class_conditional=False, tail=0.01, margin_tail=0.01, novelty_distance="class-mean"
    ),
    "class OR general, nearest 0.025 + margin 0.025 + penultimate 0.025, 300 trees": dict(
        class_conditional=True,
        novelty_distance="nearest",
        penultimate_tail=0.025,
        n_estimators=300,
    ),  # fmt: skip
}  # every row: family forests, 4 clean rows per family row
PROXY_IMAGES = 1000  # validation clean images each OOD proxy is made from


def validation_cut(
    run: PipelineRun, name: str, split_seed: int = 0, *, cut: int = 0
) -> tuple[Split, np.ndarray, np.ndarray]:
    """The split of ``split_seed`` (the shipped detector's: 0), and the fit / validation masks
    over the test-image index space (``cut``: the seed that draws the validation quarter; 0 is
    the feature selection's)."""
    clean = run.samples(name).clean
    universe = int(clean.indices.max()) + 1
    split = Split(split_seed, run.config.test_fraction, universe)
    training_side = np.flatnonzero(~split.is_test & ~split.is_calibration)
    order = np.random.default_rng(cut).permutation(training_side)
    is_validation = np.zeros(universe, bool)
    is_validation[order[: int(round(len(order) * 0.25))]] = True
    is_fit = ~split.is_test & ~split.is_calibration & ~is_validation
    return split, is_fit, is_validation


def unseen_pairs(
    run: PipelineRun, name: str, clean: Samples, attacked: Samples
) -> tuple[Samples, Samples]:
    """The unseen analog's training rows: the fit part's ``attacked`` images (the attack
    ``UNSEEN_TRAIN``) and their clean sources."""
    _, is_fit, _ = validation_cut(run, name)
    fit = masker(is_fit)
    attacked = fit(attacked)
    return sources(fit(clean), attacked), attacked


def sources(clean: Samples, attacked: Samples) -> Samples:
    """The rows of ``clean`` that are the source images of ``attacked``'s rows."""
    return clean.take(np.isin(clean.indices, attacked.indices))


def balanced_accuracies(
    detector: Detector, clean: Samples, sets: list[Samples]
) -> tuple[float, list[float]]:
    """``clean``'s FPR at the decision 0.5 (%) and each set's balanced accuracy against it (%)."""
    fpr = float(np.mean(detector.score_samples(clean) > 0.5))
    flagged = [float(np.mean(detector.score_samples(rows) > 0.5)) for rows in sets]
    return 100 * fpr, [100 * (f + 1 - fpr) / 2 for f in flagged]


def unseen_cells(detector: Detector, clean: Samples, attacks: list[Samples]) -> list[str]:
    """Cells: ``clean``'s FPR at 0.5 (%), each attack's balanced accuracy against it, their mean."""
    fpr, accuracy = balanced_accuracies(detector, clean, attacks)
    return [f"{fpr:.2f}", *(f"{a:.1f}" for a in accuracy), f"{np.mean(accuracy):.1f}"]


def deployed_cells(
    detector: Detector, threshold: float, clean: Samples, attacks: list[Samples]
) -> list[str]:
    """Cells: the threshold, ``clean``'s FPR (%), each attack's successful images flagged (%)."""
    cells = [f"{threshold:.3f}", f"{100 * np.mean(detector.score_samples(clean) > threshold):.2f}"]
    for rows in attacks:
        flagged = detector.score_samples(rows)[np.asarray(rows.success, bool)] > threshold
        cells.append(f"{100 * np.mean(flagged):.1f}")
    return cells


def unseen_table(run: PipelineRun, name: str, proxies: dict[str, Samples]) -> None:
    data = run.samples(name)
    _, _, is_val = validation_cut(run, name)
    val = masker(is_val)
    clean, attacked = unseen_pairs(run, name, data.clean, data.attacks[UNSEEN_TRAIN])
    others = [k for k in data.attacks if k != UNSEEN_TRAIN]
    print(f"\nUnseen / OOD analog ({name}; forests on {UNSEEN_TRAIN}), balanced accuracy at 0.5:\n")
    header = ["forests", "novelty", "novelty tail", "margin tail", "penultimate tail", "clean FPR"]
    header += others
    print("| " + " | ".join([*header, "attack mean", *proxies, "stand-in mean"]) + " |")
    print("|---" + "|---:" * (len(header) + len(proxies) + 1) + "|")
    # every forest rule with the class-mean distance; class OR general with each other distance;
    # then class OR general, nearest, with the penultimate part
    without = [(t, m, 0.0) for t, m in TAILS]
    rows = [(rule, "class-mean", without) for rule in FOREST_RULES]
    rows += [("class OR general", d, without) for d in NOVELTY_DISTANCES if d != "class-mean"]
    rows += [("class OR general", "nearest", PENULTIMATE_TAILS)]
    forests: dict[str, TransportDetector] = {}  # the same forests for every row of a rule
    for rule, distance, tails in rows:
        for tail, margin_tail, penultimate_tail in tails:
            detector = EnsembleDetector(
                tail=tail,
                margin_tail=margin_tail,
                class_conditional=FOREST_RULES[rule],
                novelty_distance=distance,
                penultimate_tail=penultimate_tail,
                n_jobs=-1,
            )
            detector.fit_samples(clean, attacked, forests=forests.get(rule))
            forests[rule] = detector.forests_
            cells = [rule, distance, f"{tail:g}", f"{margin_tail:g}", f"{penultimate_tail:.4g}"]
            cells += unseen_cells(detector, val(data.clean), [val(data.attacks[k]) for k in others])
            cells += unseen_cells(detector, val(data.clean), list(proxies.values()))[1:]
            print("| " + " | ".join(cells) + " |", flush=True)


def deployed_analog(
    run: PipelineRun,
    name: str,
    clean: Samples,
    attacks: dict[str, Samples],
    *,
    split_seed: int = 0,
    **params: Any,
) -> tuple[EnsembleDetector, float]:
    """The deployed recipe on the fit part of ``split_seed``'s training side (every attack in
    equal shares, each row marked with its family) and its threshold calibrated on the
    calibration slice (the config's FPR target and confidence)."""
    split, is_fit, _ = validation_cut(run, name, split_seed)
    fit = masker(is_fit)
    parts = [with_family(fit(a), attack_family(run.config, k)) for k, a in attacks.items()]
    params = {"penultimate_tail": 0.0, **params}  # the part only where a row names it
    detector = EnsembleDetector(n_jobs=-1, **params).fit_samples(
        fit(clean), equal_shares(parts, seed=0)
    )
    calibration = Calibration.from_scores(
        detector.score_samples(split.calibration(clean)),
        run.config.target_fpr,
        confidence=run.config.calibration_confidence,
    )
    return detector, calibration.threshold


def deployed_table(run: PipelineRun, name: str, proxies: dict[str, Samples]) -> None:
    data = run.samples(name)
    _, _, is_val = validation_cut(run, name)
    val = masker(is_val)
    keys = list(data.attacks)
    print(f"\nDeployed analog ({name}), successful validation images flagged (%):\n")
    print("| parts | threshold | clean FPR | " + " | ".join([*keys, *proxies]) + " | OOD (info) |")
    print("|---" + "|---:" * (len(keys) + len(proxies) + 3) + "|")
    for label, params in DEPLOYED.items():
        detector, threshold = deployed_analog(run, name, data.clean, data.attacks, **params)

        def flagged(samples: Samples) -> np.ndarray:
            return detector.score_samples(samples) > threshold  # noqa: B023 (used in this loop)

        cells = [label]
        cells += deployed_cells(
            detector, threshold, val(data.clean), [val(data.attacks[k]) for k in keys]
        )
        cells += [f"{100 * np.mean(flagged(s)):.1f}" for s in proxies.values()]
        cells.append(", ".join(f"{k} {100 * np.mean(flagged(s)):.1f}" for k, s in data.ood.items()))
        print("| " + " | ".join(cells) + " |", flush=True)


def ood_proxies(run: PipelineRun, name: str, clean: Samples) -> dict[str, Samples]:
    """Training-side OOD stand-ins made from ``clean``'s first images: inverted, rotated by 90
    degrees, pixels shuffled (each image its own permutation), with the run's features."""
    x = clean.images[:PROXY_IMAGES]
    rng = np.random.default_rng(0)
    flat = x.reshape(len(x), -1)
    shuffled = np.take_along_axis(flat, rng.random(flat.shape).argsort(1), 1).reshape(x.shape)
    low, high = run.model(name).config.input_spec.value_range  # type: ignore[union-attr]
    images = {
        "inverted": (low + high) - x,
        "rot90": np.ascontiguousarray(np.rot90(x, 1, axes=(2, 3))),
        "shuffled": shuffled,
    }
    return {k: image_samples(run, name, k, v, clean.feature_names) for k, v in images.items()}


def image_samples(
    run: PipelineRun,
    name: str,
    key: str,
    images: np.ndarray,
    feature_names: tuple[str, ...] | None = None,
) -> Samples:
    """Samples of ``images`` (rows 0..N-1) with the run's features and the ensemble's
    precomputed arrays."""
    batch = np.ascontiguousarray(images, np.float32)
    features, logits = run.extract(name, batch)
    return Samples(
        key, batch, features, logits.argmax(1), np.arange(len(batch)),
        feature_names=feature_names,
        extra=EnsembleDetector().precompute(run.model(name), batch),
    )  # fmt: skip


def masker(mask: np.ndarray) -> Callable[[Samples], Samples]:
    """The rows of a sample set whose source image ``mask`` keeps."""
    return lambda samples: samples.take(mask[samples.indices])


def run_arguments(description: str, *, split: bool = False) -> argparse.ArgumentParser:
    """The training-side benchmarks' arguments: a finished run and one of its networks (and,
    with ``split``, ``--split``: the split seed whose training side is read)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run", help="a finished pipeline run directory (its features are read)")
    parser.add_argument("--network", default=None, help="default: the config's deploy network")
    if split:
        parser.add_argument("--split", type=int, default=0, help="the split seed (shipped: 0)")
    return parser


def open_run(args: argparse.Namespace) -> tuple[PipelineRun, str]:
    """The run of :func:`run_arguments`' arguments and the network to measure."""
    run = PipelineRun.open(args.run, progress=False)
    return run, args.network or run.config.deploy_model


def training_side(
    description: str,
) -> tuple[PipelineRun, str, Any, Callable[[Samples], Samples], Callable[[Samples], Samples]]:
    """The command line's run and network, that network's samples, and the maskers of the fit
    part and the validation quarter of its seed-0 training side (:func:`validation_cut`)."""
    run, name = open_run(run_arguments(description).parse_args())
    _, is_fit, is_val = validation_cut(run, name)
    return run, name, run.samples(name), masker(is_fit), masker(is_val)


def main() -> None:
    run, name = open_run(run_arguments(__doc__.splitlines()[0]).parse_args())
    data = run.samples(name)  # every set with its penultimate embedding (cached in the run)
    add_precomputed(
        run, name, EnsembleDetector(), [data.clean, *data.attacks.values(), *data.ood.values()]
    )
    _, _, is_validation = validation_cut(run, name)
    proxies = ood_proxies(run, name, masker(is_validation)(data.clean))
    unseen_table(run, name, proxies)
    deployed_table(run, name, proxies)


if __name__ == "__main__":
    main()
