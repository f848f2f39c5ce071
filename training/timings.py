"""``RUN/timings.jsonl``: where a pipeline run's time went, and how fast the machine was.

Machines here differ by up to 1.7x and drift from minute to minute, so a run's wall time says
little alone. Each pipeline invocation appends one ``reference`` line (a fixed workload timed at
its start: a small convolutional network's forward and backward passes in torch, and a random
forest fitted by scikit-learn, the two kinds of work a run does) and one ``step`` line per step it
finishes (its wall seconds; a cached step takes ~0 s). A resumed run appends to the same file, so
a step's time is the sum of its lines::

    {"event": "reference", "torch_seconds": 1.92, "forest_seconds": 1.41, "threads": 2, ...}
    {"event": "step", "step": "attack lap/cw", "seconds": 294.9, "finished": "2026-11-26T..."}
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.ensemble import RandomForestClassifier
from torch import nn

from detector import artefacts
from training.rundir import TIMINGS_FILE

# (group label, step-name prefix): the report's rows, in pipeline order
STEP_GROUPS = (
    ("train the networks", "train "),
    ("attacks", "attack "),
    ("evaluate (features, protocols, learning curves)", "evaluate"),
    ("fit the deployable detector", "fit deployable"),
    ("results, report, bundle", ""),
)


def reference_seconds(repeats: int = 2) -> dict[str, float]:
    """Seconds of a fixed workload on this machine, the best of ``repeats``: 10 forward+backward
    passes of a small convolutional network on 128 images of 1x28x28 (torch, its threads), and a
    30-tree random forest fitted on 4,000 rows of 64 features (scikit-learn, every core)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(128, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (128,), generator=generator)
    torch.manual_seed(0)
    network = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(4000, 64))
    targets = (rows[:, :8].sum(1) + rng.normal(size=4000) > 0).astype(int)

    def torch_work() -> None:
        for _ in range(10):
            network.zero_grad()
            nn.functional.cross_entropy(network(images), labels).backward()

    def forest_work() -> None:
        RandomForestClassifier(30, random_state=0, n_jobs=-1).fit(rows, targets)

    return {
        "torch_seconds": _best_of(torch_work, repeats),
        "forest_seconds": _best_of(forest_work, repeats),
    }


def _best_of(work: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return round(min(times), 4)


def record_reference(path: Path) -> dict[str, Any]:
    """Append this machine's :func:`reference_seconds` (with torch's thread count) to ``path``."""
    row = {
        "event": "reference",
        **reference_seconds(),
        "threads": torch.get_num_threads(),
        "at": utc_now(),
    }
    artefacts.append_jsonl(path, row)
    return row


def record_step(path: Path, step: str, seconds: float) -> None:
    """Append one finished step's wall seconds to ``path``."""
    row = {"event": "step", "step": step, "seconds": round(seconds, 3), "finished": utc_now()}
    artefacts.append_jsonl(path, row)


def step_seconds(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Each step's seconds, summed over its lines (a resumed step's parts add up), in order."""
    totals: dict[str, float] = {}
    for row in rows:
        if row.get("event") == "step":
            totals[row["step"]] = totals.get(row["step"], 0.0) + float(row["seconds"])
    return totals


def grouped_minutes(seconds: Mapping[str, float]) -> list[tuple[str, float]]:
    """Minutes per :data:`STEP_GROUPS` row (a step goes to the first group whose prefix it
    starts with; the last group takes the rest), then the total."""
    minutes = dict.fromkeys((label for label, _ in STEP_GROUPS), 0.0)
    for step, value in seconds.items():
        label = next(label for label, prefix in STEP_GROUPS if step.startswith(prefix))
        minutes[label] += value / 60
    return [*minutes.items(), ("total", sum(seconds.values()) / 60)]


def read_timings(run: str | Path) -> list[dict[str, Any]]:
    """The run's timing lines ([] when it has none: a run from before this file)."""
    return artefacts.read_jsonl(Path(run) / TIMINGS_FILE)


def utc_now() -> str:
    """The current UTC time to the second, ISO 8601 (the run files' timestamps)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
