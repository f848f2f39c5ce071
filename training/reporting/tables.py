"""The report's vocabulary and reading helpers, shared by every report section: labels and order
of networks, detectors and sets, markdown tables and cells, and readers of the run directory's
features and scores. Nothing here writes a report (that is :mod:`training.reporting.report`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from detector import artefacts
from detector.base import DetectorInfo
from detector.errors import ArtefactError, ConfigError
from detector.registry import detector_info
from training.rundir import RunDir

NOT_RUN = "not run"
CLEAN = "clean"
OOD_PREFIX = "ood-"
MODEL_ORDER = ("vanilla", "rce", "lap")
MODEL_LABELS = {"vanilla": "VAN", "lap": "LAP", "rce": "RCE"}
DETECTOR_ORDER = ("transport", "ensemble", "novelty", "mahalanobis", "nss", "quantile")
ATTACK_ORDER = (
    "fgm",
    "pgd",
    "apgd",
    "bim",
    "autoattack",
    "aa",
    "deepfool",
    "cw",
    "hsj",
    "hopskipjump",
    "boundary",
)
ATTACK_LABELS = {
    "fgm": "FGM",
    "pgd": "PGD",
    "apgd": "APGD",
    "bim": "BIM",
    "autoattack": "AA",
    "aa": "AA",
    "deepfool": "DF",
    "cw": "CW",
    "hsj": "HSJ",
    "hopskipjump": "HSJ",
    "boundary": "BA",
}
_EPS = re.compile(r"^(?P<name>.+?)-eps(?P<eps>[0-9.eE+-]+)$")
_MSQ = re.compile(r"^msq_(\d+)$")
_COS = re.compile(r"^cos_(\d+)$")

Record = Mapping[str, Any]


# ---- names and ordering -----------------------------------------------------------------------


def _split_eps(key: str) -> tuple[str, float | None]:
    """'fgm-eps0.1' -> ('fgm', 0.1); 'bim' -> ('bim', None)."""
    match = _EPS.match(key)
    if not match:
        return key, None
    try:
        return match["name"], float(match["eps"])
    except ValueError:
        return key, None


def set_label(key: str) -> str:
    """Display name of an attack or data set: 'fgm-eps0.03' -> 'FGM ε=0.03', 'ood-digits' -> 'digits'."""
    if key == CLEAN:
        return key
    if key.startswith(OOD_PREFIX):
        return key[len(OOD_PREFIX) :]
    name, eps = _split_eps(key)
    label = ATTACK_LABELS.get(name, name.upper() if name.isalnum() else name)
    return f"{label} ε={eps:g}" if eps is not None else label


def registered_detector(detector: str) -> DetectorInfo | None:
    """The registry's metadata of ``detector``; None for a detector this version does not have
    (a results file written by another version)."""
    try:
        return detector_info(detector)
    except ConfigError:
        return None


def detector_label(detector: str) -> str:
    """A detector's short name in the tables ('transport' -> 'TR'), from the registry."""
    info = registered_detector(detector)
    return info.short_name if info is not None else detector.upper()


def row_label(model: str, detector: str) -> str:
    """Seed-style row label: ('lap', 'transport') -> 'LAP TR'."""
    return f"{MODEL_LABELS.get(model, model.upper())} {detector_label(detector)}"


def detector_legend(detectors: Iterable[str]) -> str:
    """One line naming the tables' detectors: short name, registry name, what it does."""
    parts = []
    for name in dict.fromkeys(detectors):
        info = registered_detector(name)
        if info is not None:
            parts.append(f"**{info.short_name}** ({name}): {info.summary}")
    return "Detectors: " + "; ".join(parts) + "." if parts else ""


def _rank(order: Sequence[str]) -> Callable[[str], tuple[int, str]]:
    return lambda key: (order.index(key) if key in order else len(order), key)


def set_rank(key: str) -> tuple[int, int, str, float]:
    """Clean first, then attacks in the seed's order (by ε), then OOD sets."""
    if key == CLEAN:
        return (0, 0, key, 0.0)
    if key.startswith(OOD_PREFIX):
        return (2, 0, key, 0.0)
    name, eps = _split_eps(key)
    index = ATTACK_ORDER.index(name) if name in ATTACK_ORDER else len(ATTACK_ORDER)
    return (1, index, name, eps if eps is not None else 0.0)


def order_models(keys: Iterable[str]) -> list[str]:
    return sorted(set(keys), key=_rank(MODEL_ORDER))


def order_detectors(keys: Iterable[str]) -> list[str]:
    return sorted(set(keys), key=_rank(DETECTOR_ORDER))


def order_sets(keys: Iterable[str]) -> list[str]:
    return sorted(set(keys), key=set_rank)


# ---- markdown ---------------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """A pipe table with padded, aligned columns; the first `left` columns left-aligned, the rest right."""
    widths = [max(3, len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * w if i < left else "-" * (w - 1) + ":" for i, w in enumerate(widths)]
    return "\n".join([line(header), "| " + " | ".join(rule) + " |", *(line(r) for r in rows)])


def percent(value: float) -> str:
    return f"{100 * value:.2f}"


def format_cell(record: Record | None, metric: str) -> str:
    """'97.14 ± 0.59' (percent) from record[metric] and record[metric + '_std']; NOT_RUN if absent."""
    if record is None:
        return NOT_RUN
    value = record.get(metric)
    if value is None or not np.isfinite(value):
        return "n/a"
    std = record.get(f"{metric}_std")
    return f"{percent(value)} ± {percent(std)}" if std is not None else percent(value)


def _bold_best(
    cells: list[list[str]], values: list[list[float | None]], higher_is_better: bool
) -> None:
    """Bold the best cell(s) of every column in place (only where two or more rows compete)."""
    for col in range(len(values[0]) if values else 0):
        column = [value for row in values if (value := row[col]) is not None]
        if len(column) < 2:
            continue
        best = max(column) if higher_is_better else min(column)
        for row, row_values in zip(cells, values, strict=True):
            value = row_values[col]
            if value is not None and abs(value - best) <= 1e-9:
                row[col + 1] = f"**{row[col + 1]}**"


def metric_table(
    records: Iterable[Record],
    *,
    rows: Sequence[tuple[str, str]],
    columns: Sequence[str],
    column_of: Callable[[Record], str],
    metric: str,
    higher_is_better: bool = True,
    labels: Sequence[str] | None = None,
    mean_column: bool = False,
) -> str:
    """Seed-layout table: one row per (model, detector), one column per `column_of(record)` key
    (headed by `labels`, default the keys' display names)."""
    index = {(r["model"], r["detector"], column_of(r)): r for r in records}
    header = ["Network Det", *(labels if labels is not None else [set_label(c) for c in columns])]
    cells: list[list[str]] = []
    values: list[list[float | None]] = []
    for model, detector in rows:
        found = [index.get((model, detector, c)) for c in columns]
        row_values = [_value(r, metric) for r in found]
        row_cells = [row_label(model, detector), *(format_cell(r, metric) for r in found)]
        if mean_column:
            present = [v for v in row_values if v is not None]
            mean = float(np.mean(present)) if present else None
            suffix = "" if len(present) == len(columns) else f" ({len(present)}/{len(columns)})"
            row_cells.append(percent(mean) + suffix if mean is not None else NOT_RUN)
            row_values.append(mean)
        cells.append(row_cells)
        values.append(row_values)
    if mean_column:
        header.append("mean")
    _bold_best(cells, values, higher_is_better)
    return markdown_table(header, cells)


def _value(record: Record | None, metric: str) -> float | None:
    if record is None or record.get(metric) is None:
        return None
    value = float(record[metric])
    return value if np.isfinite(value) else None


# ---- reading the run --------------------------------------------------------------------------


def read_json_or_empty(path: Path) -> dict[str, Any]:
    return artefacts.read_json(path) if path.is_file() else {}


def read_optional_json(path: Path, what: str) -> Mapping[str, Any] | None:
    """A run file a section can do without: its JSON object, or None when it is missing,
    damaged or not an object (that section is then left out, not the whole report)."""
    try:
        data = artefacts.read_json(path, what=what) if path.is_file() else None
    except ArtefactError:
        return None
    return data if isinstance(data, Mapping) else None


def final_transport(run_dir: Path, model: str) -> float | None:
    """test_transport of the network's last training epoch, if any."""
    epochs = RunDir(run_dir).read_metrics(model)
    return epochs[-1].get("test_transport") if epochs else None


def block_features(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(msq [N, M], cos [N, M]) from a features npz, by feature_names (block-major fallback)."""
    data = artefacts.load_npz(path)
    features = np.asarray(data["features"], dtype=np.float64)
    names = [str(n) for n in data["feature_names"]] if "feature_names" in data else None
    if names is None:
        return features[:, 0::2], features[:, 1::2]
    msq = sorted((int(m[1]), i) for i, n in enumerate(names) if (m := _MSQ.match(n)))
    cos = sorted((int(m[1]), i) for i, n in enumerate(names) if (m := _COS.match(n)))
    return features[:, [i for _, i in msq]], features[:, [i for _, i in cos]]


def load_features(run_dir: Path, model: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every set of features/<model>/, as {set: (msq, cos)} in report order."""
    folder = RunDir(run_dir).feature_dir(model)
    paths = {p.stem: p for p in folder.glob("*.npz")} if folder.is_dir() else {}
    sets = {key: block_features(paths[key]) for key in order_sets(paths)}
    return {key: (msq, cos) for key, (msq, cos) in sets.items() if len(msq) and msq.shape[1]}


def load_scores(
    run_dir: Path,
) -> dict[tuple[str, str, str], dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]]:
    """{(model, detector, setting): {(train, test): (is_abnormal, scores)}} from scores/."""
    found: dict[tuple[str, str, str], dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]] = {}
    for path in sorted(RunDir(run_dir).scores.glob("*/*/*/*__*.npz")):
        setting, detector, model = (
            path.parent.name,
            path.parent.parent.name,
            path.parent.parent.parent.name,
        )
        train, test = path.stem.split("__", 1)
        data = artefacts.load_npz(path)
        found.setdefault((model, detector, setting), {})[(train, test)] = (
            data["is_abnormal"],
            data["scores"],
        )
    return found


def figure_link(run_dir: Path, path: Path, caption: str) -> list[str]:
    """Markdown lines embedding figure ``path`` (relative to ``run_dir``) with its caption."""
    return [f"![{caption}]({path.relative_to(run_dir).as_posix()})", "", f"*{caption}*", ""]
