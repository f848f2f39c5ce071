"""How much the shipped detector's held-out rates move with the split alone.

    .venv/bin/python benchmarks/deployed_spread.py runs/quick --seeds 0 1 2 3 4

The deployed recipe (``training.evaluation.deployable.deploy``: the same detector, attacks, synthetic
outliers, features, FPR target and confidence) is fitted, calibrated and measured once per split
seed on the same run's cached features; the bundle is seed 0. One row per seed (threshold,
held-out clean FPR, each attack's successful held-out images flagged, each OOD set flagged), then
mean and standard deviation over the seeds: the spread a single run's figure sits in. It reads
the test side of every split to report it, and chooses nothing. Each seed's rates are kept in
``--out`` (default ``RUN/deployed_spread.json``), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from detector import artefacts
from training.evaluation.context import PipelineRun
from training.evaluation.deployable import deploy
from training.reporting.report import markdown_table


def measure(run: PipelineRun, detector: str, seed: int) -> dict[str, Any]:
    """The deployed recipe's threshold and held-out rates (%) on split ``seed``."""
    deployed = deploy(run, detector, seed)
    heldout = deployed.heldout()
    rates = {"threshold": deployed.calibration.threshold, "clean FPR": 100 * heldout["fpr"]}
    rates.update({k: 100 * v for k, v in heldout["successful_flag_rate"].items() if v is not None})
    rates.update({k: 100 * v for k, v in heldout["flag_rate"].items() if k.startswith("ood-")})
    return {"rates": rates, "n_successful": heldout["n_successful"]}


def spread_table(by_seed: dict[str, dict[str, Any]]) -> str:
    columns = list(next(iter(by_seed.values()))["rates"])
    rows = [
        [seed, *(f"{entry['rates'][c]:.3f}" if c == "threshold" else f"{entry['rates'][c]:.2f}"
                 for c in columns)]
        for seed, entry in by_seed.items()
    ]  # fmt: skip
    values = np.array([[entry["rates"][c] for c in columns] for entry in by_seed.values()])
    rows.append(["mean", *(f"{v:.2f}" for v in values.mean(0))])
    rows.append(["std", *(f"{v:.2f}" for v in values.std(0, ddof=1 if len(values) > 1 else 0))])
    rows.append(["min", *(f"{v:.2f}" for v in values.min(0))])
    return markdown_table(["split seed", *columns], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished pipeline run directory (its features are read)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--detector", default=None, help="default: the config's deploy_detector")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = PipelineRun.open(args.run, progress=False)
    detector = args.detector or run.config.deploy_detector
    out = args.out or Path(args.run) / "deployed_spread.json"
    by_seed: dict[str, dict[str, Any]] = artefacts.read_json(out) if out.is_file() else {}
    for seed in args.seeds:
        key = f"{detector} {seed}"
        if key not in by_seed:
            by_seed[key] = measure(run, detector, seed)
            artefacts.write_json(out, by_seed)
        print(f"seed {seed}: successful held-out images per attack {by_seed[key]['n_successful']}")
    print(f"\n{detector}: held-out rates per split seed (%), threshold at the calibrated FPR\n")
    print(spread_table({k.split()[-1]: by_seed[k] for k in by_seed if k.split()[0] == detector}))


if __name__ == "__main__":
    main()
