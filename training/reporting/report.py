"""The evaluation report of a run: ``RUN/report.md`` and ``RUN/figures/*.png``.

Reads only the run directory's files (DESIGN.md §5; paths from training/rundir.py)::
    pipeline_config.json                     preset name, data set, optional "not_run" attacks
    results.json                             models, attacks, detection and OOD rows, learning
                                             curves, timing
    detector/deployable.json                 the shipped detector's held-out flag rates
    models/<model>/                          per-epoch training metrics (final transport cost)
    features/<model>/<set>.npz               features [N, 2M] (+ feature_names), logits
    scores/<model>/<detector>/<setting>/<train>__<test>.npz   is_abnormal, scores (first seed)

Tables follow seed 003 tables 12–15: rows "<NETWORK> <DETECTOR>" (e.g. "VAN TR", "LAP MH"),
columns the attacks or data sets, cells "mean ± std" in percent over the protocol's runs, the best
cell of each column in bold; the security view follows seed appendix H.4–H.6 (tables 38–43).
Pieces that a run does not have are reported as "not run" or left out.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from scipy import stats

from detector import __version__, artefacts
from detector.calibration import rate_interval
from detector.errors import ArtefactError
from training.data.synthetic_outliers import SYNTHETIC_OOD
from training.diagnostics.diagnose import (
    CLAIMS_HEADER,
    SUMMARY_HEADER,
    claim_rows,
    summary_rows,
)
from training.plots import (
    plot_feature_trajectories,
    plot_learning_curves,
    plot_roc_curves,
    plot_transport_histograms,
)
from training.reporting.adaptive import adaptive_section
from training.reporting.feature_selection import feature_selection_section
from training.reporting.operating_points import operating_points_section
from training.reporting.tables import (
    CLEAN,
    MODEL_LABELS,
    NOT_RUN,
    OOD_PREFIX,
    Record,
    detector_label,
    detector_legend,
    figure_link,
    final_transport,
    format_cell,
    load_features,
    load_scores,
    markdown_table,
    metric_table,
    order_detectors,
    order_models,
    order_sets,
    percent,
    read_json_or_empty,
    read_optional_json,
    registered_detector,
    row_label,
    set_label,
    set_rank,
)
from training.rundir import (
    ATTACKS_FIGURE,
    LEARNING_CURVE_FIGURE,
    NETWORKS_FIGURE,
    RunDir,
)
from training.timings import grouped_minutes, read_timings, step_seconds

# ---- sections ---------------------------------------------------------------------------------


def _machine(results: Mapping[str, Any]) -> str:
    """The machine named in results.json, else the one writing this report."""
    if results.get("machine"):
        machine = results["machine"]
        return (
            machine
            if isinstance(machine, str)
            else ", ".join(f"{k}: {v}" for k, v in machine.items())
        )

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return f"CPU: {cpu} ({os.cpu_count()} cores), GPU: {gpu}, torch {torch.__version__} (the machine writing this report)"


def header_section(config: Mapping[str, Any], results: Mapping[str, Any]) -> list[str]:
    preset = results.get("preset") or config.get("name", "?")
    dataset = results.get("dataset") or config.get("dataset", "?")
    rows = [
        ["preset", str(preset)],
        ["dataset", str(dataset)],
        ["date", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")],
        ["lapguard", __version__],
        ["machine", _machine(results)],
    ]
    return [
        f"# lapguard evaluation report: {preset} on {dataset}",
        "",
        markdown_table(["Run", ""], rows, left=2),
        "",
    ]


def models_section(run_dir: Path, results: Mapping[str, Any], models: Sequence[str]) -> list[str]:
    rows = []
    for model in models:
        info = results.get("models", {}).get(model, {})
        accuracy, transport = info.get("test_accuracy"), final_transport(run_dir, model)
        rows.append(
            [
                f"{MODEL_LABELS.get(model, model.upper())} ({model})",
                percent(accuracy) if accuracy is not None else NOT_RUN,
                "imported" if "source" in info else str(info.get("epochs", "")),
                f"{info['train_seconds']:.0f}" if info.get("train_seconds") is not None else "",
                f"{transport:.4g}" if transport is not None else "",
            ]
        )
    header = ["Network", "Test accuracy (%)", "Epochs", "Train seconds", "Final transport cost C"]
    curve_files = {m: RunDir(run_dir).model_dir(m).training_curve for m in models}
    curves = [
        f"[{MODEL_LABELS.get(m, m.upper())}]({path.relative_to(run_dir).as_posix()})"
        for m, path in curve_files.items()
        if path.is_file()
    ]
    lines = ["## Networks", "", markdown_table(header, rows), ""]
    return lines + ([f"Training curves: {', '.join(curves)}.", ""] if curves else [])


def attacks_section(results: Mapping[str, Any], models: Sequence[str]) -> list[str]:
    attacks = results.get("attacks", {})
    keys = order_sets(k for m in models for k in attacks.get(m, {}))
    if not keys:
        return ["## Attacks", "", "No attacks in results.json.", ""]
    header = ["Attack"]
    for model in models:
        label = MODEL_LABELS.get(model, model.upper())
        header += [
            f"{label} n",
            f"{label} unperturbed",
            f"{label} success (%)",
            f"{label} s/image",
        ]
    rows = []
    for key in keys:
        row = [set_label(key)]
        for model in models:
            info = attacks.get(model, {}).get(key)
            if info is None:
                row += [NOT_RUN, "", "", ""]
                continue
            n = int(info.get("n", 0))
            seconds = info.get("seconds")
            row += [
                str(n),
                str(info["unperturbed"]) if info.get("unperturbed") is not None else "n/a",
                percent(info["success_rate"]) if info.get("success_rate") is not None else "n/a",
                f"{seconds / n:.3g}" if seconds is not None and n else "n/a",
            ]
        rows.append(row)
    note = (
        "Success rate: share of attacked images whose prediction the attack changed (as the "
        "attack step reports it). Unperturbed: images the attack returned unchanged (APGD and CW "
        "skip images the network already misclassifies); they are clean images, so the "
        "detection sets leave them out."
    )
    return ["## Attacks", "", markdown_table(header, rows), "", note, ""]


def _runs_note(records: Sequence[Record]) -> str:
    runs = sorted({int(r["runs"]) for r in records if r.get("runs") is not None})
    return f"mean ± std over {'/'.join(map(str, runs))} runs" if runs else "single run"


class Metric(NamedTuple):
    """A metric of the protocol rows: its key, its direction and the tables' title."""

    key: str
    higher_is_better: bool
    title: str
    seed_tables: tuple[str, str] | None = None  # seed 003's (seen, unseen) tables of it


ACCURACY = Metric("accuracy", True, "Detection accuracy (%) on a balanced test set")
AUROC = Metric("auroc", True, "AUROC (%)", ("42", "43"))
SUCCESSFUL = Metric(
    "successful_attack_detection_rate",
    True,
    "Detection rate of successful adversarial images (%)",
    ("38", "39"),
)
FPR = Metric("fpr", False, "False positive rate on clean test images (%)", ("40", "41"))
FPR_AT_95_TPR = Metric("fpr_at_95_tpr", False, "FPR at 95% TPR (%)")
OOD_FLAGGED = Metric("tpr", True, "Abnormal test images flagged at the detector's decision (%)")
SECURITY_METRICS = (SUCCESSFUL, FPR, AUROC, FPR_AT_95_TPR)


def _attack_table(
    records: Sequence[Record], rows: Sequence[tuple[str, str]], metric: Metric, *, mean: bool
) -> list[str]:
    """Rows x test attacks of one metric, best per column bold (and a mean column), then a blank."""
    table = metric_table(
        records,
        rows=rows,
        columns=order_sets(r["test_attack"] for r in records),
        column_of=lambda r: r["test_attack"],
        metric=metric.key,
        higher_is_better=metric.higher_is_better,
        mean_column=mean,
    )
    return [table, ""]


def _by_train_attack(records: Sequence[Record]) -> list[tuple[str, list[Record]]]:
    """The records grouped by training attack, in report order."""
    trains = order_sets(r["train_attack"] for r in records)
    return [(t, [r for r in records if r["train_attack"] == t]) for t in trains]


def seen_section(records: Sequence[Record], rows: Sequence[tuple[str, str]]) -> list[str]:
    lines = ["## Seen attacks (seed table 12)", ""]
    if not records:
        return lines + [f"Seen-attack protocol: {NOT_RUN}.", ""]
    names = order_detectors(r["detector"] for r in records)
    clean_only = [  # clean-only detectors (the registry's), then the ensemble's clean-only parts
        detector_label(n) for n in names if not getattr(registered_detector(n), "supervised", True)
    ] + [f"{detector_label(n)}'s parts" for n in names if n == "ensemble"]
    learns = (
        f" The forests learn from the attack's pairs (each attacked image and its clean "
        f"source); what learns from clean images only ({', '.join(clean_only)}) learns from "
        "every clean image of the training side."
        if clean_only
        else ""
    )
    lines += [
        f"{ACCURACY.title}: train and test on the same attack; {_runs_note(records)}; best per "
        "column in bold; each detector at its own decision. The other metrics, and which "
        f"decision each detector takes, are in the security view below.{learns}",
        "",
    ]
    return (
        lines + _attack_table(records, rows, ACCURACY, mean=False) + paired_section(records, rows)
    )


PAIRED_SUBJECT = "transport"  # the seed's detector, held against each baseline run by run
_NOT_BASELINES = (PAIRED_SUBJECT, "ensemble")  # the ensemble holds the transport forests


def _paired_cell(subject: Sequence[float] | None, baseline: Sequence[float] | None) -> str:
    """'+0.52 · 4/5 · p 0.03': the subject's accuracy minus the baseline's (points), mean over
    runs, the runs the subject wins and the two-sided paired t-test's p ('–' when every run
    differs by the same amount); '' unless both have the same runs."""
    if subject is None or baseline is None or len(subject) != len(baseline) or len(subject) < 2:
        return ""
    difference = 100 * (np.asarray(subject, float) - np.asarray(baseline, float))
    wins = f"{int(np.sum(difference > 0))}/{len(difference)}"
    spread = float(np.std(difference))
    p = float(stats.ttest_rel(subject, baseline).pvalue) if spread > 0 else None
    test = "p –" if p is None else ("p < 0.01" if p < 0.01 else f"p {p:.2f}")
    return f"{difference.mean():+.2f} · {wins} · {test}"


def paired_section(records: Sequence[Record], rows: Sequence[tuple[str, str]]) -> list[str]:
    """The transport detector against each baseline on the seen protocol, run by run: run i of
    every detector is tested on seed i's split, so the differences are paired. Records
    without per-run accuracies (runs before they were kept) leave it out."""
    runs = {
        (r["model"], r["detector"], r["test_attack"]): r["per_run"]["accuracy"]
        for r in records
        if "accuracy" in (r.get("per_run") or {})
    }
    attacks = order_sets({attack for _, _, attack in runs})
    table = []
    for model, detector in rows:
        if detector in _NOT_BASELINES:
            continue
        cells = [
            _paired_cell(runs.get((model, PAIRED_SUBJECT, a)), runs.get((model, detector, a)))
            for a in attacks
        ]
        if any(cells):
            label = f"{row_label(model, PAIRED_SUBJECT)} − {detector_label(detector)}"
            table.append([label, *cells])
    if not table:
        return []
    return [
        f"### {detector_label(PAIRED_SUBJECT)} against each baseline, run by run",
        "",
        f"Accuracy of {detector_label(PAIRED_SUBJECT)} minus the baseline's, in points: the mean "
        "over runs · the runs it wins · the two-sided paired t-test's p (run i of every "
        "detector is tested on seed i's split). A large p is a tie at this many runs.",
        "",
        markdown_table(["Network pair", *(set_label(a) for a in attacks)], table),
        "",
    ]


def unseen_section(records: Sequence[Record], rows: Sequence[tuple[str, str]]) -> list[str]:
    lines = ["## Unseen attacks (seed table 13)", ""]
    if not records:
        return lines + [f"Unseen-attack protocol: {NOT_RUN}.", ""]
    lines += [
        f"{ACCURACY.title}: train on one attack, test on the others; {_runs_note(records)}; "
        "each detector at its own decision (a forest's is learnt on the attack it was trained "
        "on); the last column averages over the test attacks (k/n when some are missing).",
        "",
    ]
    for train, subset in _by_train_attack(records):
        lines += [f"### Trained on {set_label(train)}", ""]
        lines += _attack_table(subset, rows, ACCURACY, mean=True)
    return lines


def _seed_table(metric: Metric, setting: int) -> str:
    return f" (seed table {metric.seed_tables[setting]})" if metric.seed_tables else ""


def security_section(detection: Sequence[Record], rows: Sequence[tuple[str, str]]) -> list[str]:
    """Seed appendix H.4–H.6 per metric: seen attacks, then unseen attacks per training attack."""
    seen = [r for r in detection if r["setting"] == "seen"]
    unseen = [r for r in detection if r["setting"] == "unseen"]
    metrics = [m for m in SECURITY_METRICS if any(r.get(m.key) is not None for r in detection)]
    if not metrics:
        return []
    lines = [
        "## Security view (seed appendix H.4–H.6)",
        "",
        "Per attack: the share of *successful* adversarial test images (those the network "
        "misclassifies) that the detector flags, the share of clean test images it flags (FPR), "
        "both at the detector's own decision (TR, MH and NS: the best balanced accuracy of "
        "their forests' out-of-bag votes on the training rows; TR+NV: 0.5; NV and QT: the threshold "
        "calibrated on held-out clean images), the AUROC over all thresholds, and the FPR at "
        f"the threshold that flags 95% of the attacked images; {_runs_note(detection)}; best "
        "per column in bold (lowest for the FPRs).",
        "",
    ]
    for metric in metrics:
        lines += [f"### {metric.title}", ""]
        if seen:
            lines += [f"Seen attacks{_seed_table(metric, 0)}:", ""]
            lines += _attack_table(seen, rows, metric, mean=False)
        for train, subset in _by_train_attack(unseen):
            lines += [f"Unseen attacks, trained on {set_label(train)}{_seed_table(metric, 1)}:", ""]
            lines += _attack_table(subset, rows, metric, mean=True)
    return lines


def ood_section(
    records: Sequence[Record], rows: Sequence[tuple[str, str]], clean_ratio: float | None = 1.0
) -> list[str]:
    """The OOD protocol's tables; ``clean_ratio``: up to how many clean training images per
    abnormal one (the run's ``ood_clean_ratio``; None: every one)."""
    lines = ["## Out-of-distribution (seed tables 14–15)", ""]
    if not records:
        return lines + [f"OOD protocol: {NOT_RUN}.", ""]
    pairs = sorted(
        {(r["train_set"], r["test_set"]) for r in records},
        key=lambda p: (set_rank(p[0]), set_rank(p[1])),
    )
    columns = [f"{tr}__{te}" for tr, te in pairs]
    labels = [
        f"{set_label(tr)} → {set_label(te)}{' (seen)' if tr == te else ''}" for tr, te in pairs
    ]
    if clean_ratio is None:
        clean = "every clean image of"
    elif clean_ratio == 1:
        clean = "as many clean images drawn from"
    else:
        clean = f"up to {clean_ratio:g} times as many clean images drawn from"
    lines += [
        f"Train against one abnormal set (left of →) and {clean} the whole"
        " training side, test on another (right) against as many clean test images; "
        f"{_runs_note(records)}. The accuracy at a detector's decision is (flagged + 100 − clean "
        "FPR) / 2, from the two tables after it: a test set flagged in full scores (200 − clean "
        "FPR) / 2.",
        "",
    ]
    if any(r["train_set"] == SYNTHETIC_OOD for r in records):
        lines += [
            f"{set_label(SYNTHETIC_OOD)}: the seed's experiment that trains on another "
            "distribution than the one it tests (seed 003 §5.4.4, experiment 1): outliers made "
            "from the network's own validation images, which no detector split holds (rotated "
            "90°, upside down, inverted, tiles shuffled, zoomed, shrunk).",
            "",
        ]
    for metric in (ACCURACY, OOD_FLAGGED, FPR, AUROC, FPR_AT_95_TPR):
        if any(r.get(metric.key) is not None for r in records):
            table = metric_table(
                records,
                rows=rows,
                columns=columns,
                labels=labels,
                metric=metric.key,
                higher_is_better=metric.higher_is_better,
                column_of=lambda r: f"{r['train_set']}__{r['test_set']}",
            )
            lines += [f"### {metric.title}", "", table, ""]
    return lines


# ---- the shipped detector and the learning curves ----------------------------------------------

_HELDOUT_COLUMNS = {
    "flag_rate": "flagged (%)",
    "n": "n",
    "png_successful_flag_rate": "successful, sent as PNG: flagged (%)",
    "n_png_successful": "n successful as PNG",
}
# each rate column of the held-out table and its count column: an interval column follows the count
_RATE_COUNTS = {
    "flag_rate": "n",
    "successful_flag_rate": "n_successful",
    "png_successful_flag_rate": "n_png_successful",
}
INTERVAL_CONFIDENCE = 0.95


def _is_count(key: str) -> bool:
    return key == "n" or key.startswith("n_") or key.endswith("_n")


def _set_mappings(block: Mapping[str, Any], group: str = "") -> Iterable[tuple[str, str, Any]]:
    """(group, column, {set: number}) for every set-keyed mapping of a ``heldout`` block;
    a mapping of such mappings (e.g. ``"ood": {"flag_rate": {...}, "n": {...}}``) is a group."""
    for column, values in block.items():
        if not isinstance(values, Mapping) or not values:
            continue
        if all(isinstance(v, Mapping) for v in values.values()):
            yield from _set_mappings(values, group=column)
        else:
            yield group, column, values


def heldout_table_data(
    heldout: Mapping[str, Any], ood_names: Iterable[str] = ()
) -> tuple[list[str], dict[str, dict[str, float]]]:
    """(columns, {set: {column: value}}) from a deployable.json ``heldout`` block: every
    ``{set: number}`` mapping is a column (``flag_rate``, ``n``, and whatever else it holds, e.g.
    rates on successful images); the clean row reads ``fpr`` and ``n_clean``. Sets of an
    ``ood`` group or named in ``ood_names`` are OOD sets (``ood-`` keys)."""
    ood = set(ood_names)
    columns: dict[str, None] = {"flag_rate": None, "n": None}
    table: dict[str, dict[str, float]] = {}
    if heldout.get("fpr") is not None:
        table[CLEAN] = {"flag_rate": float(heldout["fpr"])}
        if heldout.get("n_clean") is not None:
            table[CLEAN]["n"] = float(heldout["n_clean"])
    for group, column, values in _set_mappings(heldout):
        columns[column] = None
        for key, value in values.items():
            if not isinstance(value, int | float):
                continue
            is_ood = (group == "ood" or key in ood) and not key.startswith(OOD_PREFIX)
            table.setdefault(f"{OOD_PREFIX}{key}" if is_ood else key, {})[column] = float(value)
    used = [c for c in columns if any(c in row for row in table.values())]
    return used, {key: table[key] for key in order_sets(table)}


def _heldout_header(column: str) -> str:
    default = column.replace("_", " ") + ("" if _is_count(column) else " (%)")
    return _HELDOUT_COLUMNS.get(column, default)


def _heldout_cell(column: str, value: float | None) -> str:
    if value is None:
        return ""
    return str(int(value)) if _is_count(column) else percent(value)


def _with_intervals(columns: list[str]) -> list[str]:
    """The held-out columns, each count column of a rate followed by that rate's interval."""
    out = []
    for column in columns:
        out.append(column)
        rates = [r for r, n in _RATE_COUNTS.items() if n == column and r in columns]
        out.extend(f"interval {r}" for r in rates)
    return out


def _interval_cell(column: str, values: Mapping[str, float]) -> str:
    """'4.44–6.49': the rate's two-sided Clopper-Pearson interval (%) on its images; '' without
    the rate or its count."""
    rate = column.removeprefix("interval ")
    value, n = values.get(rate), values.get(_RATE_COUNTS[rate])
    if value is None or not n:
        return ""
    low, high = rate_interval(int(round(value * n)), int(n), INTERVAL_CONFIDENCE)
    return f"{percent(low)}–{percent(high)}"


def read_deployable(run_dir: Path) -> Mapping[str, Any] | None:
    """The run's deployable.json (the shipped detector's sections read it), or None when it is
    missing or damaged: those sections are then left out, not the whole report."""
    return read_optional_json(RunDir(run_dir).deployable_file, "deployable detector")


def deployed_section(
    info: Mapping[str, Any] | None, config: Mapping[str, Any], detection: Sequence[Record]
) -> list[str]:
    """The shipped detector's held-out flag rates at its calibrated threshold (``info``: the
    run's deployable.json), beside the seen protocol's detection rate there."""
    heldout = (info or {}).get("heldout")
    if info is None or not isinstance(heldout, Mapping):
        return []
    columns, table = heldout_table_data(heldout, config.get("ood_test", ()))
    kind, network = str(info.get("kind", "?")), str(info.get("network", "?"))
    trained = set(info.get("train_attacks", []))
    seen = {
        r["test_attack"]: r
        for r in detection
        if r["setting"] == "seen" and r["model"] == network and r["detector"] == kind
    }
    columns = _with_intervals(columns)
    interval = f"{100 * INTERVAL_CONFIDENCE:g}% interval (%)"
    header = ["Set", "trained on"]
    header += [interval if c.startswith("interval ") else _heldout_header(c) for c in columns]
    header.append(f"seen protocol {row_label(network, kind)}: TPR at calibrated threshold (%)")
    rows = []
    for key, values in table.items():
        label = "clean (FPR)" if key == CLEAN else set_label(key)
        role = "" if key == CLEAN else ("yes" if key in trained else "no")
        cells = [
            _interval_cell(c, values)
            if c.startswith("interval ")
            else _heldout_cell(c, values.get(c))
            for c in columns
        ]
        protocol = format_cell(seen[key], "calibrated_tpr") if key in seen else ""
        rows.append([label, role, *cells, protocol])
    calibration = info.get("calibration", {})
    return [
        "## Deployed detector: held-out flag rates at the calibrated threshold",
        "",
        _calibration_note(kind, network, info, calibration),
        "",
        markdown_table(header, rows, left=2),
        "",
    ]


def _calibration_note(
    kind: str, network: str, info: Mapping[str, Any], calibration: Mapping[str, Any]
) -> str:
    threshold, target = calibration.get("threshold"), calibration.get("target_fpr")
    achieved = calibration.get("achieved_fpr")
    trained = ", ".join(set_label(k) for k in info.get("train_attacks", [])) or "?"
    at = f"threshold {threshold:.4g}" if threshold is not None else "its threshold"
    target_text = f"a {percent(target)}% FPR" if target is not None else "the target FPR"
    achieved_text = f", achieved {percent(achieved)}%" if achieved is not None else ""
    confidence = calibration.get("confidence")
    if confidence is not None:
        target_text += f" with {100 * confidence:g}% confidence (Clopper-Pearson bound)"
    families = info.get("families") or []
    if families:
        trained += f" (plus one forest set per family: {', '.join(families)})"
    synthetic = info.get("synthetic_outliers") or {}
    if synthetic.get("rows"):
        trained += (
            f", and {synthetic['rows']} synthetic outliers made from training-side clean images "
            f"({', '.join(synthetic.get('transforms', []))}) as a family of their own"
        )
    return (
        f"The detector that ships in the bundle: {kind} on {MODEL_LABELS.get(network, network)}, "
        f"trained on {trained}, flagging a score above {at}, calibrated for {target_text} on "
        f"{_calibration_images(info, calibration)}{achieved_text}. "
        f"Rates are measured by the Guard (the server's scoring path) on the held-out test side "
        f"(split seed {info.get('split_seed', '?')}, one run); n: images per set, and each "
        f"rate's two-sided {100 * INTERVAL_CONFIDENCE:g}% Clopper-Pearson interval on them. The last "
        "column is the seen protocol's rate for the same network and detector trained on that "
        "attack alone (mean ± std over its runs)."
        + _calibration_fpr_note(info)
        + _clean_split_note(info.get("heldout", {}))
        + _png_note(info.get("heldout", {}))
        + _saturation_note(calibration)
    )


def _calibration_images(info: Mapping[str, Any], calibration: Mapping[str, Any]) -> str:
    """Which clean images the threshold was calibrated on (deployable.json's counts)."""
    images = info.get("calibration_images") or {}
    if not images.get("fitting") and not images.get("validation"):
        return f"{calibration.get('n', '?')} held-out clean training-side images"
    sources = [f"{images.get('slice', '?')} of a held-out calibration slice"]
    if images.get("validation"):
        sources.append(
            f"{images['validation']} of the network's own validation images, which it never "
            "learnt from"
        )
    if images.get("fitting"):
        sources.append(
            f"{images['fitting']} of the detector's own fitting images scored by the parts that "
            "never saw them: out-of-bag forest votes and the nearest clean image of another source"
        )
    listed = (
        ", ".join(sources[:-1]) + f", and {sources[-1]}"
        if len(sources) > 2
        else " and ".join(sources)
    )
    return f"{calibration.get('n', '?')} clean images ({listed})"


def _saturation_note(calibration: Mapping[str, Any]) -> str:
    """A warning when the threshold is the clean scores' maximum (``Calibration.saturated``)."""
    if not calibration.get("saturated"):
        return ""
    return (
        " **Warning: this threshold is the clean scores' maximum (too many tie there, or too few "
        "images for the confidence): only inputs scoring above every clean image are flagged, "
        "and a detector whose scores stop there flags nothing. Calibrate on more clean images.**"
    )


#: deployable.json's calibration sources, as the report names them
CALIBRATION_SOURCES = {
    "slice": "the calibration slice",
    "validation": "the network's validation images",
    "fitting": "the detector's fitting images",
}


def _calibration_fpr_note(info: Mapping[str, Any]) -> str:
    """' At that threshold it flags X% of the calibration slice, ...' when recorded: a source that
    reads cleaner than new images (the detector's own fitting images, say) pulls the threshold
    down, and the held-out clean FPR above the achieved one."""
    rates = info.get("calibration_fpr") or {}
    held_out = (info.get("heldout") or {}).get("fpr")
    if not rates:
        return ""
    listed = ", ".join(
        f"{percent(rate)}% of {CALIBRATION_SOURCES.get(source, source)}"
        for source, rate in rates.items()
    )
    tail = "" if held_out is None else f", and {percent(held_out)}% of the held-out clean images"
    return f" At that threshold it flags {listed}{tail}."


def _clean_split_note(heldout: Mapping[str, Any]) -> str:
    """' Of the held-out clean images the network misclassifies N: ...' when recorded."""
    right, wrong = heldout.get("fpr_correct"), heldout.get("fpr_misclassified")
    if right is None or wrong is None:
        return ""
    return (
        f" Of the held-out clean images, the network misclassifies {heldout['n_misclassified']}: "
        f"the detector flags {percent(wrong)}% of those (a flag that also stops a wrong answer) "
        f"and {percent(right)}% of the images it classifies right."
    )


def _png_note(heldout: Mapping[str, Any]) -> str:
    """What the PNG columns hold, when recorded."""
    if not heldout.get("n_png_successful"):
        return ""
    return (
        " Sent as PNG: each attack's held-out images rounded to 8 bits, as a client sending PNGs "
        "sends them (the tensor the server decodes); successful: those that still fool the "
        "network, since rounding undoes some minimal perturbations (CW, DeepFool)."
    )


def learning_curve_section(run_dir: Path, results: Mapping[str, Any]) -> list[str]:
    """results.json's learning curves as a table and figures/learning_curve.png."""
    curves = {
        model: attacks
        for model, attacks in (results.get("learning_curves") or {}).items()
        if attacks
    }
    if not curves:
        return []
    rows, panels = [], {}
    for model in order_models(curves):
        label = MODEL_LABELS.get(model, model.upper())
        panels[label] = {set_label(a): curves[model][a] for a in order_sets(curves[model])}
        for attack in order_sets(curves[model]):
            for point in curves[model][attack]:
                rows.append(
                    [
                        f"{label} {set_label(attack)}",
                        str(point["pairs"]),
                        format_cell(point, "accuracy"),
                        format_cell(point, "auroc") if "auroc" in point else "",
                        str(point.get("runs", "")),
                    ]
                )
    header = ["Network attack", "Training pairs", "Accuracy (%)", "AUROC (%)", "Runs"]
    path = plot_learning_curves(
        panels,
        RunDir(run_dir).figures / LEARNING_CURVE_FIGURE,
        title="Transport detector, seen attacks (mean ± std)",
    )
    note = (
        "The transport detector fitted on nested subsets of an attack's training-side pairs "
        "(attacked image + its clean source) and tested on the attack's whole test side, as the "
        "seen protocol (its last row: all pairs); mean ± std over the runs."
    )
    return [
        "## Learning curves",
        "",
        note,
        "",
        markdown_table(header, rows),
        "",
        *figure_link(run_dir, path, "Detection accuracy vs number of training pairs"),
    ]


def summary_section(
    detection: Sequence[Record], ood: Sequence[Record], rows: Sequence[tuple[str, str]]
) -> list[str]:
    """Mean detection accuracy per protocol, per network and detector."""
    groups = {
        "seen": [r for r in detection if r.get("setting") == "seen"],
        "unseen": [r for r in detection if r.get("setting") == "unseen"],
        "OOD (unseen sets)": [r for r in ood if r["train_set"] != r["test_set"]],
    }
    summary = []
    for name, records in groups.items():
        for model, detector in rows:
            values = [
                float(r["accuracy"])
                for r in records
                if r["model"] == model
                and r["detector"] == detector
                and r.get("accuracy") is not None
            ]
            if values:
                summary.append(
                    {
                        "model": model,
                        "detector": detector,
                        "protocol": name,
                        "accuracy": float(np.mean(values)),
                        "count": len(values),
                    }
                )
    if not summary:
        return []
    columns = [g for g in groups if any(s["protocol"] == g for s in summary)]
    table = metric_table(
        summary,
        rows=rows,
        columns=columns,
        labels=columns,
        column_of=lambda r: r["protocol"],
        metric="accuracy",
    )
    legend = detector_legend(detector for _, detector in rows)
    return [
        "## Summary: mean detection accuracy (%)",
        "",
        table,
        "",
        *([legend, ""] if legend else []),
    ]


def _flatten(prefix: str, value: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            yield from _flatten(f"{prefix} / {key}" if prefix else str(key), inner)
    else:
        yield prefix, value


def _timing_value(key: str, value: Any) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return str(value)
    return f"{value:.4g} s" if "second" in key else f"{value:.4g}"


def timing_section(results: Mapping[str, Any]) -> list[str]:
    timing = results.get("timing", {})
    rows = [[key, _timing_value(key, v)] for key, v in _flatten("", timing)]
    lines = ["## Timing", ""]
    if not rows:
        return lines + ["No timing in results.json.", ""]
    lines += [markdown_table(["Measure", "Value"], rows), ""]
    extraction = timing.get("feature_extraction_seconds", {})
    if (
        isinstance(extraction, Mapping)
        and extraction.get("transport")
        and extraction.get("mahalanobis")
    ):
        ratio = extraction["mahalanobis"] / extraction["transport"]
        if ratio >= 1:
            line = (
                f"Transport features are extracted {ratio:.1f}x faster than Mahalanobis features."
            )
        else:
            line = (
                f"Transport features are extracted {1 / ratio:.1f}x slower than Mahalanobis "
                "features: the chosen set's groups that run more forward passes (squeeze, "
                "second) cost more than the trajectory statistics, which come with the prediction."
            )
        lines += [line, ""]
    return lines


def run_time_section(run_dir: Path) -> list[str]:
    """Minutes per group of pipeline steps (``RUN/timings.jsonl``) and the machine's reference
    workload, so a run's time can be set beside another machine's."""
    rows = read_timings(run_dir)
    minutes = grouped_minutes(step_seconds(rows))
    lines = ["## Where the run's time went", ""]
    if not rows:
        return lines + ["No timings.jsonl in this run (a run from before it was kept).", ""]
    table = [[label, f"{value:.1f}"] for label, value in minutes]
    lines += [markdown_table(["Steps", "Wall minutes"], table), ""]
    references = [r for r in rows if r.get("event") == "reference"]
    if references:
        lines += [
            f"Wall time per step summed over {len(references)} invocation(s), up to this report "
            "(the report and bundle steps come after it; a cached step costs ~0). The machine's "
            f"reference workload (`training.timings`, {references[0].get('threads', '?')} torch "
            f"threads): torch {_span(references, 'torch_seconds')}, forest "
            f"{_span(references, 'forest_seconds')}; divide a time by it to compare machines.",
            "",
        ]
    return lines


def _span(rows: Sequence[Mapping[str, Any]], key: str) -> str:
    """'0.84 s', or '0.84-1.20 s' over several rows."""
    low, high = min(r[key] for r in rows), max(r[key] for r in rows)
    return f"{low:.2f} s" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f} s"


def notes_section(
    run_dir: Path, config: Mapping[str, Any], models: Sequence[str], scores: Mapping[Any, Any]
) -> list[str]:
    notes = [
        f"- **{set_label(str(item.get('attack', '?')))}**: {NOT_RUN}: {item.get('reason', 'no reason given')}"
        for item in config.get("not_run", [])
        if isinstance(item, Mapping)
    ]
    if config.get("expected_duration"):
        notes.append(f"- Expected duration of this preset: {config['expected_duration']}.")
    scored = {model for model, _, _ in scores}
    notes += [
        f"- {MODEL_LABELS.get(m, m.upper())}: no detector scores in scores/{m}/ (no ROC curves)."
        for m in models
        if m not in scored
    ]
    notes += [
        f"- {MODEL_LABELS.get(m, m.upper())}: no features in features/{m}/ (no histograms or trajectories)."
        for m in models
        if not RunDir(run_dir).feature_dir(m).is_dir()
    ]
    notes.append(
        f'- A cell "{NOT_RUN}" means the run has no result for that network, detector and attack.'
    )
    notes.append("- ROC curves use the scores of the first seed; tables average over all runs.")
    return ["## Notes", "", *notes, ""]


def dynamics_section(run_dir: Path) -> list[str]:
    """``diagnostics.json`` (``lapguard diagnose``): the per-network table, the claims table of
    the ``diagnose`` preset when present, and the dynamics figures that exist."""
    run = RunDir(run_dir)
    if not run.diagnostics_file.is_file():
        return []
    diagnostics = read_json_or_empty(run.diagnostics_file)
    note = (
        "Per network and image set (seeds 000, 001/002; `lapguard diagnose`): the line-shape "
        "score of each sample's track x_0 -> x_M (1 = a straight line), the optimal transport "
        "score of each block's map and of the whole stage (1 = the map is the OT map on the "
        "sample), the W-distance between a layer's predicted label distribution (a linear probe "
        "head per layer, then the network's head) and the one-hot target, the share of "
        "'confused' samples (some probe right, the head wrong), and how well the LSS alone "
        "tells an adversarial set from clean images (AUROC)."
    )
    lines = [
        "## Network dynamics",
        "",
        note,
        "",
        markdown_table(SUMMARY_HEADER, summary_rows(diagnostics), left=2),
        "",
    ]
    if diagnostics.get("claims"):
        lines += ["### The seeds' claims, measured here", ""]
        lines += [markdown_table(CLAIMS_HEADER, claim_rows(diagnostics), left=4), ""]
    for name, caption in (
        (NETWORKS_FIGURE, "Per-block dynamics on clean test images, one line per network"),
        (ATTACKS_FIGURE, "Per-block dynamics, clean vs adversarial sets"),
    ):
        if (run.figures / name).is_file():
            lines += figure_link(run.path, run.figures / name, caption)
    return lines


# ---- figures ----------------------------------------------------------------------------------


def roc_figures(
    run_dir: Path, scores: Mapping[tuple[str, str, str], Mapping[tuple[str, str], Any]]
) -> list[str]:
    """One figure per (detector, setting), one panel per network."""
    lines = ["### ROC curves", ""]
    for setting in ("seen", "unseen", "ood"):
        for detector in order_detectors(d for _, d, s in scores if s == setting):
            panels = {}
            for model in order_models(m for m, d, s in scores if d == detector and s == setting):
                pairs = scores[(model, detector, setting)]
                panels[MODEL_LABELS.get(model, model.upper())] = {
                    _pair_label(train, test, setting): pairs[(train, test)]
                    for train, test in sorted(pairs, key=lambda p: (set_rank(p[0]), set_rank(p[1])))
                }
            title = f"{detector_label(detector)} ({detector}), {setting}"
            path = plot_roc_curves(
                panels, RunDir(run_dir).roc_figure(detector, setting), title=title
            )
            lines += figure_link(
                run_dir, path, f"ROC curves: {detector} detector, {setting} setting (first seed)"
            )
    return lines if len(lines) > 2 else []


def _pair_label(train: str, test: str, setting: str) -> str:
    return set_label(test) if setting == "seen" else f"{set_label(train)} → {set_label(test)}"


def feature_figures(run_dir: Path, models: Sequence[str]) -> list[str]:
    """Transport-cost histograms and per-block trajectories, attacks and OOD sets in separate figures."""
    features = {MODEL_LABELS.get(m, m.upper()): load_features(run_dir, m) for m in models}
    features = {m: sets for m, sets in features.items() if CLEAN in sets}
    lines: list[str] = ["### Transport cost and per-block features", ""]
    for kind, keep in (
        ("attacks", lambda k: not k.startswith(OOD_PREFIX)),
        ("ood", lambda k: k.startswith(OOD_PREFIX)),
    ):
        chosen = {
            m: {set_label(k): v for k, v in sets.items() if k == CLEAN or keep(k)}
            for m, sets in features.items()
        }
        if not any(len(sets) > 1 for sets in chosen.values()):
            continue
        costs = {
            m: {k: msq.sum(axis=1) for k, (msq, _) in sets.items()} for m, sets in chosen.items()
        }
        hist = plot_transport_histograms(
            costs,
            RunDir(run_dir).transport_histogram_figure(kind),
            clean=set_label(CLEAN),
            title=f"Transport cost, clean vs {kind} (dashed: clean 0.02 / 0.98 quantiles)",
        )
        lines += figure_link(
            run_dir, hist, f"Transport cost C per sample, clean vs {kind} (seed fig. 21)"
        )
        traj = plot_feature_trajectories(
            chosen,
            RunDir(run_dir).trajectories_figure(kind),
            clean=set_label(CLEAN),
            title=f"Per-block features, clean vs {kind} (mean ± std)",
        )
        lines += figure_link(run_dir, traj, f"Per-block transport features, clean vs {kind}")
    return lines if len(lines) > 2 else []


# ---- entry point ------------------------------------------------------------------------------


def write_report(run_dir: Path) -> Path:
    """Write RUN/report.md and RUN/figures/*.png from the run's results, features and scores; return report.md."""
    run = RunDir(run_dir)
    run_dir, results_path = run.path, run.results_file
    if not results_path.is_file():
        raise ArtefactError(
            f"{results_path} not found: run `lapguard evaluate --run {run_dir}` first"
        )
    results, config = read_json_or_empty(results_path), read_json_or_empty(run.config_file)
    detection, ood = list(results.get("detection", [])), list(results.get("ood", []))
    for record in detection:
        record.setdefault(
            "setting",
            "seen" if record.get("train_attack") == record.get("test_attack") else "unseen",
        )
    models = order_models([*results.get("models", {}), *(r["model"] for r in detection + ood)])
    detectors = order_detectors(r["detector"] for r in detection + ood)
    rows = [(m, d) for d in detectors for m in models]
    scores, deployable = load_scores(run_dir), read_deployable(run_dir)
    figures = roc_figures(run_dir, scores) + feature_figures(run_dir, models)
    lines = [
        *header_section(config, results),
        *models_section(run_dir, results, models),
        *attacks_section(results, models),
        *feature_selection_section(run_dir, models),
        *summary_section(detection, ood, rows),
        *seen_section([r for r in detection if r["setting"] == "seen"], rows),
        *unseen_section([r for r in detection if r["setting"] == "unseen"], rows),
        *ood_section(ood, rows, config.get("ood_clean_ratio", 1.0)),
        *security_section(detection, rows),
        *deployed_section(deployable, config, detection),
        *operating_points_section(run_dir, deployable),
        *adaptive_section(results, run_dir),
        *learning_curve_section(run_dir, results),
        *timing_section(results),
        *run_time_section(run_dir),
        *dynamics_section(run_dir),
        *(["## Figures", "", *figures] if figures else []),
        *notes_section(run_dir, config, models, scores),
    ]
    return artefacts.write_text(run.report_file, "\n".join(lines).rstrip() + "\n")


def write_dynamics_report(run_dir: Path) -> Path:
    """RUN/report.md of a run with diagnostics but no detection results (the ``diagnose``
    preset): the network-dynamics section alone."""
    run = RunDir(run_dir)
    lines = [f"# lapguard network dynamics: {run.path.name}", "", *dynamics_section(run.path)]
    return artefacts.write_text(run.report_file, "\n".join(lines).rstrip() + "\n")


def refresh_report(run_dir: Path) -> Path | None:
    """After ``lapguard diagnose``: the pipeline's report again when the run has one, a report of
    the dynamics alone when the run has no detection results; None when neither applies."""
    run = RunDir(run_dir)
    if not run.results_file.is_file():
        return write_dynamics_report(run.path)
    return write_report(run.path) if run.report_file.is_file() else None
