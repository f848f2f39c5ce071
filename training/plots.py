"""Matplotlib figures (PNG) for runs and reports. Each function writes one file and returns its path."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from detector.artefacts import atomic_path  # noqa: E402


def plot_training_curve(
    steps: Sequence[dict[str, Any]], epochs: Sequence[dict[str, Any]], path: str | Path
) -> Path:
    """Loss terms, lambda and accuracies over training (steps logged every few batches); with
    the dynamics monitors (training/trainer/monitors.py), their per-epoch curves in a second row."""
    path = Path(path)
    monitored = any(r.get("monitor_w_layers") for r in epochs)
    fig, grid = plt.subplots(2 if monitored else 1, 3, figsize=(14, 7.6 if monitored else 3.8))
    axes = np.atleast_2d(grid)[0]
    if steps:
        x = [s["step"] for s in steps]
        axes[0].plot(x, [s["task_loss"] for s in steps], label="task loss")
        axes[0].plot(x, [s["transport"] for s in steps], label="transport cost C")
        axes[0].set_yscale("log")
        axes[0].set_xlabel("step")
        axes[0].legend()
        axes[1].plot(x, [s["lambda"] for s in steps], color="tab:purple")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("lambda")
    axes[0].set_title("loss terms")
    axes[1].set_title("Uzawa multiplier")
    if epochs:
        e = [r["epoch"] for r in epochs]
        for key in ("train_accuracy", "val_accuracy", "test_accuracy"):
            if key in epochs[0] and epochs[0][key] is not None:
                axes[2].plot(e, [r[key] for r in epochs], marker="o", label=key.replace("_", " "))
        axes[2].set_xlabel("epoch")
        axes[2].legend()
    axes[2].set_title("accuracy")
    if monitored:
        _monitor_panels(np.atleast_2d(grid)[1], epochs)
    fig.tight_layout()
    return _save(fig, path)


def _layer_lines(ax: Any, epochs: Sequence[dict[str, Any]], key: str, name: str) -> None:
    """One line per layer (entry of each row's ``key`` list) over the epochs, light to dark."""
    rows = [(r["epoch"], r[key]) for r in epochs if r.get(key)]
    if not rows:
        ax.text(0.5, 0.5, "from epoch 2", ha="center", va="center", transform=ax.transAxes)
        return
    values = np.array([v for _, v in rows], dtype=np.float64)
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, values.shape[1]))
    for layer in range(values.shape[1]):
        label = f"{name} {layer}" if layer in (0, values.shape[1] - 1) else None
        ax.plot(
            [e for e, _ in rows], values[:, layer], marker="o", color=colors[layer], label=label
        )
    ax.set_xlabel("epoch")
    ax.legend(fontsize="x-small")


def _monitor_panels(axes: Any, epochs: Sequence[dict[str, Any]]) -> None:
    """Seed 000's W-distance per layer, seed 004's ICS per block, and the last epoch's W curve."""
    _layer_lines(axes[0], epochs, "monitor_w_layers", "layer")
    axes[0].set_title("W(layer, target) per epoch (seed 000)")
    _layer_lines(axes[1], epochs, "monitor_ics", "block")
    axes[1].set_title("ICS: EM distance to the previous epoch (seed 004)")
    last = [r for r in epochs if r.get("monitor_w_layers")][-1]["monitor_w_layers"]
    axes[2].plot(np.arange(len(last)), last, marker="o", color="black")
    axes[2].set(title="W(layer, target), last epoch", xlabel="layer (stem, blocks, head)")


# ---- evaluation report figures ----------------------------------------------------------------

_CLEAN_STYLE = {"color": "black", "linewidth": 2.0}


def _save(fig: Any, path: Path) -> Path:
    """Write a figure atomically (format from the file suffix) and close it."""
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or None)
    finally:
        plt.close(fig)
    return path


def plot_roc_curves(
    panels: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]],
    path: str | Path,
    *,
    title: str = "",
) -> Path:
    """ROC curves, one panel per key of `panels` (e.g. per network), one curve per
    `label: (is_abnormal, score)` inside it; higher score = more abnormal."""
    from sklearn.metrics import roc_auc_score, roc_curve

    path = Path(path)
    fig, axes = plt.subplots(
        1, max(1, len(panels)), figsize=(5.2 * max(1, len(panels)), 4.6), squeeze=False
    )
    for ax, (name, curves) in zip(axes[0], panels.items(), strict=False):
        ax.plot([0, 1], [0, 1], linestyle=":", color="grey", linewidth=1)
        for label, (truth, score) in curves.items():
            finite = np.isfinite(np.asarray(score, dtype=np.float64))
            truth, score = np.asarray(truth, dtype=bool)[finite], np.asarray(score)[finite]
            if truth.all() or not truth.any():
                ax.plot([], [], label=f"{label} (one class only)")
                continue
            fpr, tpr, _ = roc_curve(truth, score)
            ax.plot(fpr, tpr, label=f"{label} (AUC {roc_auc_score(truth, score):.3f})")
        ax.set(
            title=name,
            xlabel="false positive rate",
            ylabel="true positive rate",
            xlim=(0, 1),
            ylim=(0, 1.01),
        )
        ax.legend(loc="lower right", fontsize="small")
    _finish(fig, title)
    return _save(fig, path)


def _finish(fig: Any, title: str | None, *, right: float = 1.0) -> None:
    """Lay the panels out below the figure's title (if any), leaving its first line clear."""
    top = 1.0
    if title:
        fig.suptitle(title)
        top = 1.0 - 0.15 / fig.get_figheight()  # a little air below the title
    fig.tight_layout(rect=(0, 0, right, top))


def _histogram_bins(values: np.ndarray, bins: int) -> tuple[np.ndarray, bool]:
    """Shared bin edges over the 0.1–99.9 percentiles of the values (outliers go to the edge bins);
    logarithmic when the values are positive and span decades."""
    low, high = (float(v) for v in np.quantile(values, [0.001, 0.999]))
    if low > 0 and high / low > 50:
        return np.geomspace(low, high, bins + 1), True
    if high <= low:
        high = low + 1e-6
    return np.linspace(low, high, bins + 1), False


def _histogram_panel(
    ax: Any, clean: np.ndarray, other: np.ndarray, label: str, quantiles: Sequence[float]
) -> None:
    """Clean vs one abnormal set, with the clean quantiles as vertical lines."""
    clean, other = clean[np.isfinite(clean)], other[np.isfinite(other)]
    if len(clean) < 2 or len(other) < 1:
        ax.text(0.5, 0.5, "too few finite values", ha="center", va="center", transform=ax.transAxes)
        return
    edges, log = _histogram_bins(np.concatenate([clean, other]), 60)
    low, high = np.quantile(clean, [quantiles[0], quantiles[-1]])
    outside = float(np.mean((other < low) | (other > high)))
    for values, color, name in (
        (clean, "tab:blue", f"clean (n={len(clean)})"),
        (other, "tab:red", f"{label} (n={len(other)}, {outside:.0%} outside)"),
    ):
        clipped = np.clip(values, edges[0], edges[-1])
        ax.hist(clipped, bins=edges, density=True, alpha=0.55, color=color, label=name)
    ax.axvline(
        low,
        color="black",
        linestyle="--",
        linewidth=1.2,
        label=f"clean {quantiles[0]:g} / {quantiles[-1]:g} quantiles",
    )
    ax.axvline(high, color="black", linestyle="--", linewidth=1.2)
    if log:
        ax.set_xscale("log")
    ax.set_yticks([])
    ax.legend(fontsize="x-small", loc="best", framealpha=0.8)


def plot_transport_histograms(
    panels: Mapping[str, Mapping[str, np.ndarray]],
    path: str | Path,
    *,
    clean: str = "clean",
    quantiles: Sequence[float] = (0.02, 0.98),
    title: str = "",
) -> Path:
    """Histograms of the per-sample transport cost (seed 003 fig. 21): one column per network
    (key of `panels`), one row per abnormal set, each against that network's `clean` set, with
    the clean `quantiles` as dashed vertical lines. Legends give the share of the abnormal set
    outside the quantile band (the zero-shot detection rate)."""
    path = Path(path)
    sets = list(dict.fromkeys(s for costs in panels.values() for s in costs if s != clean))
    rows, cols = max(1, len(sets)), max(1, len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 2.7 * rows + 0.6), squeeze=False)
    for col, (name, costs) in enumerate(panels.items()):
        for row, label in enumerate(sets):
            ax = axes[row][col]
            ax.set_title(f"{name}: clean vs {label}", fontsize="medium")
            if clean not in costs or label not in costs:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            _histogram_panel(
                ax, np.asarray(costs[clean]), np.asarray(costs[label]), label, quantiles
            )
        axes[-1][col].set_xlabel("transport cost C = sum over blocks of ||r_m||^2 / d_m")
    _finish(fig, title)
    return _save(fig, path)


def _trajectory_band(ax: Any, values: np.ndarray, style: dict[str, Any]) -> Any:
    """Mean over samples per block, with a +-1 std band; returns the line."""
    blocks = np.arange(values.shape[1])
    mean, std = values.mean(axis=0), values.std(axis=0)
    (line,) = ax.plot(blocks, mean, marker="o", markersize=3, **style)
    ax.fill_between(blocks, mean - std, mean + std, color=line.get_color(), alpha=0.1)
    return line


def plot_feature_trajectories(
    panels: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]],
    path: str | Path,
    *,
    clean: str = "clean",
    title: str = "",
) -> Path:
    """Per-block transport features, mean +- std over samples: top row ||r_m||^2/d_m, bottom row
    cos(r_m, 1); one column per network (key of `panels`), one line per set
    `label: (msq [N, M], cos [N, M])`, the `clean` set in black."""
    path = Path(path)
    cols = max(1, len(panels))
    fig, axes = plt.subplots(2, cols, figsize=(5.2 * cols + 2.2, 6.6), squeeze=False, sharey="row")
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    set_colors: dict[str, dict[str, Any]] = {}
    handles: dict[str, Any] = {}
    for col, (name, sets) in enumerate(panels.items()):
        for label, (msq, cos) in sets.items():
            style = set_colors.setdefault(
                label, _CLEAN_STYLE if label == clean else {"color": next(colors), "linewidth": 1.2}
            )
            handles[label] = _trajectory_band(axes[0][col], np.asarray(msq), style)
            _trajectory_band(axes[1][col], np.asarray(cos), style)
        axes[0][col].set_title(name)
        axes[1][col].set_xlabel("block m")
        for row in (0, 1):
            axes[row][col].xaxis.get_major_locator().set_params(integer=True)
        means = np.concatenate([np.asarray(msq).mean(axis=0) for msq, _ in sets.values()])
        if means.min() > 0 and means.max() / means.min() > 20:
            axes[0][col].set_yscale("log")
    axes[0][0].set_ylabel("||r_m||^2 / d_m")
    axes[1][0].set_ylabel("cos(r_m, 1)")
    right = 1 - 1.9 / (5.2 * cols + 2.2)
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="center left",
        bbox_to_anchor=(right, 0.5),
        fontsize="small",
    )
    _finish(fig, title, right=right)
    return _save(fig, path)


def _spaced_ticks(ticks: Sequence[int], ratio: float = 1.25) -> list[int]:
    """Sorted ticks, leaving out any within ``ratio`` of the previous one kept (log axis)."""
    kept: list[int] = []
    for tick in ticks:
        if not kept or tick >= ratio * kept[-1]:
            kept.append(tick)
    return kept


def plot_learning_curves(
    panels: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]],
    path: str | Path,
    *,
    metric: str = "accuracy",
    title: str = "",
) -> Path:
    """Detection `metric` vs the number of training pairs (log x), one panel per key of `panels`
    (e.g. per network), one line per `label: points` with a ±1 std band; each point a mapping
    with "pairs", `metric` and `metric + "_std"` (values in [0, 1], drawn in percent)."""
    path = Path(path)
    cols = max(1, len(panels))
    fig, axes = plt.subplots(1, cols, figsize=(6.4 * cols, 4.4), squeeze=False)
    for ax, (name, curves) in zip(axes[0], panels.items(), strict=False):
        ticks: set[int] = set()
        for label, points in curves.items():
            pairs = np.array([p["pairs"] for p in points], dtype=np.float64)
            mean = 100 * np.array([p[metric] for p in points], dtype=np.float64)
            std = 100 * np.array([p.get(f"{metric}_std", 0.0) for p in points], dtype=np.float64)
            (line,) = ax.plot(pairs, mean, marker="o", markersize=4, label=label)
            ax.fill_between(pairs, mean - std, mean + std, color=line.get_color(), alpha=0.15)
            ticks.update(int(p) for p in pairs)
        ax.set_xscale("log")
        spaced = _spaced_ticks(sorted(ticks))
        ax.set_xticks(spaced, [str(t) for t in spaced])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(title=name, xlabel="training pairs (attacked + clean source)")
        ax.set_ylabel(f"detection {metric} (%)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    _finish(fig, title)
    return _save(fig, path)


def plot_operating_points(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    *,
    served: float | None = None,
    title: str = "",
) -> Path:
    """Flagged share (%) vs the clean FPR (%) it costs, one line per ``label: (clean FPRs,
    flagged rates)`` (values in [0, 1], one point per operating point, drawn in percent); a
    dotted vertical line at ``served``, the served point's clean FPR."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(8.0, 4.6))
    for label, (fprs, rates) in curves.items():
        ax.plot(100 * np.asarray(fprs), 100 * np.asarray(rates), marker="o", label=label)
    if served is not None:
        ax.axvline(100 * served, color="grey", linestyle=":", label="served by default")
    ax.set(xlabel="held-out clean images flagged (%)", ylabel="held-out images flagged (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    _finish(fig, title, right=0.78)
    return _save(fig, path)


def plot_block_curves(
    grid: Mapping[str, Mapping[str, Mapping[str, Sequence[float | None]]]],
    path: str | Path,
    *,
    clean: str = "clean",
    title: str = "",
) -> Path:
    """Per-block curves: one row per key of `grid` (e.g. a network, or "clean"), one column per
    measure (its key is the y label), one line per `label: values` (None = not defined there,
    drawn as a gap); the `clean` line in black. x is the block (or layer) index."""
    path = Path(path)
    rows = max(1, len(grid))
    cols = max(1, max((len(measures) for measures in grid.values()), default=1))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows + 0.5), squeeze=False)
    for r, (row_name, measures) in enumerate(grid.items()):
        for c, (measure, lines) in enumerate(measures.items()):
            ax = axes[r][c]
            for label, values in lines.items():
                y = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
                style = _CLEAN_STYLE if label == clean else {"linewidth": 1.2}
                ax.plot(np.arange(len(y)), y, marker="o", markersize=3, label=label, **style)
            ax.set(title=f"{row_name}: {measure}" if row_name else measure, xlabel="block / layer")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="x-small", loc="best")
    _finish(fig, title)
    return _save(fig, path)


def plot_adaptive_evasion(
    rows: Sequence[Mapping[str, Any]], column: Callable[[Mapping[str, Any]], str], path: str | Path
) -> Path:
    """Grouped horizontal bars: the evasion rate (%) of each (attack, budget) per
    ``column(row)`` (network and target), labelled with the attacked images."""
    path = Path(path)
    groups = sorted({(r["attack"], r["budget"]) for r in rows})
    columns = list(dict.fromkeys(column(r) for r in rows))
    height = 0.8 / max(1, len(columns))
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.35 * len(groups) * len(columns)))
    for j, name in enumerate(columns):
        values = {(r["attack"], r["budget"]): r for r in rows if column(r) == name}
        ys = [i + j * height for i, g in enumerate(groups) if g in values]
        found = [values[g] for g in groups if g in values]
        rates = [100 * (r["evasion_rate"] or 0.0) for r in found]
        bars = ax.barh(ys, rates, height=height, label=name)
        for bar, r, rate in zip(bars, found, rates, strict=True):
            ax.annotate(
                f"{rate:.1f}% of {r['n_attacked']}",
                (bar.get_width(), bar.get_y() + height / 2),
                xytext=(3, 0), textcoords="offset points", va="center", fontsize=7,
            )  # fmt: skip
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(groups))])
    ax.set_yticklabels([f"{a}\n{b}" for a, b in groups], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 115)
    ax.set_xlabel("evasion rate (%): detected successful images turned undetected successful")
    ax.legend(fontsize=7, loc="lower right")
    _finish(fig, "Adaptive attacks on the network + detector system")
    return _save(fig, path)
