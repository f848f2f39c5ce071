"""Does the novelty part flag its own clean fitting images, held out, as it flags new ones?

    .venv/bin/python benchmarks/novelty_held_out.py runs/quick [--seeds 0 1 2 3 4] [--folds 5]

The shipped threshold is calibrated on the calibration slice's scores and on the fitting clean
images' held-out scores (``Detector.score_held_out``). For the novelty part those read the
nearest clean fitting image of another source, in a metric (log offsets, standardization,
class means, shrunk covariance) fitted on every fitting image, the scored one included. If that
in-sample metric pulled its own images in, the held-out scores would flag too few of them and
the threshold would land low. Measured per split seed, on the deploy network's clean images
only: the novelty detector (the ensemble's, default parameters) is fitted on the split's
training side, and the share of images past each clean-CDF level is printed for

- **held-out fitting**: the training side's own images, as ``score_held_out`` reads them (each
  one's rank among the fitting images' own nearest distances: exactly the clean CDF);
- **cross-fitted**: the same images, each scored by a novelty detector fitted without its fold
  (``--folds``, by source image): a metric that never saw it;
- **slice** and **test**: the split's calibration and test images, which nothing was fitted on.

The levels are where the part's tail ramp (2.5%) reaches 0 (the ramp's start), 0.5 (the default
decision) and about the shipped threshold (0.68). Reads the test side to report it, chooses
nothing.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from detector.nearest import clean_cdf
from detector.novelty import NoveltyDetector
from training.evaluation.context import PipelineRun
from training.evaluation.protocols import Samples, Split
from training.reporting.report import markdown_table

TAIL = 0.025  # the ensemble's novelty tail
RAMP_LEVELS = (0.0, 0.5, 0.68)  # the tail ramp's values whose clean-CDF levels are read


def held_out(detector: NoveltyDetector, fitting: Samples) -> np.ndarray:
    """The fitting images' scores as ``score_held_out`` reads them: the nearest clean fitting
    image of another source, in the metric fitted on all of them."""
    scorer = detector.to_torch()
    source = torch.from_numpy(np.unique(fitting.indices, return_inverse=True)[1])
    with torch.inference_mode():
        rows = torch.from_numpy(np.asarray(fitting.features, np.float32))
        labels = torch.from_numpy(np.asarray(fitting.predicted))
        distance = scorer.distance(rows, labels, groups=(source, source))
        return clean_cdf(scorer.reference, distance).numpy().astype(np.float64)


def cross_fitted(clean: Samples, folds: int, seed: int) -> np.ndarray:
    """Each clean image's novelty score by a detector fitted without its fold."""
    fold = np.random.default_rng(seed).integers(0, folds, len(clean))
    scores = np.empty(len(clean))
    for k in range(folds):
        kept = fold != k
        detector = NoveltyDetector().fit(clean.features[kept], clean.predicted[kept])
        scores[~kept] = detector.score(clean.features[~kept], clean.predicted[~kept])
    return scores


def split_rows(clean: Samples, split: Split, folds: int) -> list[list[str]]:
    """One row per ramp level: the share (%) of each side's images past it."""
    fitting = split.train(clean)
    detector = NoveltyDetector().fit(fitting.features, fitting.predicted)
    scores = {
        "held-out fitting": held_out(detector, fitting),
        "cross-fitted": cross_fitted(fitting, folds, split.seed),
    }
    for side, samples in (("slice", split.calibration(clean)), ("test", split.test(clean))):
        scores[side] = detector.score(samples.features, samples.predicted)
    rows = []
    for ramp in RAMP_LEVELS:
        level = 1 - TAIL * (1 - ramp)
        past = [100 * float(np.mean(s > level)) for s in scores.values()]
        rows.append([str(split.seed), f"{ramp:.2f}", f"{100 * (1 - level):.2f}",
                     *(f"{p:.2f}" for p in past)])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished pipeline run directory (its features are read)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--folds", type=int, default=5)
    args = parser.parse_args()
    run = PipelineRun.open(args.run, progress=False)
    clean = run.samples(run.config.deploy_model).clean
    universe = int(clean.indices.max()) + 1
    header = ["split seed", "ramp", "nominal (%)", "held-out fitting", "cross-fitted", "slice",
              "test"]  # fmt: skip
    rows = []
    for seed in args.seeds:
        rows.extend(split_rows(clean, Split(seed, run.config.test_fraction, universe), args.folds))
        print(f"split {seed} measured", flush=True)
    values = np.array([[float(v) for v in row[2:]] for row in rows])
    for i, ramp in enumerate(RAMP_LEVELS):
        mean = values[i :: len(RAMP_LEVELS)].mean(0)
        rows.append(["mean", f"{ramp:.2f}", *(f"{v:.2f}" for v in mean)])
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
