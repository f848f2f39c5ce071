"""The shipped recipe against small changes to it, each measured on the same splits.

    .venv/bin/python benchmarks/deployed_variants.py runs/quick --variants shipped no-validation
        no-validation+half-shares no-validation+minimal-family [--seeds 0 1 2 3 4]

Each variant is the deployed recipe (``training.evaluation.deployable.deploy``) with some of its steps
replaced for the measurement only; ``a+b`` applies both:

* ``shipped``: unchanged (``deployed_spread.py``'s rows);
* ``no-validation``: calibrated without the network's own validation images (the recipe
  before session 49: the slice and the fitting images' held-out scores);
* ``half-shares``: every attack's share of the training side capped at half the smallest
  set's (does the deployed CW rate grow with training pairs?);
* ``minimal-family``: CW and DeepFool one attack family (one forest set for both);
* ``linf-minimal-families``: two families, the L-inf attacks and the minimal-perturbation ones;
* ``validation-fit``: the validation images are clean fitting rows instead, and join the
  calibration through their held-out scores, not the Guard's.

One row per split seed as ``deployed_spread.py`` prints it, then mean, std and min. It reads
the test side of every split to report it: nothing here is chosen on these rows. Each variant's
seeds are kept in ``RUN/deployed_variants.json`` with the recipe they changed (``RECIPE``), so an
interrupted run resumes and a row of an older recipe is measured again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import training.evaluation.deployable as deployable
from detector import artefacts
from training.data.datasets import to_arrays
from training.evaluation.context import PipelineRun, add_precomputed, validation_set
from training.evaluation.protocols import Samples, concat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deployed_spread import measure, spread_table  # noqa: E402

VALIDATION_INDEX_OFFSET = 1_000_000  # source indices of validation images: never a test index
# The shipped recipe the variants change; a kept row measured against another is measured again.
RECIPE = "calibrated on the slice, the network's validation images and the fitting images"


def validation_clean(run: PipelineRun, name: str) -> Samples:
    """Network ``name``'s validation images (``training.evaluation.context.validation_set``, in a seeded
    order) with their features, for the fitting variant."""
    held_back = validation_set(run, name)
    images, _ = to_arrays(held_back, len(held_back), seed=0)  # type: ignore[arg-type]
    indices = VALIDATION_INDEX_OFFSET + np.arange(len(images))
    return run.image_samples(name, f"validation-clean-{len(images)}", images, indices)


def _capped_shares(parts: list[Samples], *, seed: int) -> Samples:
    size = min(len(p) for p in parts) // 2
    rng = np.random.default_rng(seed)
    return concat([p.subsample(size, rng) for p in parts], "abnormal")


def _grouped(groups: dict[str, str]) -> Callable[..., str]:
    family = deployable.attack_family

    def grouped(config: Any, key: str) -> str:
        own = family(config, key)
        return groups.get(own, own)

    return grouped


def _no_validation(run: PipelineRun, name: str) -> None:
    return None


def _validation_fit(run: PipelineRun) -> dict[str, Callable[..., Any]]:
    """Replacements that make the validation images clean fitting rows, calibrated through
    their held-out scores."""
    extra = validation_clean(run, run.config.deploy_model)
    fit_with_outliers = deployable.fit_with_outliers
    calibration_clean_scores = deployable.calibration_clean_scores

    def fitted_with_validation(unfitted, clean, abnormal, synthetic):  # type: ignore[no-untyped-def]
        add_precomputed(run, run.config.deploy_model, unfitted, [extra])
        return fit_with_outliers(unfitted, concat([clean, extra], "clean"), abnormal, synthetic)

    def calibrated_with_validation(guard, fitted, clean, split, validation=None):  # type: ignore[no-untyped-def]
        scores = calibration_clean_scores(guard, fitted, clean, split)
        held_out = fitted.score_held_out(extra)
        scores["validation"] = held_out[np.isfinite(held_out)]
        return scores

    return {
        "fit_with_outliers": fitted_with_validation,
        "calibration_clean_scores": calibrated_with_validation,
        "validation_images": _no_validation,
    }


def variant_steps(run: PipelineRun, variant: str) -> dict[str, Callable[..., Any]]:
    """The ``training.evaluation.deployable`` functions variant ``variant`` (``a+b``: both) replaces."""
    minimal = {"cw-batched": "minimal", "deepfool-batched": "minimal", "cw": "minimal"}
    linf = {"fgm": "linf", "bim": "linf", "apgd": "linf", "apgd-batched": "linf"}
    variants: dict[str, Callable[[], dict[str, Callable[..., Any]]]] = {
        "shipped": dict,
        "no-validation": lambda: {"validation_images": _no_validation},
        "half-shares": lambda: {"equal_shares": _capped_shares},
        "minimal-family": lambda: {"attack_family": _grouped(minimal | {"deepfool": "minimal"})},
        "linf-minimal-families": lambda: {
            "attack_family": _grouped(minimal | linf | {"deepfool": "minimal"})
        },
        "validation-fit": lambda: _validation_fit(run),
    }
    steps: dict[str, Callable[..., Any]] = {}
    for part in variant.split("+"):
        if part not in variants:
            raise SystemExit(f"unknown variant {part!r}; known: {', '.join(variants)}")
        steps |= variants[part]()
    return steps


@contextmanager
def replaced(steps: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """``training.evaluation.deployable``'s functions ``steps`` replaced while the block runs."""
    saved = {name: getattr(deployable, name) for name in steps}
    try:
        for name, step in steps.items():
            setattr(deployable, name, step)
        yield
    finally:
        for name, step in saved.items():
            setattr(deployable, name, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished pipeline run directory (its features are read)")
    parser.add_argument("--variants", nargs="+", default=["shipped"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = PipelineRun.open(args.run, progress=False)
    detector = run.config.deploy_detector
    out = args.out or Path(args.run) / "deployed_variants.json"
    by_variant: dict[str, dict[str, Any]] = artefacts.read_json(out) if out.is_file() else {}
    for variant in args.variants:
        rows = by_variant.setdefault(variant, {})
        missing = [s for s in args.seeds if rows.get(str(s), {}).get("recipe") != RECIPE]
        with replaced(variant_steps(run, variant) if missing else {}):
            for seed in missing:
                rows[str(seed)] = measure(run, detector, seed) | {"recipe": RECIPE}
                artefacts.write_json(out, by_variant)
                print(f"{variant}, seed {seed}: {json.dumps(rows[str(seed)]['rates'])}", flush=True)
    for variant in args.variants:
        rows = {
            seed: entry for seed, entry in by_variant[variant].items() if int(seed) in args.seeds
        }
        print(f"\n{variant}: held-out rates per split seed (%), threshold at the calibrated FPR\n")
        print(spread_table(rows))


if __name__ == "__main__":
    main()
