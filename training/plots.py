"""Matplotlib figures (PNG) for runs and reports. Each function writes one file and returns its path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_training_curve(steps: Sequence[dict[str, Any]], epochs: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Loss terms, lambda and accuracies over training (steps logged every few batches)."""
    path = Path(path)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
