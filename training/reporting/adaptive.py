"""The report's section on adaptive attacks (``results.json`` ``"adaptive"`` rows)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.plots import plot_adaptive_evasion
from training.reporting.tables import MODEL_LABELS, figure_link, markdown_table, order_models
from training.rundir import ADAPTIVE_FIGURE, RunDir

HEADER = (
    "Network",
    "Target",
    "Attack",
    "Budget",
    "Start images",
    "Detected successful",
    "Attacked",
    "Evasion (%)",
    "Pool mean evasion (%)",
    "Start det. (%)",
    "Final det. (%)",
    "Start median L2",
    "Median L2",
    "Median L∞",
    "s/image",
)
NOTE = (
    "Each attack starts from the first test-side images of the seed-0 split (the start attack: "
    "CW for the seed's two attacks, BIM at the same ε for the surrogate ones) and attacks the "
    "start images that fool the network AND are flagged by the target (detected successful); "
    "Attacked < Detected successful where the run was cut short (the rest stays to run: the "
    "command resumes). Evasion: share of the attacked images turned into images that fool the "
    "network and pass the target (one fresh query; for a pool, one random member; pool mean evasion: the same averaged over the members, what a random draw gives in expectation). Start/final "
    "det.: share of successful start/final images flagged (final: attacked images replaced by "
    "the attack's result). Distances to the clean image (start median L2: the start images' "
    "own, over the attacked rows). Targets are fitted on the training "
    "side and calibrated at the target FPR there; 'pool' targets answer each query with a "
    "member drawn at random."
)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def adaptive_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Table rows, ordered by network, target, attack and budget."""
    order = {m: i for i, m in enumerate(order_models(r["model"] for r in rows))}
    ranked = sorted(rows, key=lambda r: (order[r["model"]], r["target"], r["attack"], r["budget"]))
    return [
        [
            MODEL_LABELS.get(r["model"], r["model"].upper()),
            r["target"],
            r["attack"],
            r["budget"],
            str(r["n_start"]),
            str(r["n_detected_successful"]),
            str(r["n_attacked"]),
            _percent(r["evasion_rate"]),
            _percent(r.get("member_evasion_rate")),
            _percent(r["start_detection_rate"]),
            _percent(r["final_detection_rate"]),
            _number(r.get("start_median_l2"), 3),
            _number(r["median_l2"], 3),
            _number(r["median_linf"], 3),
            _number(r["seconds_per_image"], 2),
        ]
        for r in ranked
    ]


def _column(row: Mapping[str, Any]) -> str:
    return f"{MODEL_LABELS.get(row['model'], row['model'].upper())} {row['target']}"


def _by_column(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows ordered by network (the report's order), then target."""
    order = {m: i for i, m in enumerate(order_models(r["model"] for r in rows))}
    return sorted(rows, key=lambda r: (order[r["model"]], r["target"]))


def evasion_matrix(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table: one row per (attack, budget), one evasion
    column per (network, target): the single detector beside the pool."""
    columns = list(dict.fromkeys(_column(r) for r in _by_column(rows)))
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        cells.setdefault((r["attack"], r["budget"]), {})[_column(r)] = _percent(r["evasion_rate"])
    body = [
        [attack, budget, *(cells[(attack, budget)].get(c, "-") for c in columns)]
        for attack, budget in sorted(cells)
    ]
    return ["Attack", "Budget", *(f"{c} (%)" for c in columns)], body


def part_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which part of an ensemble target flags the attacked images, start -> final (rows that
    record their ``parts``), as a table and its note; nothing without such rows."""
    with_parts = [r for r in rows if r.get("parts")]
    if not with_parts:
        return []
    names = list(dict.fromkeys(part for r in with_parts for part in r["parts"]))
    body = [
        [
            f"{MODEL_LABELS.get(r['model'], r['model'].upper())} {r['target']}",
            r["attack"],
            *(
                " → ".join(_percent(v) for v in r["parts"][part]) if part in r["parts"] else "-"
                for part in names
            ),
        ]
        for r in with_parts
    ]
    return [
        "Which part of the target flags the attacked images, each part alone at the target's "
        "threshold, start → final (%): the parts the attacker got past lose the most.",
        "",
        markdown_table(["Target", "Attack", *names], body, left=2),
        "",
    ]


def adaptive_section(results: Mapping[str, Any], run_dir: Path | None = None) -> list[str]:
    """'## Adaptive attacks': the comparison table (and its figure, with ``run_dir``), the full
    table and how to read them; nothing when no rows exist."""
    rows = list(results.get("adaptive", []))
    if not rows:
        return []
    header, matrix = evasion_matrix(rows)
    comparison = [
        "Evasion rate of each attack on each network's target, the single detector beside the "
        "pool drawn per query (item 2):",
        "",
        markdown_table(header, matrix, left=2),
        "",
    ]
    if run_dir is not None:
        figure = plot_adaptive_evasion(
            _by_column(rows), _column, RunDir(run_dir).figures / ADAPTIVE_FIGURE
        )
        caption = "Evasion rate per adaptive attack, network and target"
        comparison += figure_link(Path(run_dir), figure, caption)
    agreement = [
        f"{MODEL_LABELS.get(r['model'], r['model'])} {r['target']}: "
        f"{100 * r['surrogate_agreement']:.1f}%"
        for r in rows
        if r.get("surrogate_agreement") is not None
    ]
    lines = [
        "## Adaptive attacks",
        "",
        *comparison,
        markdown_table(HEADER, adaptive_rows(rows), left=4),
        "",
        NOTE,
        "",
        *part_table(rows),
    ]
    if agreement:
        unique = list(dict.fromkeys(agreement))
        lines += [
            "",
            "Surrogate agreement with its target on its training rows: " + ", ".join(unique) + ".",
        ]
    return [*lines, ""]
