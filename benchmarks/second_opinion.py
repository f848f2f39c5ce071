"""More networks' opinions as detector features, measured on the TRAINING side of a run only.

A minimal perturbation made for one network rarely moves another: the run's other network
(vanilla beside LAP) mostly keeps the original class on the deploy network's CW and DeepFool
images, and mostly agrees with it on clean images. Three columns carry that opinion beside the
shipped features: whether the other network agrees with the deploy network's prediction, the
log of its probability of that class, and its max probability. ``--also NAME=DIR`` adds the
opinion of a further network, trained with ``lapguard train --out DIR`` (another seed, a plain
network, RCE), beside the run's other one; each alone, then all together. Same cut as
``ensemble_parts.py`` (the seed-0 training side, a validation quarter held out; the test side is
never read); two tables, one row per set of opinions:

1. deployed analog (the shipped recipe, with the penultimate part): every attack in equal
   shares, the threshold calibrated on the calibration slice (the config's FPR target and
   confidence), successful validation images flagged; then at the thresholds that flag each of
   ``--budgets`` of the validation clean images (an operating point with fewer false alarms);
2. unseen analog: forests on FGM eps=0.1 only, balanced accuracy at the ensemble's decision 0.5.

The columns are :mod:`detector.opinion`'s feature group (``FeatureSpec(second=True)``), which
the pipeline's feature selection may pick; a run whose chosen set already holds them is measured
here without them (they are dropped) and with them.

    .venv/bin/python benchmarks/second_opinion.py runs/quick [--also seed1=runs/van-seed1]
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from detector import networks
from detector.calibration import calibrate_threshold
from detector.ensemble import PENULTIMATE_TAIL, EnsembleDetector
from detector.opinion import OPINION_NAMES, second_opinion
from training.evaluation.context import PipelineRun, add_precomputed
from training.evaluation.protocols import Samples

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
    device = next(other.parameters()).device
    predicted = torch.from_numpy(np.asarray(samples.predicted, np.int64))
    with torch.inference_mode():
        for start in range(0, len(samples), batch):
            x = torch.from_numpy(samples.images[start : start + batch]).to(device)
            parts.append(second_opinion(other, x, predicted[start : start + batch]).cpu())
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


def with_opinion(samples: Samples, columns: np.ndarray, prefix: str = "") -> Samples:
    """The samples with the opinion columns appended (named ``prefix`` + each opinion name)."""
    names = (*(samples.feature_names or ()), *(prefix + n for n in OPINION_NAMES))
    features = np.hstack([samples.features, columns]).astype(np.float32)
    return replace(samples, features=features, feature_names=names)


def deployed_rows(
    run: PipelineRun, name: str, sets: dict[str, Samples], budgets: list[float]
) -> list[list[str]]:
    """:func:`deployed_cells` of the deployed recipe on ``sets`` ('clean' and the attack keys):
    at the calibrated threshold, then where it flags each budget of the validation clean images."""
    attacks = {k: s for k, s in sets.items() if k != "clean"}
    detector, threshold = deployed_analog(
        run, name, sets["clean"], attacks, penultimate_tail=PENULTIMATE_TAIL
    )
    val = masker(validation_cut(run, name)[2])
    clean, held_out = val(sets["clean"]), [*map(val, attacks.values())]
    scores = detector.score_samples(clean)
    rows = [["calibrated", *deployed_cells(detector, threshold, clean, held_out)]]
    for budget in budgets:
        at = calibrate_threshold(scores, budget)
        rows.append(
            [f"{100 * budget:g}% of val. clean", *deployed_cells(detector, at, clean, held_out)]
        )
    return rows


def unseen_accuracies(run: PipelineRun, name: str, sets: dict[str, Samples]) -> list[str]:
    """:func:`unseen_cells` of the ensemble fitted on ``UNSEEN_TRAIN`` only."""
    val = masker(validation_cut(run, name)[2])
    clean, attacked = unseen_pairs(run, name, sets["clean"], sets[UNSEEN_TRAIN])
    detector = EnsembleDetector(n_jobs=-1).fit_samples(clean, attacked)
    others = [val(s) for k, s in sets.items() if k not in ("clean", UNSEEN_TRAIN)]
    return unseen_cells(detector, val(sets["clean"]), others)


def opinion_sets(
    base: dict[str, Samples], columns: dict[str, dict[str, np.ndarray]], run_other: str
) -> dict[str, dict[str, Samples]]:
    """Each table row's sets: none, the run's other network's, that with each further network's,
    and with all of them (the further ones only when there are two or more)."""

    def adding(names: list[str]) -> dict[str, Samples]:
        sets = base
        for n in names:
            prefix = "" if n == run_other else f"{n}_"
            sets = {k: with_opinion(s, columns[n][k], prefix) for k, s in sets.items()}
        return sets

    further = [n for n in columns if n != run_other]
    rows = {"no opinion": base, f"{run_other}'s": adding([run_other])}
    rows.update({f"{run_other}'s + {n}'s": adding([run_other, n]) for n in further})
    if len(further) > 1:
        rows["every network's"] = adding([run_other, *further])
    return rows


def main() -> None:
    parser = run_arguments(__doc__.splitlines()[0])
    parser.add_argument("--other", default=None, help="default: the run's other network")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a further network's checkpoint directory (lapguard train --out DIR); repeatable",
    )
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[0.02, 0.03],
        help="validation clean shares the deployed analog is also read at (default 0.02 0.03)",
    )
    args = parser.parse_args()
    run, name = open_run(args)
    other_name = args.other or run.config.second_network(name)
    data = run.samples(name)
    add_precomputed(run, name, EnsembleDetector(), [data.clean, *data.attacks.values()])
    base = {k: without_opinion(s) for k, s in {"clean": data.clean, **data.attacks}.items()}
    nets = {other_name: run.model(other_name)}
    for item in args.also:
        label, _, directory = item.partition("=")
        if not directory or label in nets:
            parser.error(f"--also {item!r}: expected NAME=DIR with a new NAME")
        nets[label] = networks.load(Path(directory), device=run.device)
    columns = {n: {k: opinion(net, s) for k, s in base.items()} for n, net in nets.items()}
    for n, by_set in columns.items():
        agree = ", ".join(f"{k} {100 * c[:, 0].mean():.1f}" for k, c in by_set.items())
        print(f"{n} agrees with {name} (%): {agree}")
    rows = opinion_sets(base, columns, other_name)
    keys = list(data.attacks)
    print(f"\nDeployed analog ({name}), successful validation images flagged (%):\n")
    header = ["opinions", "threshold at", "threshold", "val. clean FPR", *keys]
    print("| " + " | ".join(header) + " |\n|---|---" + "|---:" * (len(header) - 2) + "|")
    for label, sets in rows.items():
        for cells in deployed_rows(run, name, sets, args.budgets):
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    others = [k for k in keys if k != UNSEEN_TRAIN]
    print(f"\nUnseen analog ({name}; forests on {UNSEEN_TRAIN}), balanced accuracy at 0.5:\n")
    print("| opinions | clean FPR | " + " | ".join(others) + " | mean |")
    print("|---" + "|---:" * (len(others) + 2) + "|")
    for label, sets in rows.items():
        print(f"| {label} | " + " | ".join(unseen_accuracies(run, name, sets)) + " |", flush=True)


if __name__ == "__main__":
    main()
