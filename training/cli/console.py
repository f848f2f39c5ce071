"""The text the ``lapguard`` commands print: listings of what exists and tables of results.

Pure formatting: every function takes results and returns lines; nothing here computes or reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from training.adaptive.attacks import get_adaptive_spec, list_adaptive_attacks
from training.attacks.registry import attack_defaults, get_attack_spec, list_attacks
from training.data.datasets import DATASETS, OOD_SETS
from training.diagnostics.diagnose import SUMMARY_HEADER, summary_rows
from training.presets import TRAIN_PRESETS
from training.presets.pipelines import PIPELINE_PRESETS
from training.reporting.adaptive import HEADER, adaptive_rows

ATTACK_COLUMNS = (
    "model",
    "attack",
    "n",
    "success",
    "success|correct",
    "median L2",
    "median Linf",
    "s/image",
    "set",
)
ATTACK_FOOTNOTE = "(median L2/Linf over successful samples; s/image = generation wall time / n)"


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns two spaces apart, trailing blanks removed."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def dataset_lines() -> list[str]:
    """One line per known data set (shape, classes), then the OOD sets."""
    lines = [
        f"{name:15s} {info.channels}x{info.height}x{info.width}  {len(info.class_names)} classes"
        for name, info in sorted(DATASETS.items())
    ]
    return [*lines, f"OOD sets: {', '.join(OOD_SETS)} (plus any data set above)"]


def train_preset_lines() -> list[str]:
    """One line per training preset: objective, network, data set and schedule."""
    return [
        f"{name:36s} {p.objective:8s} {p.architecture:14s} {p.dataset:14s} "
        f"epochs={p.epochs} batch={p.batch_size} lr={p.lr}"
        for name, p in TRAIN_PRESETS.items()
    ]


def pipeline_preset_lines() -> list[str]:
    """One line per pipeline preset: networks, detectors and attacks with their sizes."""
    lines = []
    for name, preset in PIPELINE_PRESETS.items():
        attacks = ", ".join(f"{a.key}(n={a.n})" for a in preset.attacks)
        duration = f"; expected: {preset.expected_duration}" if preset.expected_duration else ""
        lines.append(
            f"{name:8s} networks={list(preset.models.values())} detectors={preset.detectors} "
            f"attacks: {attacks}{duration}"
        )
    return lines


def attack_lines() -> list[str]:
    """Two lines per registered attack: name, kind and summary, then its default parameters."""
    lines = []
    for name in list_attacks():
        spec = get_attack_spec(name)
        defaults = " ".join(f"{k}={v}" for k, v in attack_defaults(name).items())
        lines += [f"{name:11s} {spec.kind:10s} {spec.summary}", f"{'':11s} {defaults}"]
    return lines


def attack_table(sets: Mapping[str, Any], attack: str) -> list[str]:
    """The summary of each network's adversarial set (``AdversarialSet``) as a table."""
    rows = [ATTACK_COLUMNS]
    for name, adv in sets.items():
        s = adv.summary()
        rows.append(
            (
                name,
                attack,
                str(len(adv)),
                f"{s['success_rate']:.3f}",
                f"{s['success_rate_on_correct']:.3f}",
                f"{s['median_l2']:.4f}",
                f"{s['median_linf']:.4f}",
                f"{s['seconds_per_image']:.4f}",
                f"{adv.path}{' (cached)' if adv.from_cache else ''}",
            )
        )
    return [*aligned(rows), ATTACK_FOOTNOTE]


def adaptive_attack_lines() -> list[str]:
    """Two lines per adaptive attack: name, start attack and summary, then its defaults."""
    lines = []
    for name in list_adaptive_attacks():
        spec = get_adaptive_spec(name)
        summary = (spec.params.__doc__ or "").strip().splitlines()[0]
        defaults = " ".join(f"{k}={v}" for k, v in spec.make_params().model_dump().items())
        lines += [f"{name:15s} from {spec.start:4s} {summary}", f"{'':15s} {defaults}"]
    return lines


def adaptive_table(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The adaptive rows (``results.json`` ``"adaptive"``) as a table: the report's columns and
    rows (:func:`training.reporting.adaptive.adaptive_rows`), aligned for the terminal."""

    lines = [HEADER, *map(tuple, adaptive_rows(list(rows)))]
    footnote = (
        "(detected = successful start images the target flags, the attack's pool; evasion = "
        "share of the attacked pool that fools the network unflagged; final det. = flag rate of "
        "successful final images)"
    )
    return [*aligned(lines), footnote]


def detection_lines(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per detection protocol result (an ``evaluation.json`` ``detection`` row)."""
    return [
        f"{row['model']:8s} {row['detector']:12s} {row['setting']:7s} "
        f"{row['train_attack']:>12s} -> {row['test_attack']:12s} "
        f"accuracy {row['accuracy']:.4f} ± {row['accuracy_std']:.4f}  auroc {row['auroc']:.4f}"
        for row in rows
    ]


def pipeline_summary(name: str, run: Path, seconds: float, results: Mapping[str, Any]) -> list[str]:
    """Where a finished pipeline put its report and bundle, and each network's accuracy."""
    head = (
        f"pipeline {name} finished in {seconds:.0f}s: {run / 'report.md'}, "
        f"bundle in {run / 'bundle'}"
    )
    accuracies = [
        f"  {model}: test accuracy {info['test_accuracy']:.4f}"
        for model, info in results["models"].items()
    ]
    return [head, *accuracies]


def diagnose_lines(result: Mapping[str, Any]) -> list[str]:
    """`lapguard diagnose`'s table: one row per network and set, then the claims if any."""
    lines = aligned([SUMMARY_HEADER, *summary_rows(result)])
    for claim in result.get("claims", []):
        verdict = "holds" if claim["holds"] else "does not hold"
        lines.append(f"[{claim['seed']}] {claim['claim']}: {claim['measured']} -> {verdict}")
    lines.append(f"({result.get('seconds', 0.0):.1f} s; diagnostics.json in the run directory)")
    return lines
