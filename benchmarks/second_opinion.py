"""A second network's opinion as detector features, measured on the TRAINING side of a run only.

A minimal perturbation made for one network rarely moves another: the run's other network
(vanilla beside LAP) mostly keeps the original class on the deploy network's CW and DeepFool
images, and mostly agrees with it on clean images. Three columns carry that opinion beside the
shipped features: whether the other network agrees with the deploy network's prediction, the
log of its probability of that class, and its max probability. Same cut as
``ensemble_parts.py`` (the seed-0 training side, a validation quarter held out; the test side is
never read); two tables, each without and with the columns:

1. deployed analog: every attack in equal shares, the threshold calibrated on the calibration
   slice (the config's FPR target and confidence), successful validation images flagged;
2. unseen analog: forests on FGM eps=0.1 only, balanced accuracy at the ensemble's decision 0.5.

The columns are :mod:`detector.opinion`'s feature group (``FeatureSpec(second=True)``), which
the pipeline's feature selection may pick; a run whose chosen set already holds them is measured
here without them (they are dropped) and with them.

    .venv/bin/python benchmarks/second_opinion.py runs/quick
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from detector.novelty import EnsembleDetector
from detector.opinion import OPINION_NAMES, second_opinion
from training.experiments import Samples
from training.pipeline import PipelineRun

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_parts import (  # noqa: E402
    UNSEEN_TRAIN,
    deployed_analog,
    deployed_cells,
    masker,
    open_run,
    run_arguments,
    unseen_cells,
    unseen_pairs,
    validation_cut,
)


def opinion(other: torch.nn.Module, samples: Samples, batch: int = 512) -> np.ndarray:
    """[N, 3]: :func:`detector.opinion.second_opinion` of ``samples`` (their predicted labels)."""
    parts = []
    predicted = torch.from_numpy(np.asarray(samples.predicted, np.int64))
    with torch.inference_mode():
        for start in range(0, len(samples), batch):
            x = torch.from_numpy(samples.images[start : start + batch])
            parts.append(second_opinion(other, x, predicted[start : start + batch]))
    return torch.cat(parts).numpy() if parts else np.zeros((0, len(OPINION_NAMES)), np.float32)


def without_opinion(samples: Samples) -> Samples:
    """The samples without the opinion columns (when the run's chosen features hold them)."""
    names = samples.feature_names or ()
    keep = np.asarray([i for i, n in enumerate(names) if n not in OPINION_NAMES], np.int64)
    if len(keep) == len(names):
        return samples
    return replace(
        samples, features=samples.features[:, keep], feature_names=tuple(names[i] for i in keep)
    )


def with_opinion(samples: Samples, columns: np.ndarray) -> Samples:
    """The samples with the opinion columns appended."""
    names = (*(samples.feature_names or ()), *OPINION_NAMES)
    features = np.hstack([samples.features, columns]).astype(np.float32)
    return replace(samples, features=features, feature_names=names)


def deployed_rates(run: PipelineRun, name: str, sets: dict[str, Samples]) -> list[str]:
    """:func:`deployed_cells` of the deployed recipe on ``sets`` ('clean' and the attack keys)."""
    attacks = {k: s for k, s in sets.items() if k != "clean"}
    detector, threshold = deployed_analog(run, name, sets["clean"], attacks)
    val = masker(validation_cut(run, name)[2])
    return deployed_cells(detector, threshold, val(sets["clean"]), [*map(val, attacks.values())])


def unseen_accuracies(run: PipelineRun, name: str, sets: dict[str, Samples]) -> list[str]:
    """:func:`unseen_cells` of the ensemble fitted on ``UNSEEN_TRAIN`` only."""
    val = masker(validation_cut(run, name)[2])
    clean, attacked = unseen_pairs(run, name, sets["clean"], sets[UNSEEN_TRAIN])
    detector = EnsembleDetector(n_jobs=-1).fit_samples(clean, attacked)
    others = [val(s) for k, s in sets.items() if k not in ("clean", UNSEEN_TRAIN)]
    return unseen_cells(detector, val(sets["clean"]), others)


def main() -> None:
    parser = run_arguments(__doc__.splitlines()[0])
    parser.add_argument("--other", default=None, help="default: the run's other network")
    args = parser.parse_args()
    run, name = open_run(args)
    other_name = args.other or run.config.second_network(name)
    data = run.samples(name)
    base = {k: without_opinion(s) for k, s in {"clean": data.clean, **data.attacks}.items()}
    other = run.model(other_name)
    second = {k: with_opinion(s, opinion(other, s)) for k, s in base.items()}
    for k, s in second.items():
        print(f"{other_name} agrees with {name} on {100 * s.features[:, -3].mean():.1f}% of {k}")
    keys = list(data.attacks)
    print(f"\nDeployed analog ({name}), successful validation images flagged (%):\n")
    print("| features | threshold | clean FPR | " + " | ".join(keys) + " |")
    print("|---" + "|---:" * (len(keys) + 2) + "|")
    for label, sets in (("shipped", base), (f"+ {other_name}'s opinion", second)):
        print(f"| {label} | " + " | ".join(deployed_rates(run, name, sets)) + " |", flush=True)
    others = [k for k in keys if k != UNSEEN_TRAIN]
    print(f"\nUnseen analog ({name}; forests on {UNSEEN_TRAIN}), balanced accuracy at 0.5:\n")
    print("| features | clean FPR | " + " | ".join(others) + " | mean |")
    print("|---" + "|---:" * (len(others) + 2) + "|")
    for label, sets in (("shipped", base), (f"+ {other_name}'s opinion", second)):
        print(f"| {label} | " + " | ".join(unseen_accuracies(run, name, sets)) + " |", flush=True)


if __name__ == "__main__":
    main()
