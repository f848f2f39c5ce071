"""The report's section on the deployed detector's operating points (``deployable.json``'s
'operating_points', :data:`training.evaluation.deployable.OPERATING_FPRS`): the same detector and clean
calibration scores at every target FPR the bundle offers, what each costs in held-out clean
images and what it flags, as a table and ``figures/operating_points.png``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.evaluation.deployable import is_offered
from training.plots import plot_operating_points
from training.reporting.tables import OOD_PREFIX, figure_link, markdown_table, order_sets, set_label
from training.rundir import OPERATING_POINTS_FIGURE, RunDir

NOTE = (
    "The shipped detector and its calibration's clean scores, calibrated again at each target "
    "false-positive rate the bundle offers (with the same confidence bound). Nothing is refitted: "
    "an operator who wants fewer false alarms serves another point with `lapguard serve "
    "--target-fpr T` (or scores with `lapguard score --target-fpr T`) and gets the rates of its "
    "row. Attacks: the share of their successful held-out images flagged; OOD sets: of all their "
    "images; clean: the held-out clean images flagged. Measured by the Guard on the held-out side "
    "(split seed {seed}); the test side chose nothing. A saturated point (its threshold is the "
    "clean scores' maximum: too few of them, or ties there) would flag almost nothing and is not "
    "offered, unless it is the bundle's own target (the threshold it serves by default)."
)


def operating_points_section(run_dir: Path, info: Mapping[str, Any] | None) -> list[str]:
    """The table and figure (in ``run_dir``'s figures) of the deployed detector's operating
    points; [] when ``info`` (the run's deployable.json) has none."""
    points = [p for p in (info or {}).get("operating_points", []) if _usable(p)]
    if info is None or not points:
        return []
    served = (info.get("calibration") or {}).get("target_fpr")
    sets = _sets(points[0]["heldout"])
    header = ["target FPR (%)", "threshold", "clean (FPR, %)"]
    header += [f"{set_label(key)} (%)" for key in sets]
    offered = [p for p in points if is_offered(p["calibration"], served)]
    rows = [_row(point, sets, served, offered=point in offered) for point in points]
    lines = [
        "## Deployed detector: its operating points",
        "",
        NOTE.format(seed=info.get("split_seed", "?")),
        "",
        markdown_table(header, rows, left=1),
        "",
    ]
    figure = plot_operating_points(
        {set_label(key): _curve(offered, key) for key in sets},
        RunDir(run_dir).figures / OPERATING_POINTS_FIGURE,
        served=_served_fpr(points, served),
        title="Deployed detector: what each offered operating point flags",
    )
    return lines + figure_link(run_dir, figure, "The deployed detector at each operating point")


def _usable(point: Any) -> bool:
    return (
        isinstance(point, Mapping)
        and isinstance(point.get("calibration"), Mapping)
        and isinstance(point.get("heldout"), Mapping)
    )


def _sets(heldout: Mapping[str, Any]) -> list[str]:
    """The attacks (successful images) and the OOD sets of a held-out block, in report order."""
    attacks = list(heldout.get("successful_flag_rate", {}))
    ood = [k for k in heldout.get("flag_rate", {}) if k.startswith(OOD_PREFIX)]
    return order_sets([*attacks, *ood])


def _rate(heldout: Mapping[str, Any], key: str) -> float | None:
    column = "flag_rate" if key.startswith(OOD_PREFIX) else "successful_flag_rate"
    value = heldout.get(column, {}).get(key)
    return float(value) if isinstance(value, int | float) else None


def _row(
    point: Mapping[str, Any], sets: Sequence[str], served: float | None, *, offered: bool
) -> list[str]:
    calibration, heldout = point["calibration"], point["heldout"]
    target = calibration.get("target_fpr")
    label = f"{100 * target:g}" if isinstance(target, int | float) else "?"
    if target == served:
        label += " (served by default)"
    if calibration.get("saturated"):
        label += " (saturated)" if offered else " (saturated, not offered)"
    threshold = calibration.get("threshold")
    cells = [_cell(heldout.get("fpr")), *(_cell(_rate(heldout, key)) for key in sets)]
    return [label, f"{threshold:.4g}" if isinstance(threshold, int | float) else "", *cells]


def _cell(value: Any) -> str:
    return f"{100 * value:.2f}" if isinstance(value, int | float) else ""


def _curve(points: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(held-out clean FPR, the set's rate) at each point that has both."""
    pairs = [(p["heldout"].get("fpr"), _rate(p["heldout"], key)) for p in points]
    kept = [(f, r) for f, r in pairs if isinstance(f, int | float) and r is not None]
    return [f for f, _ in kept], [r for _, r in kept]


def _served_fpr(points: Sequence[Mapping[str, Any]], served: float | None) -> float | None:
    for point in points:
        if point["calibration"].get("target_fpr") == served:
            fpr = point["heldout"].get("fpr")
            return float(fpr) if isinstance(fpr, int | float) else None
    return None
