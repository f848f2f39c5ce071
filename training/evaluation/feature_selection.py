"""Which trajectory features a run's detectors use, chosen on the TRAINING side only.

Every candidate :class:`~detector.features.FeatureSpec` of the config is a subset of the columns
of their union, which the pipeline extracts once. The choice uses the seed-0 split's training
side (never the test side, never the calibration slice): its source images are split again
into a fit part and a validation part; the selection detector is fitted on the fit part's clean
images vs every seen attack's images, and each candidate is scored by its mean balanced
accuracy over the attacks on the validation part. The best candidate wins (ties: the earlier,
smaller one). The table of every candidate's scores is kept in ``RUN/features/<model>/selection.json``
(``selection-<detector>.json`` for a detector of the config's ``own_feature_selection``, which
runs the same selection fitting itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from detector import artefacts
from detector.base import DEFAULT_VOTE_THRESHOLD
from detector.errors import ConfigError
from detector.features import FeatureSpec
from detector.registry import get_detector
from training.evaluation.protocols import Samples, Split, concat, on_all_cores

VALIDATION_FRACTION = 0.25
SELECTION_SEED = 0
MAX_PAIRS_PER_ATTACK = 2000  # per attack on the fit part: enough to rank, cheap to fit


def union_spec(candidates: Sequence[FeatureSpec]) -> FeatureSpec:
    """The smallest spec whose columns contain every candidate's."""
    if not candidates:
        raise ConfigError("at least one feature candidate is needed")
    return FeatureSpec(
        taps=candidates[0].taps,
        extra_directions=max(c.extra_directions for c in candidates),
        line_shape=any(c.line_shape for c in candidates),
        embeddings=any(c.embeddings for c in candidates),
        head=any(c.head for c in candidates),
        start=any(c.start for c in candidates),
        image=any(c.image for c in candidates),
        squeeze=any(c.squeeze for c in candidates),
        second=any(c.second for c in candidates),
        nss=any(c.nss for c in candidates),
    )


def spec_columns(spec: FeatureSpec, names: Sequence[str]) -> np.ndarray:
    """Indices into ``names`` (a union spec's columns) of ``spec``'s columns, in spec order."""
    position = {name: i for i, name in enumerate(names)}
    wanted = spec.names(_n_blocks(names))
    missing = [n for n in wanted if n not in position]
    if missing:
        raise ConfigError(f"features lack the columns {missing[:3]}... of {spec.label()}")
    return np.asarray([position[n] for n in wanted], dtype=np.int64)


def _n_blocks(names: Sequence[str]) -> int:
    return sum(1 for n in names if n.startswith("msq_"))


def restrict(samples: Samples, columns: np.ndarray, names: Sequence[str]) -> Samples:
    """The same samples with only the given feature columns (``names``: all columns' names)."""
    return replace(
        samples,
        features=np.ascontiguousarray(samples.features[:, columns]),
        feature_names=tuple(names[i] for i in columns),
    )


def select_features(
    candidates: Sequence[FeatureSpec],
    names: Sequence[str],
    clean: Samples,
    attacks: dict[str, Samples],
    *,
    detector: str,
    test_fraction: float,
    out: Path | None = None,
) -> tuple[FeatureSpec, dict[str, Any]]:
    """The best candidate on the training side's validation part, and the table of scores."""
    if out is not None and out.is_file():
        saved = artefacts.read_json(out, what="feature selection")
        labels = [c.label() for c in candidates]
        if saved.get("candidates") == labels and saved.get("attacks") == sorted(attacks):
            return candidates[labels.index(saved["chosen"])], saved
    universe = int(max(clean.indices.max(), *(a.indices.max() for a in attacks.values()))) + 1
    split = Split(SELECTION_SEED, test_fraction, universe)
    training_side = ~split.is_test & ~split.is_calibration
    order = np.random.default_rng(SELECTION_SEED).permutation(np.flatnonzero(training_side))
    is_validation = np.zeros(universe, bool)
    is_validation[order[: int(round(len(order) * VALIDATION_FRACTION))]] = True
    is_fit = training_side & ~is_validation
    rows: list[dict[str, Any]] = []
    for spec in candidates:
        columns = spec_columns(spec, names)
        scores = _candidate_scores(columns, names, clean, attacks, is_fit, is_validation, detector)
        rows.append({"features": spec.label(), "n_features": len(columns), **scores})
    best = max(range(len(rows)), key=lambda i: (round(rows[i]["mean"], 4), -i))
    table = {
        "candidates": [c.label() for c in candidates],
        "attacks": sorted(attacks),
        "detector": detector,
        "validation_fraction": VALIDATION_FRACTION,
        "rows": rows,
        "chosen": rows[best]["features"],
    }
    if out is not None:
        artefacts.write_json(out, table)
    return candidates[best], table


def _candidate_scores(
    columns: np.ndarray,
    names: Sequence[str],
    clean: Samples,
    attacks: dict[str, Samples],
    is_fit: np.ndarray,
    is_validation: np.ndarray,
    detector: str,
) -> dict[str, float]:
    """Balanced validation accuracy per attack (and their mean) of one detector fitted on all."""
    rng = np.random.default_rng(SELECTION_SEED)
    fit_parts = []
    for samples in attacks.values():
        part = samples.take(is_fit[samples.indices]).subsample(MAX_PAIRS_PER_ATTACK, rng)
        fit_parts.append(restrict(part, columns, names))
    fit_clean = restrict(clean.take(is_fit[clean.indices]), columns, names)
    abnormal = concat(fit_parts, "abnormal")
    fitted = on_all_cores(get_detector(detector)).fit_samples(fit_clean, abnormal)
    val_clean = restrict(clean.take(is_validation[clean.indices]), columns, names)
    own = fitted.decision_threshold()
    threshold = DEFAULT_VOTE_THRESHOLD if own is None else own
    clean_flags = fitted.score_samples(val_clean) > threshold
    scores: dict[str, float] = {}
    for key, samples in attacks.items():
        part = restrict(samples.take(is_validation[samples.indices]), columns, names)
        paired = np.isin(val_clean.indices, part.indices)
        tnr = 1.0 - float(np.mean(clean_flags[paired])) if paired.any() else 1.0
        tpr = float(np.mean(fitted.score_samples(part) > threshold)) if len(part) else 0.0
        scores[key] = (tpr + tnr) / 2
    scores["mean"] = float(np.mean([scores[k] for k in attacks]))
    return scores
