"""The report's section on the feature sets: every candidate's training-side validation scores
(``features/<model>/selection.json``, :mod:`training.evaluation.feature_selection`) and the one chosen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.reporting.tables import (
    MODEL_LABELS,
    markdown_table,
    order_sets,
    read_optional_json,
    set_label,
)
from training.rundir import RunDir

WHAT = "feature selection"
NOTE = (
    "Each candidate is scored on the seed-0 split's training side only: its source images are cut "
    "into a fit part and a validation quarter, one {detector} detector is fitted on the fit part's "
    "clean images against every seen attack, and the cell is its balanced accuracy (%) at its "
    "own decision on the validation quarter. The best mean wins (ties: the earlier, smaller set). "
    "The {detector} detector's choice is what the protocols' feature-reading detectors, the "
    "deployed detector and the bundle read; a detector with a selection of its own below reads "
    "its own choice in the protocols. The test side plays no part."
)
GROUPS = (
    "Groups: residues (msq, cos per block); emb: the same of each block's output; dirN: cosines to "
    "N more ±1 directions; line: the line-shape score; image / start: how the energy of the input "
    "image / of x_0 spreads; head: logit margin, max probability, log-sum-exp; squeeze: softmax "
    "shift under five squeezers; second: the run's other network's opinion of the prediction "
    "(the bundle then carries that network); nss: the input image's natural-scene statistics "
    "(the NSS baseline's 36)."
)


def _table(selection: Mapping[str, Any]) -> str:
    attacks = order_sets(selection.get("attacks", []))
    chosen = selection.get("chosen")
    header = ["Features", "Columns", *(set_label(a) for a in attacks), "Mean"]
    rows = []
    for row in selection.get("rows", []):
        mark = " (chosen)" if row.get("features") == chosen else ""
        cells = [f"{100 * row[k]:.2f}" if k in row else "" for k in [*attacks, "mean"]]
        if mark:
            cells = [f"**{c}**" for c in cells]
        rows.append([f"{row.get('features', '?')}{mark}", str(row.get("n_features", "")), *cells])
    return markdown_table(header, rows)


def _own_selections(run: RunDir, model: str) -> list[Mapping[str, Any]]:
    """The selections of the detectors that chose their own set (``selection-<detector>.json``)."""
    return [
        s
        for path in run.own_feature_selections(model)
        if (s := read_optional_json(path, WHAT)) is not None
    ]


def feature_selection_section(run_dir: Path, models: Sequence[str]) -> list[str]:
    """One table per network and selecting detector; nothing when no network has a selection."""
    run = RunDir(run_dir)
    found = {
        m: s
        for m in models
        if (s := read_optional_json(run.feature_selection(m), WHAT)) is not None
    }
    if not found:
        return []
    detector = next(iter(found.values())).get("detector", "?")
    lines = ["## Feature sets, chosen on the training side", "", NOTE.format(detector=detector), ""]
    for model, selection in found.items():
        label = MODEL_LABELS.get(model, model.upper())
        for chosen in [selection, *_own_selections(run, model)]:
            by = chosen.get("detector", "?")
            lines += [f"**{label}**, {by}: {chosen.get('chosen', '?')}", "", _table(chosen), ""]
    return [*lines, GROUPS, ""]
