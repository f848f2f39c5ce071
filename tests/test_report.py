"""The evaluation report, written from a small synthetic run directory (DESIGN.md §5 contract)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from detector.errors import ArtefactError
from training.reporting.report import (
    format_cell,
    markdown_table,
    set_label,
    timing_section,
    write_report,
)

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
        "successful_attack_detection_rate": min(1.0, accuracy + 0.015),
        "successful_attack_detection_rate_std": 0.002,
        "fpr_at_95_tpr": 0.1,
        "calibrated_tpr": accuracy - 0.01,
        "calibrated_tpr_std": 0.003,
        "runs": 5,
        "accuracy_std": std,
        "auroc_std": 0.001,
    }


# The shipped detector's description: today's keys, plus keys a later deployable.json may add
# (per-set rates on successful images, a group of OOD sets), which the report shows as found.
DEPLOYABLE = {
    "kind": "transport",
    "network": "lap",
    "train_attacks": ["fgm-eps0.1", "bim"],
    "calibration": {"threshold": 0.57, "target_fpr": 0.05, "achieved_fpr": 0.05, "n": 900},
    "heldout": {
        "fpr": 0.048,
        "n_clean": 1000,
        "fpr_correct": 0.0304,
        "fpr_misclassified": 0.25,
        "n_misclassified": 80,
        "flag_rate": {"fgm-eps0.1": 0.995, "bim": 0.9874, "fgm-eps0.03": 0.61},
        "n": {"fgm-eps0.1": 1000, "bim": 478, "fgm-eps0.03": 200},
        "successful_flag_rate": {"fgm-eps0.1": 0.998, "bim": 0.9912},
        "n_successful": {"fgm-eps0.1": 998},  # bim's count missing: no interval for it
        "ood": {"flag_rate": {"digits": 0.4125}, "n": {"digits": 1000}},
    },
    "split_seed": 0,
    "test_fraction": 0.1,
}
LEARNING_CURVES = {
    "cw": [
        {"pairs": n, "accuracy": a, "accuracy_std": 0.02, "auroc": a + 0.03, "runs": 5}
        for n, a in ((25, 0.55), (50, 0.58), (73, 0.6212))
    ],
    "deepfool": [{"pairs": 25, "accuracy": 0.52, "accuracy_std": 0.04, "runs": 5}],
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
        _row("vanilla", "nss", "fgm-eps0.1", "fgm-eps0.1", 0.9650, 0.0040),
        _row("lap", "nss", "bim", "bim", 0.9700, 0.0030),
        _row("lap", "nss", "fgm-eps0.1", "bim", 0.6000, 0.0200),
    ]
    # per-run accuracies (seed order) of two seen cells, for the paired comparison
    detection[0]["per_run"] = {"accuracy": [0.97, 0.975, 0.965, 0.98, 0.967]}  # LAP TR, FGM 0.1
    detection[2]["per_run"] = {"accuracy": [0.88, 0.87, 0.89, 0.88, 0.88]}  # LAP MH, FGM 0.1
    detection[3]["per_run"] = {"accuracy": [0.96, 0.95, 0.97, 0.96, 0.96]}  # LAP TR, BIM
    detection[8]["per_run"] = {"accuracy": [0.97, 0.96, 0.98, 0.97, 0.97]}  # LAP NS, BIM
    ood_rows = [
        {
            "model": m,
            "detector": "transport",
            "train_set": "cw",
            "test_set": "ood-digits",
            "accuracy": a,
            "auroc": 0.95,
            "tpr": tpr,
            "fpr": fpr,
            "fpr_at_95_tpr": 0.1,
            "runs": 5,
            "accuracy_std": 0.01,
        }
        for m, a, tpr, fpr in (("vanilla", 0.85, 0.8, 0.1), ("lap", 0.9, 1.0, 0.2))
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
        "learning_curves": {"lap": LEARNING_CURVES},
    }
    run = root / "run"
    (run / "models").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(results))
    not_run = [{"attack": "hsj", "reason": "not run on CPU presets; use a GPU preset"}]
    (run / "pipeline_config.json").write_text(
        json.dumps({"name": "quick", "dataset": "fashion-mnist", "not_run": not_run})
    )
    (run / "detector").mkdir()
    (run / "detector" / "deployable.json").write_text(json.dumps(DEPLOYABLE))
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
            ("vanilla", "nss", "seen", "fgm-eps0.1", "fgm-eps0.1"),
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
    slower = {"timing": {"feature_extraction_seconds": {"transport": 3.5, "mahalanobis": 2.1}}}
    assert "1.7x slower than Mahalanobis" in "\n".join(timing_section(slower))
    assert "cw → digits" in report.replace("CW", "cw")
    legend = next(line for line in report.splitlines() if line.startswith("Detectors: "))
    assert "**TR** (transport): random forests on the trajectory features" in legend
    assert "**MH** (mahalanobis)" in legend and "QT" not in legend  # the tables' detectors only
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


def test_the_ood_section_says_how_many_clean_images_each_detector_learned_from(
    tmp_path: Path,
) -> None:
    run = make_run(tmp_path)
    section = _section(write_report(run).read_text(), "Out-of-distribution")
    assert "and as many clean images drawn from the whole training side" in section
    config = json.loads((run / "pipeline_config.json").read_text())
    for ratio, says in (
        (4.0, "and up to 4 times as many clean images drawn from the whole training side"),
        (None, "and every clean image of the whole training side"),
    ):
        (run / "pipeline_config.json").write_text(json.dumps({**config, "ood_clean_ratio": ratio}))
        assert says in _section(write_report(run).read_text(), "Out-of-distribution")


def test_the_ood_section_shows_what_each_detector_flags_on_either_side_of_its_accuracy(
    tmp_path: Path,
) -> None:
    section = _section(write_report(make_run(tmp_path)).read_text(), "Out-of-distribution")
    flagged = "### Abnormal test images flagged at the detector's decision (%)"
    fpr = "### False positive rate on clean test images (%)"
    assert section.index("### Detection accuracy") < section.index(flagged) < section.index(fpr)

    # LAP flags every digit and 20% of clean images: (100 + 100 - 20) / 2 = 90, its accuracy
    def cell(label: str, table: str) -> str:
        return _table_row(section, label, table)[1].strip("*")  # the best is in bold

    assert (cell("LAP TR", flagged), cell("LAP TR", fpr)) == ("100.00", "20.00")
    assert (cell("VAN TR", flagged), cell("VAN TR", fpr)) == ("80.00", "10.00")
    assert "a test set flagged in full scores (200 − clean FPR) / 2" in section


def test_the_seen_section_names_what_learns_from_clean_images_only(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    assert "learns from clean images only" not in _section(
        write_report(run).read_text(), "Seen attacks"
    )  # TR, MH and NS all learn from the attack's pairs
    results = json.loads((run / "results.json").read_text())
    for detector in ("ensemble", "quantile"):
        results["detection"].append(_row("lap", detector, "bim", "bim", 0.9, 0.01))
    (run / "results.json").write_text(json.dumps(results))
    seen = _section(write_report(run).read_text(), "Seen attacks")
    assert "what learns from clean images only (QT, TR+NV's parts) learns from" in seen


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


def _section(report: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## `` heading."""
    start = report.index(f"## {title}")
    end = report.find("\n## ", start + 3)
    return report[start : end if end >= 0 else None]


def _table_row(text: str, label: str, after: str) -> list[str]:
    """The cells of the first table row starting with ``label`` after the line ``after``."""
    rest = text[text.index(after) :]
    line = next(ln for ln in rest.splitlines() if ln.startswith(f"| {label} "))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_transport_is_held_against_each_baseline_run_by_run(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seen = _section(write_report(run).read_text(), "Seen attacks")
    header = "| Network pair "
    assert re.search(r"\| Network pair \| +FGM ε=0\.1 \| +BIM \|", seen)
    # TR beats MH on every run by 9.14 points on average (paired t-test p 6e-5)
    assert _table_row(seen, "LAP TR − MH", header)[1:] == ["+9.14 · 5/5 · p < 0.01", ""]
    # NS beats TR by exactly one point on every run: no spread, so no t-test
    assert _table_row(seen, "LAP TR − NS", header)[1:] == ["", "-1.00 · 0/5 · p –"]
    assert "VAN TR − " not in seen  # VAN's records keep no runs: no pair to compare
    # a run written before the runs were kept has no such table
    results = json.loads((run / "results.json").read_text())
    for record in results["detection"]:
        record.pop("per_run", None)
    (run / "results.json").write_text(json.dumps(results))
    assert "against each baseline" not in write_report(run).read_text()


def test_security_view_has_seed_appendix_h_tables_with_ns_rows(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    report = write_report(run).read_text()
    security = _section(report, "Security view")
    for title in (
        "### Detection rate of successful adversarial images (%)",
        "### False positive rate on clean test images (%)",
        "### AUROC (%)",
        "### FPR at 95% TPR (%)",
    ):
        assert title in security
    successful = "### Detection rate of successful adversarial images (%)"
    # seen: columns FGM ε=0.03, FGM ε=0.1, BIM; LAP TR has 0.9714 + 0.015 on FGM ε=0.1
    row = _table_row(security, "LAP TR", successful)
    assert row[2] == "**98.64 ± 0.20**" and row[3] == "97.50 ± 0.20"
    assert _table_row(security, "LAP NS", successful)[3] == "**98.50 ± 0.20**"  # NS best on BIM
    assert _table_row(security, "VAN NS", successful)[2] == "98.00 ± 0.20"
    # unseen, trained on FGM ε=0.1: the BIM column and the mean column
    unseen = _table_row(security, "LAP NS", "Unseen attacks, trained on FGM ε=0.1 (seed table 39)")
    assert unseen[1:] == ["61.50 ± 0.20", "61.50"]
    # FPR: lower is better, so the best LAP TR (FPR 2.86%) is bold, VAN TR (4.99%) is not
    fpr = "### False positive rate on clean test images (%)"
    assert _table_row(security, "LAP TR", fpr)[2] == "**2.86**"
    assert _table_row(security, "VAN TR", fpr)[2] == "4.99"
    assert "Seen attacks (seed table 40):" in security
    assert "| VAN NS " in _section(report, "Seen attacks") and "roc_nss_seen.png" in report
    assert (run / "figures" / "roc_nss_seen.png").read_bytes()[:8] == PNG_MAGIC
    for table in _tables(security):
        assert len({len(line) for line in table}) == 1, table


def test_deployed_detector_rates_shown_with_every_key_found(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    deployed = _section(write_report(run).read_text(), "Deployed detector")
    assert "threshold 0.57" in deployed and "5.00% FPR on 900" in deployed
    assert "misclassifies 80: the detector flags 25.00% of those" in deployed
    assert "and 3.04% of the images it classifies right" in deployed
    header = "| Set "
    assert "successful flag rate (%)" in next(
        ln for ln in deployed.splitlines() if ln.startswith(header)
    )
    # each rate with its two-sided 95% Clopper-Pearson interval: 48 of 1000 -> 3.56-6.31%
    assert _table_row(deployed, "clean (FPR)", header)[1:5] == ["", "4.80", "1000", "3.56–6.31"]
    # set, trained on, flagged, n, interval, successful flag rate, n successful, interval,
    # seen protocol's calibrated TPR
    assert _table_row(deployed, "FGM ε=0.1", header)[1:] == [
        "yes",
        "99.50",
        "1000",
        "98.84–99.84",
        "99.80",
        "998",
        "99.28–99.98",
        "96.14 ± 0.30",
    ]
    assert _table_row(deployed, "BIM", header)[5:8] == ["99.12", "", ""]
    assert _table_row(deployed, "FGM ε=0.03", header)[1:] == [
        "no", "61.00", "200", "53.87–67.80", "", "", "", "",
    ]  # fmt: skip
    assert _table_row(deployed, "digits", header)[1:5] == ["no", "41.25", "1000", "38.13–44.32"]
    names = [ln.split("|")[1].strip() for ln in deployed.splitlines() if ln.startswith("| ")]
    assert names[2:] == ["clean (FPR)", "FGM ε=0.03", "FGM ε=0.1", "BIM", "digits"]
    assert "Warning" not in deployed


def test_deployed_rates_sent_as_png_are_columns_with_their_intervals(tmp_path: Path) -> None:
    """A deployable.json with PNG-client rates shows them as two more columns (rate, count,
    interval) and says what they are; a set without them gets empty cells."""
    run = make_run(tmp_path)
    info = json.loads((run / "detector" / "deployable.json").read_text())
    info["heldout"] |= {
        "png_successful_flag_rate": {"fgm-eps0.1": 0.99, "bim": None},
        "n_png_successful": {"fgm-eps0.1": 900, "bim": 0},
    }
    (run / "detector" / "deployable.json").write_text(json.dumps(info))
    deployed = _section(write_report(run).read_text(), "Deployed detector")
    header = "| Set "
    columns = [
        c.strip()
        for c in next(ln for ln in deployed.splitlines() if ln.startswith(header)).split("|")
    ]
    png = columns.index("successful, sent as PNG: flagged (%)")
    assert columns[png + 1 : png + 3] == ["n successful as PNG", "95% interval (%)"]
    # 891 of 900 -> 98.11-99.54%; the column index counts the leading empty cell
    assert _table_row(deployed, "FGM ε=0.1", header)[png - 1 : png + 2] == [
        "99.00",
        "900",
        "98.11–99.54",
    ]
    assert _table_row(deployed, "BIM", header)[png - 1 : png + 2] == ["", "0", ""]
    assert "Sent as PNG: each attack's held-out images rounded to 8 bits" in " ".join(
        deployed.split()
    )


def test_a_saturated_calibration_is_a_warning_in_the_report(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    info = json.loads((run / "detector" / "deployable.json").read_text())
    info["calibration"] |= {"threshold": 1.0, "saturated": True}
    (run / "detector" / "deployable.json").write_text(json.dumps(info))
    deployed = _section(write_report(run).read_text(), "Deployed detector")
    assert "**Warning: this threshold is the clean scores' maximum" in deployed


def test_the_deployed_section_names_every_source_of_calibration_images(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    info = json.loads((run / "detector" / "deployable.json").read_text())
    info["calibration_images"] = {"slice": 200, "fitting": 500, "validation": 200}
    (run / "detector" / "deployable.json").write_text(json.dumps(info))
    deployed = " ".join(_section(write_report(run).read_text(), "Deployed detector").split())
    assert (
        "on 900 clean images (200 of a held-out calibration slice, 200 of the network's own "
        "validation images, which it never learnt from, and 500 of the detector's own fitting "
        "images scored by the parts that never saw them" in deployed
    )
    assert "At that threshold it flags" not in deployed  # not recorded: not claimed
    # With the per-source rates recorded, the paragraph gives each beside the held-out FPR.
    info["calibration_fpr"] = {"slice": 0.05, "validation": 0.04, "fitting": 0.03}
    (run / "detector" / "deployable.json").write_text(json.dumps(info))
    deployed = " ".join(_section(write_report(run).read_text(), "Deployed detector").split())
    held_out = 100 * info["heldout"]["fpr"]
    assert (
        "At that threshold it flags 5.00% of the calibration slice, 4.00% of the network's "
        f"validation images, 3.00% of the detector's fitting images, and {held_out:.2f}% of the "
        "held-out clean images." in deployed
    )
    del info["calibration_fpr"]
    info["calibration_images"] = {"slice": 200, "fitting": 700, "validation": 0}
    (run / "detector" / "deployable.json").write_text(json.dumps(info))
    deployed = " ".join(_section(write_report(run).read_text(), "Deployed detector").split())
    assert "validation images" not in deployed and "slice and 700 of the detector's" in deployed
    # A detector without held-out scores of its own (no fitting images): slice and validation.
    info["calibration_images"] = {"slice": 200, "validation": 700}
    (run / "detector" / "deployable.json").write_text(json.dumps(info))
    deployed = " ".join(_section(write_report(run).read_text(), "Deployed detector").split())
    assert (
        "on 900 clean images (200 of a held-out calibration slice and 700 of the network's own "
        "validation images, which it never learnt from)" in deployed
    )


def test_learning_curves_table_and_figure(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    report = write_report(run).read_text()
    section = _section(report, "Learning curves")
    assert _table_row(section, "LAP CW", "| Network attack")[1:] == [
        "25",
        "55.00 ± 2.00",
        "58.00",
        "5",
    ]
    assert _table_row(section, "LAP DF", "| Network attack")[1:3] == ["25", "52.00 ± 4.00"]
    assert "62.12 ± 2.00" in section
    assert "figures/learning_curve.png" in _links(section)
    data = (run / "figures" / "learning_curve.png").read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_report_without_deployable_or_curves_leaves_those_sections_out(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "detector" / "deployable.json").unlink()
    results = json.loads((run / "results.json").read_text())
    del results["learning_curves"]
    (run / "results.json").write_text(json.dumps(results))
    report = write_report(run).read_text()
    assert "## Deployed detector" not in report and "## Learning curves" not in report
    assert "## Security view" in report


def test_a_damaged_deployable_leaves_its_sections_out_not_the_report(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    intact = write_report(run).read_text()
    assert "## Deployed detector: held-out flag rates" in intact
    (run / "detector" / "deployable.json").write_text('{"heldout": {"fpr": 0.0')  # cut short
    report = write_report(run).read_text()
    assert "## Deployed detector" not in report
    assert "## Security view" in report and "## Learning curves" in report
