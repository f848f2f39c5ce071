"""The seeds' claims: each rule judged on diagnostics with a known verdict, and the preset run."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.cli.main import main as cli_main
from training.diagnostics import claims
from training.diagnostics.diagnose import run_diagnose_preset
from training.presets.pipelines import DiagnoseConfig, get_diagnose_preset


def _net(w: list[float], lss: float, ots: float, confused: float = 0.02) -> dict:
    clean = {
        "w_layers": w,
        "lss": {"mean": lss},
        "ots_network": [ots],
        "ots_block": [ots, None],
        "confused_fraction": confused,
    }
    return {"sets": {"clean": clean}}


def _rows(accuracy: float, w: list[list[float]], ics: list[list[float] | None]) -> list[dict]:
    return [
        {"test_accuracy": accuracy, "monitor_w_layers": a, "monitor_ics": b}
        for a, b in zip(w, ics, strict=True)
    ]


DIAGNOSTICS = {
    "networks": {
        "resnet": _net([0.5, 0.3, 0.1], 1.2, 1.0),
        "lap": _net([0.5, 0.4, 0.1], 1.1, 1.0),
        "plain": _net([0.2, 0.5, 0.3], 3.0, 0.2, confused=0.0),
        "unit": _net([0.6, 0.3, 0.2], 1.4, 0.9),
    }
}
METRICS = {
    "resnet": _rows(0.90, [[0.6, 0.5, 0.4], [0.5, 0.3, 0.1]], [[5.0, 9.0], [2.0, 3.0]]),
    "lap": _rows(0.91, [[0.6, 0.5, 0.4], [0.5, 0.4, 0.1]], [[4.0, 4.0], [1.0, 1.0]]),
    "plain": _rows(0.80, [[0.6, 0.5, 0.4], [0.7, 0.6, 0.5]], [[7.0, 7.0], [6.0, 6.0]]),
    "unit": _rows(0.89, [[0.6, 0.5, 0.4], [0.6, 0.3, 0.2]], [[3.0, 4.0], [1.0, 1.0]]),
}


def _verdicts() -> dict[str, bool]:
    return {row["claim"]: row["holds"] for row in claims.measure_claims(DIAGNOSTICS, METRICS)}


def test_each_claim_gets_the_verdict_its_rule_gives() -> None:
    verdicts = _verdicts()
    assert len(verdicts) == len(claims.CLAIMS)
    # plain's W rises at its last layer (rho 0.5 > 0): the depth claim fails for the set.
    assert verdicts["W-distance to the target decreases with depth (clean test images)"] is False
    # 8 of 12 (network, layer) pairs drop (plain's three rise, unit's first stays): 67% < 75%.
    assert (
        verdicts["Each layer's W-distance decreases along training (first vs last epoch)"] is False
    )
    assert verdicts["A deeper layer is not always better for some samples"] is False  # plain 0%
    assert verdicts["Data tracks of residual networks are close to line-shaped"] is True
    assert verdicts["A ResNet's map is closer to the OT map than a plain network's"] is True
    assert verdicts["LSS and OTS track performance across networks"] is True
    assert verdicts["Unitization bounds the ICS (EM distance between epochs) where BN does not"]
    assert verdicts["Unitization trains at least as well as BN"] is False  # 89% < 90%
    assert verdicts["LAP training gives straighter tracks at no cost in accuracy"] is True


def test_claims_without_their_networks_are_left_out() -> None:
    only = {"networks": {"resnet": DIAGNOSTICS["networks"]["resnet"]}}
    rows = claims.measure_claims(only, {"resnet": METRICS["resnet"]})
    assert [r["seed"] for r in rows] == ["000", "000", "000", "001/002"]
    assert all(set(r) == {"claim", "seed", "measured", "holds", "rule"} for r in rows)


def test_the_diagnose_preset_names_registered_training_presets() -> None:
    from training.presets import get_train_preset

    config = get_diagnose_preset("diagnose")
    assert set(config.models) == {"resnet", "lap", "plain", "unit"}
    trained = {role: get_train_preset(p) for role, p in config.models.items()}
    assert trained["plain"].arguments == {"skip": False}
    assert trained["unit"].arguments == {"norm": "unit"} and trained["lap"].objective == "lap"
    assert all(t.monitors is not None for t in trained.values())


@pytest.mark.slow
def test_a_tiny_preset_trains_diagnoses_and_measures_claims(
    tmp_path: Path, data_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = DiagnoseConfig(
        name="tiny",
        models={"resnet": "smoke-vanilla", "lap": "smoke-lap"},
        n=50,
        probe_n=200,
        ots_n=30,
        device="cpu",
    )
    result = run_diagnose_preset(config, tmp_path / "run", root=data_root, progress=False)
    assert set(result["networks"]) == {"resnet", "lap"}
    # smoke presets have no monitors: the along-training claim is left out
    assert [c["seed"] for c in result["claims"]] == ["000", "000", "001/002", "003"]
    other = config.model_copy(update={"n": 40})
    with pytest.raises(Exception, match="another diagnose config"):
        run_diagnose_preset(other, tmp_path / "run", root=data_root, progress=False)
    assert cli_main(["diagnose", "--preset", "nope", "--run", str(tmp_path / "x")]) == 2
