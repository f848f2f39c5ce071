"""The report's operating-point section says "offered" of exactly the points the bundle ships."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.evaluation.deployable import offered_points
from training.reporting.operating_points import operating_points_section


def _point(target: float, threshold: float, fpr: float, saturated: bool) -> dict:
    calibration = {
        "threshold": threshold,
        "target_fpr": target,
        "achieved_fpr": min(target, fpr),
        "n": 40,
        "saturated": saturated,
    }
    heldout = {
        "fpr": fpr,
        "flag_rate": {"ood-noise": 1.0},
        "successful_flag_rate": {"fgm-eps0.1": 0.9 - fpr},
    }
    return {"calibration": calibration, "heldout": heldout}


def _run(tmp_path: Path, own: float) -> tuple[Path, dict]:
    """A run whose deployable.json has the 1% and 2% points saturated (too few clean images)."""
    points = [
        _point(0.01, 0.99, 0.0, saturated=True),
        _point(0.02, 0.99, 0.0, saturated=True),
        _point(0.05, 0.7, 0.05, saturated=False),
        _point(0.1, 0.5, 0.1, saturated=False),
    ]
    info = {
        "split_seed": 0,
        "calibration": next(
            p["calibration"] for p in points if p["calibration"]["target_fpr"] == own
        ),
        "operating_points": points,
    }
    (tmp_path / "detector").mkdir()
    (tmp_path / "detector" / "deployable.json").write_text(json.dumps(info))
    return tmp_path, info


def _labels(section: list[str]) -> list[str]:
    lines = "\n".join(section).splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith(("| target", "| -"))]
    return [row.strip("|").split("|")[0].strip() for row in rows]


@pytest.mark.parametrize(
    ("own", "expected"),
    [
        (0.02, ["1 (saturated, not offered)", "2 (served by default) (saturated)", "5", "10"]),
        (
            0.05,
            [
                "1 (saturated, not offered)",
                "2 (saturated, not offered)",
                "5 (served by default)",
                "10",
            ],
        ),
    ],
)
def test_the_report_offers_the_points_the_bundle_ships(
    tmp_path: Path, own: float, expected: list[str]
) -> None:
    """A saturated point is offered only when it is the bundle's own target, in the report's
    table as in the manifest (:func:`offered_points`)."""
    run, info = _run(tmp_path, own=own)
    labels = _labels(operating_points_section(run, info))
    assert labels == expected
    in_report = [float(label.split()[0]) / 100 for label in labels if "not offered" not in label]
    assert in_report == [p.target_fpr for p in offered_points(info)]
    assert (run / "figures" / "operating_points.png").read_bytes()[:4] == b"\x89PNG"
