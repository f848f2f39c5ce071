"""What a richer clean-only part, or per-class thresholds, buy the deployed ensemble: measured on
the TRAINING side of a finished run (the deploy network's split, seed 0 unless ``--split``, cut
as ensemble_parts.py cuts it).

The deployed analog (every attack in equal shares on the fit part, with the penultimate part)
gives each part's score on the validation quarter. Variants of its clean-only parts:

- ``+ layers``: one more part, Lee et al.'s per-block Gaussian scores (``MahalanobisDetector``
  with ``layers="blocks"``: the first block's input and every block's output; input
  pre-processing off; class means and tied covariance on the fit part's clean images by predicted
  class), each layer's score read as its clean CDF on those images, the max over layers read
  again as a clean CDF, ramped over its last 2.5%;
- ``layers for penultimate``: that part in place of the penultimate part;
- ``penultimate OR layers``: one part, the max of the two clean CDFs read as a clean CDF, ramped
  over 2.5% (the same false-positive budget as the penultimate part alone).

Each variant's threshold is calibrated on the calibration slice (the config's FPR target and
confidence). Last row: the shipped parts with one threshold per predicted class (Mondrian), each
at the global threshold's FPR on that class's calibration images. Cells: the share of each
attack's successful validation images flagged, and of the three training-side OOD stand-ins;
the run's OOD sets and the outside sets (``training.data.outside_sets``; ``mnist`` only when ``make
probe-data`` has unpacked it) are printed for information only: never choose on them.
(``clean_parts_screen.py`` screens other clean-only candidates alone, outside the ensemble.)

    .venv/bin/python benchmarks/clean_part_frontier.py runs/quick [--split 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from detector.calibration import Calibration, calibrate_threshold
from detector.ensemble import PENULTIMATE_TAIL, EnsembleDetector, tail_ramp
from detector.errors import DataNotFoundError
from detector.mahalanobis import MahalanobisDetector
from detector.nearest import clean_cdf, nearest_distance
from detector.networks import InputSpec
from training.data.outside_sets import outside_set
from training.evaluation.context import PipelineRun, add_precomputed
from training.evaluation.protocols import Samples
from training.reporting.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_combiners import part_matrix, part_names  # noqa: E402
from ensemble_parts import (  # noqa: E402
    deployed_analog,
    image_samples,
    masker,
    ood_proxies,
    open_run,
    run_arguments,
    validation_cut,
)

OUTSIDE = ("mnist", "letters", "shapes", "photos", "smooth-noise")  # information only
OUTSIDE_IMAGES = 500


def cdf(reference: np.ndarray, values: np.ndarray) -> np.ndarray:
    """:func:`detector.nearest.clean_cdf` of numpy arrays (``reference`` sorted)."""
    sorted_clean, queries = (
        torch.from_numpy(np.ascontiguousarray(a, np.float32)) for a in (reference, values)
    )
    return clean_cdf(sorted_clean, queries).numpy()


def ramp(u: np.ndarray) -> np.ndarray:
    """The ensemble's ramp over a clean CDF's last ``PENULTIMATE_TAIL``."""
    return tail_ramp(torch.from_numpy(np.asarray(u, np.float32)), PENULTIMATE_TAIL).numpy()


class LayerPart:
    """Lee et al.'s per-block Gaussian scores as one clean-only part (see the module docstring)."""

    def __init__(self, run: PipelineRun, name: str, clean: Samples) -> None:
        self.model = run.model(name)
        self.gaussian = MahalanobisDetector(magnitudes=(0.0,), layers="blocks")
        self.gaussian.fit_clean(self.model, clean.images, clean.predicted)
        distances = self._distances(clean.images)
        self.per_layer = np.sort(distances, 0)
        self.reference = np.sort(self._layer_max(distances))

    def _distances(self, images: np.ndarray) -> np.ndarray:
        return -self.gaussian.mahalanobis_features(self.model, images, 0.0)  # higher = farther

    def _layer_max(self, distances: np.ndarray) -> np.ndarray:
        columns = [cdf(self.per_layer[:, i], distances[:, i]) for i in range(distances.shape[1])]
        return np.max(columns, 0)

    def uniform(self, images: np.ndarray) -> np.ndarray:
        """The part's clean CDF value of each image (about uniform on clean images)."""
        return cdf(self.reference, self._layer_max(self._distances(images)))


def penultimate_uniform(
    detector: EnsembleDetector, samples: Samples, *, fitting: bool = False
) -> np.ndarray:
    """The penultimate part's clean CDF value of each row (before its ramp); ``fitting``: the
    rows are the part's own clean points, each read against the others."""
    part = detector.to_torch().eval().embedding
    assert part is not None, "the deployed analog carries the penultimate part"
    rows = torch.from_numpy(np.asarray(detector.serving_rows(samples), np.float32))
    embedding = rows[:, -part.points.shape[1] :]
    with torch.inference_mode():
        if not fitting:
            return part(embedding).numpy()
        distance = nearest_distance(embedding, part.points, exclude_self=True)
        return clean_cdf(part.reference, distance).numpy()


def variant_scores(
    parts: np.ndarray, penultimate: int, pen_u: np.ndarray, layer_u: np.ndarray, merged: np.ndarray
) -> dict[str, np.ndarray]:
    """Each variant's combined score of the rows (``merged``: the sorted clean reference of the
    max of the fit part's two clean CDFs)."""
    replaced = parts.copy()
    replaced[:, penultimate] = ramp(layer_u)
    both = parts.copy()
    both[:, penultimate] = ramp(cdf(merged, np.maximum(pen_u, layer_u)))
    return {
        "shipped": parts.max(1),
        "+ layers": np.maximum(parts.max(1), ramp(layer_u)),
        "layers for penultimate": replaced.max(1),
        "penultimate OR layers": both.max(1),
    }


def outside_samples(run: PipelineRun, name: str, clean: Samples) -> dict[str, Samples]:
    """The outside sets (information only), as the run's samples; ``mnist`` when unpacked."""
    spec: InputSpec = run.model(name).config.input_spec  # type: ignore[union-attr,assignment]
    low, high = spec.value_range
    shape = tuple(clean.images.shape[1:])
    sets = {}
    for key in OUTSIDE:
        try:
            images = outside_set(key, OUTSIDE_IMAGES, shape, (low, high), seed=1)
        except DataNotFoundError as error:
            print(f"{key}: left out ({error})")
            continue
        sets[f"{key} (info)"] = image_samples(run, name, key, images, clean.feature_names)
    return sets


def mondrian(
    scores: np.ndarray,
    predicted: np.ndarray,
    cal: np.ndarray,
    cal_predicted: np.ndarray,
    threshold: float,
) -> np.ndarray:
    """Flags with one threshold per predicted class, each calibrated (``calibrate_threshold``) at
    the global ``threshold``'s FPR on the calibration images (``cal``) of that class."""
    target = float(np.mean(cal > threshold))
    per_class = {
        c: calibrate_threshold(cal[cal_predicted == c], target) for c in np.unique(cal_predicted)
    }
    limits = np.array([per_class.get(c, threshold) for c in predicted])
    return scores > limits


def main() -> None:
    args = run_arguments(__doc__.splitlines()[0], split=True).parse_args()
    run, name = open_run(args)
    data = run.samples(name)
    add_precomputed(
        run, name, EnsembleDetector(), [data.clean, *data.attacks.values(), *data.ood.values()]
    )
    split, is_fit, is_validation = validation_cut(run, name, args.split)
    val = masker(is_validation)
    clean = val(data.clean)
    sets = {"calibration": split.calibration(data.clean), "clean FPR": clean}
    sets |= {k: val(a) for k, a in data.attacks.items()} | ood_proxies(run, name, clean)
    sets |= {f"{k} (info)": s for k, s in data.ood.items()} | outside_samples(run, name, clean)
    success = {k: _successful(s) for k, s in sets.items()}
    detector, _ = deployed_analog(
        run, name, data.clean, data.attacks, split_seed=args.split, penultimate_tail=0.025
    )
    fit_clean = masker(is_fit)(data.clean)
    layers = LayerPart(run, name, fit_clean)
    merged = np.sort(
        np.maximum(
            penultimate_uniform(detector, fit_clean, fitting=True),
            layers.uniform(fit_clean.images),
        )
    )
    penultimate = part_names(detector, clean).index("penultimate")
    scores = {
        k: variant_scores(
            part_matrix(detector, s),
            penultimate,
            penultimate_uniform(detector, s),
            layers.uniform(s.images),
            merged,
        )
        for k, s in sets.items()
    }
    rows, config, shipped = [], run.config, 0.0
    for label in scores["clean FPR"]:
        cal = scores["calibration"][label]
        threshold = Calibration.from_scores(
            cal, config.target_fpr, confidence=config.calibration_confidence
        ).threshold
        flagged = {k: s[label] > threshold for k, s in scores.items()}
        rows.append([label, f"{threshold:.3f}", *_cells(flagged, success)])
        shipped = threshold if label == "shipped" else shipped
    cal_predicted = sets["calibration"].predicted
    calibration = scores["calibration"]["shipped"]
    per_class = {
        k: mondrian(s["shipped"], sets[k].predicted, calibration, cal_predicted, shipped)
        for k, s in scores.items()
    }
    rows.append(["shipped, one threshold per class", "-", *_cells(per_class, success)])
    print(markdown_table(["variant", "threshold", *list(sets)[1:]], rows))


def _successful(samples: Samples) -> np.ndarray:
    """Rows that count: an attack's successful ones, every row of any other set."""
    if samples.success is None:
        return np.ones(len(samples), bool)
    return np.asarray(samples.success, bool)


def _cells(flagged: dict[str, np.ndarray], success: dict[str, np.ndarray]) -> list[str]:
    return [f"{100 * np.mean(f[success[k]]):.1f}" for k, f in flagged.items() if k != "calibration"]


if __name__ == "__main__":
    main()
