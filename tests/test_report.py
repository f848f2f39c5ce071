"""The evaluation report, written from a small synthetic run directory (DESIGN.md §5 contract)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from detector.errors import ArtefactError
from training.report import format_cell, markdown_table, set_label, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCKS = 4
SHIFTS = {"clean": 1.0, "fgm-eps0.03": 1.5, "fgm-eps0.1": 3.0, "bim": 2.0, "ood-digits": 4.0}


def _features(rng: np.random.Generator, shift: float, n: int = 120) -> dict[str, np.ndarray]:
    """Block-major (msq_m, cos_m) columns plus one extra column, abnormal sets shifted up."""
    msq = rng.lognormal(mean=np.log(shift), sigma=0.2, size=(n, BLOCKS))
    cos = rng.normal(0.1 * shift, 0.05, size=(n, BLOCKS))
    columns = np.stack([msq, cos], axis=2).reshape(n, 2 * BLOCKS)
    features = np.concatenate([columns, rng.normal(size=(n, 1))], axis=1).astype(np.float32)
    names = np.array([f"{k}_{m}" for m in range(BLOCKS) for k in ("msq", "cos")] + ["line_shape"])
    return {
        "features": features,
        "logits": rng.normal(size=(n, 10)).astype(np.float32),
        "feature_names": names,
    }


def _scores(rng: np.random.Generator, n: int = 80) -> dict[str, np.ndarray]:
    truth = np.arange(n) % 2 == 1
    return {"is_abnormal": truth, "scores": (truth + rng.normal(0, 0.4, n)).astype(np.float32)}


def _row(model: str, detector: str, train: str, test: str, accuracy: float, std: float) -> dict:
    return {
        "model": model,
        "detector": detector,
        "setting": "seen" if train == test else "unseen",
        "train_attack": train,
        "test_attack": test,
        "accuracy": accuracy,
        "auroc": min(1.0, accuracy + 0.02),
        "tpr": accuracy,
        "fpr": 1 - accuracy,
        "successful_attack_detection_rate": accuracy,
        "fpr_at_95_tpr": 0.1,
        "runs": 5,
        "accuracy_std": std,
        "auroc_std": 0.001,
    }


def make_run(root: Path, *, ood: bool = True, scores: bool = True) -> Path:
    """A run directory: vanilla + LAP, transport + Mahalanobis (LAP only), seen/unseen/OOD rows."""
    rng = np.random.default_rng(0)
    attacks = ["fgm-eps0.03", "fgm-eps0.1", "bim"]
    detection = [
        _row("lap", "transport", "fgm-eps0.1", "fgm-eps0.1", 0.9714, 0.0059),
        _row("vanilla", "transport", "fgm-eps0.1", "fgm-eps0.1", 0.9501, 0.0100),
        _row("lap", "mahalanobis", "fgm-eps0.1", "fgm-eps0.1", 0.8800, 0.0200),
        _row("lap", "transport", "bim", "bim", 0.9600, 0.0040),
        _row("vanilla", "transport", "fgm-eps0.03", "fgm-eps0.03", 0.7800, 0.0300),
        _row("lap", "transport", "fgm-eps0.1", "bim", 0.9300, 0.0100),
        _row("lap", "mahalanobis", "fgm-eps0.1", "bim", 0.8100, 0.0100),
    ]
    ood_rows = [
        {
            "model": m,
            "detector": "transport",
            "train_set": "cw",
            "test_set": "ood-digits",
            "accuracy": a,
            "auroc": 0.95,
            "fpr_at_95_tpr": 0.1,
            "runs": 5,
            "accuracy_std": 0.01,
        }
        for m, a in (("vanilla", 0.85), ("lap", 0.9))
    ]
    results = {
        "preset": "quick",
        "dataset": "fashion-mnist",
        "models": {
            m: {"test_accuracy": 0.91, "epochs": 3, "train_seconds": 300.0}
            for m in ("vanilla", "lap")
        },
        "attacks": {
            m: {a: {"n": 100, "success_rate": 0.9, "seconds": 1.5, "eps": 0.1} for a in attacks}
            for m in ("vanilla", "lap")
        },
        "detection": detection,
        "ood": ood_rows if ood else [],
        "timing": {"feature_extraction_seconds": {"transport": 1.0, "mahalanobis": 6.0}},
    }
    run = root / "run"
    (run / "models").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(results))
    not_run = [{"attack": "hsj", "reason": "not run on CPU presets; use a GPU preset"}]
    (run / "pipeline_config.json").write_text(
        json.dumps({"name": "quick", "dataset": "fashion-mnist", "not_run": not_run})
    )
    for model in ("vanilla", "lap"):
        (run / "models" / model).mkdir()
        epochs = [
            {
                "epoch": e,
                "test_accuracy": 0.9,
                "test_transport": 8.0 / e,
                "lambda": 1.0,
                "epoch_seconds": 9.0,
            }
            for e in (1, 2)
        ]
        (run / "models" / model / "metrics.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in epochs)
        )
        (run / "features" / model).mkdir(parents=True)
        for name, shift in SHIFTS.items():
            np.savez(
                run / "features" / model / f"{name}.npz",
                **_features(rng, shift if model == "lap" else shift**0.5),
            )
    if scores:
        for model, detector, setting, train, test in [
            ("vanilla", "transport", "seen", "fgm-eps0.1", "fgm-eps0.1"),
            ("lap", "transport", "seen", "fgm-eps0.1", "fgm-eps0.1"),
            ("lap", "transport", "seen", "bim", "bim"),
            ("lap", "mahalanobis", "seen", "fgm-eps0.1", "fgm-eps0.1"),
            ("lap", "transport", "unseen", "fgm-eps0.1", "bim"),
            ("lap", "transport", "ood", "cw", "ood-digits"),
        ]:
            folder = run / "scores" / model / detector / setting
            folder.mkdir(parents=True, exist_ok=True)
            np.savez(folder / f"{train}__{test}.npz", **_scores(rng))
    return run


def _links(report: str) -> list[str]:
    return re.findall(r"\]\(([^)]+\.png)\)", report)


def _tables(report: str) -> list[list[str]]:
    blocks: list[list[str]] = [[]]
    for line in report.splitlines():
        if line.startswith("|"):
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    return [b for b in blocks if b]


def test_report_has_seed_layout_tables_and_valid_figures(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    path = write_report(run)
    report = path.read_text()
    assert path == run / "report.md"
    for label in ("VAN TR", "LAP TR", "VAN MH", "LAP MH"):
        assert f"| {label} " in report
    assert "**97.14 ± 0.59**" in report  # best LAP cell of the FGM ε=0.1 seen column
    assert "95.01 ± 1.00" in report and "88.00 ± 2.00" in report
    assert "FGM ε=0.03" in report and "FGM ε=0.1" in report
    assert "not run" in report  # e.g. VAN MH never ran
    assert "HSJ**: not run: not run on CPU presets; use a GPU preset" in report
    assert "6.0x faster" in report
    assert "cw → digits" in report.replace("CW", "cw")
    for table in _tables(report):
        assert len({len(line) for line in table}) == 1, table  # aligned pipes
    links = _links(report)
    names = {Path(link).name for link in links}
    assert {
        "roc_transport_seen.png",
        "roc_transport_ood.png",
        "transport_hist_attacks.png",
        "transport_hist_ood.png",
        "trajectories_attacks.png",
    } <= names
    for link in links:
        if "training_curve" in link:
            continue
        data = (run / link).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, link


def test_report_tolerates_no_ood_rows_and_no_scores(tmp_path: Path) -> None:
    run = make_run(tmp_path, ood=False, scores=False)
    report = write_report(run).read_text()
    assert "OOD protocol: not run." in report
    assert "roc_" not in report
    assert "no detector scores in scores/vanilla/" in report
    for link in _links(report):
        assert (run / link).read_bytes()[:8] == PNG_MAGIC


def test_report_without_results_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(ArtefactError, match="lapguard evaluate"):
        write_report(tmp_path)


@pytest.mark.parametrize(
    ("key", "label"),
    [("fgm-eps0.03", "FGM ε=0.03"), ("deepfool", "DF"), ("ood-noise", "noise"), ("bim", "BIM")],
)
def test_set_labels(key: str, label: str) -> None:
    assert set_label(key) == label


def test_cells_and_tables() -> None:
    assert format_cell({"accuracy": 0.9714, "accuracy_std": 0.0059}, "accuracy") == "97.14 ± 0.59"
    assert format_cell({"accuracy": 0.5}, "accuracy") == "50.00"
    assert format_cell(None, "accuracy") == "not run"
    lines = markdown_table(["a", "bb"], [["x", "1.0"], ["yyyy", "10.25"]]).splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[1].endswith(": |")
