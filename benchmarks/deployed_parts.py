"""Which part of a finished run's deployed ensemble flags what, on its held-out side.

    .venv/bin/python benchmarks/deployed_parts.py runs/quick

Two tables, both scored by the bundle's Guard (``Guard.part_scores``, the server's path):

1. per part, the share of held-out clean images and of each attack's held-out *successful* images
   whose part score is above the deployed threshold (the ensemble flags where any part does, so
   the clean column shows how the FPR budget is spent and the attack columns who catches what);
2. for information only, the ensemble without some parts, its threshold recalibrated on the
   run's calibration slice (the config's FPR target and confidence, as ``fit_deployable``):
   what each part costs the attacks. It reads the test side, so it explains a bundle and never
   chooses one: ``benchmarks/ensemble_parts.py`` is the training-side place to choose.
"""

from __future__ import annotations

import argparse

import numpy as np

from detector.calibration import Calibration
from detector.guard import Guard
from training.evaluation.context import PipelineRun
from training.evaluation.deployable import SPLIT_SEED, load_deployable
from training.evaluation.protocols import Split
from training.reporting.report import markdown_table

WITHOUT = {
    "every part (shipped)": (),
    "without penultimate": ("penultimate",),
    "without the synthetic family": ("family synthetic",),
    "without novelty": ("novelty",),
    "without margin": ("margin",),
    "forests and families only": ("penultimate", "family synthetic", "novelty", "margin"),
}


def held_out_sets(run: PipelineRun, name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({'clean': held-out clean images, attack: its held-out successful images}, the
    calibration slice's clean images), on the deployable's split."""
    data = run.samples(name)
    split = Split(SPLIT_SEED, run.config.test_fraction, int(data.clean.indices.max()) + 1)
    sets = {"clean": split.test(data.clean).images}
    for key, attack in data.attacks.items():
        held_out = split.test(attack)
        sets[key] = held_out.images[np.asarray(held_out.success, bool)]
    return sets, split.calibration(data.clean).images


def part_table(parts: dict[str, dict[str, np.ndarray]], threshold: float) -> str:
    names = list(next(iter(parts.values())))
    rows = [
        [name, *(f"{100 * np.mean(p[name] > threshold):.2f}" for p in parts.values())]
        for name in names
    ]
    ensemble = [np.max(np.stack(list(p.values())), 0) for p in parts.values()]
    rows.append(["ensemble (max)", *(f"{100 * np.mean(s > threshold):.2f}" for s in ensemble)])
    return markdown_table(["part", *parts], rows)


def without_table(
    parts: dict[str, dict[str, np.ndarray]], calibration: dict[str, np.ndarray], run: PipelineRun
) -> str:
    rows = []
    for label, dropped in WITHOUT.items():
        kept = [n for n in calibration if n not in dropped]
        if len(kept) == len(calibration) and dropped:
            continue  # the bundle has no such part

        def score(by_part: dict[str, np.ndarray], kept: list[str] = kept) -> np.ndarray:
            return np.max(np.stack([by_part[n] for n in kept]), 0)

        fitted = Calibration.from_scores(
            score(calibration).astype(np.float64),
            run.config.target_fpr,
            default_vote_threshold=0.5,
            confidence=run.config.calibration_confidence,
        )
        cells = [f"{100 * np.mean(score(p) > fitted.threshold):.2f}" for p in parts.values()]
        rows.append([label, f"{fitted.threshold:.3f}", *cells])
    return markdown_table(["parts", "threshold", *parts], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished run directory (with detector/ and bundle/)")
    args = parser.parse_args()
    run = PipelineRun.open(args.run, progress=False)
    _, calibration, info = load_deployable(args.run)
    guard = Guard.from_bundle(run.dir.bundle, device="cpu")
    sets, calibration_images = held_out_sets(run, info["network"])
    parts = {key: guard.part_scores(images) for key, images in sets.items()}
    if not parts["clean"]:
        raise SystemExit(f"the deployed {info['kind']} detector has no parts")
    print(f"deployed threshold {calibration.threshold:.3f}; n: " + ", ".join(
        f"{key} {len(images)}" for key, images in sets.items()
    ))  # fmt: skip
    print("\nshare above the deployed threshold, per part (%):\n")
    print(part_table(parts, calibration.threshold))
    print("\nfor information (test side): the ensemble without some parts, recalibrated (%):\n")
    print(without_table(parts, guard.part_scores(calibration_images), run))


if __name__ == "__main__":
    main()
