"""Adaptive-attack experiments on a finished run: targets, starting images, cached batches, rows.

For network ``name``, target ``spec`` and adaptive attack ``attack``:

1. the starting images are the first ``n`` test-side images (seed-0 split) of the run's test-image
   order; the start attack (CW for the seed's two attacks, BIM at the attack's ε for the
   surrogate ones) runs on them through the attack store (cached);
2. the attack's pool is the starting images whose start image fools the network and is flagged
   by the target (detected successful); at most ``limit`` of them are attacked, in cached batches
   under ``RUN/adaptive/<network>/<target>/<attack>-<key>/`` (resumable, keyed by everything
   that determines them);
3. the row: the evasion rate (share of the attacked pool turned into undetected successful
   images, judged by a fresh query to the target), the final detection rate of successful
   images, perturbation sizes (to the clean image) and seconds per attacked image.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detector import artefacts
from training.adaptive.attacks import Attacker, get_adaptive_spec, run_adaptive
from training.adaptive.surrogate import agreement, distill
from training.adaptive.target import Target, TargetSpec, fit_target
from training.attacks import sets as adversarial
from training.attacks.registry import network_config
from training.evaluation.context import PipelineRun
from training.evaluation.deployable import SPLIT_SEED, equal_shares
from training.evaluation.protocols import Split, concat
from training.rundir import ADAPTIVE_ROW_FILE

REFERENCE_IMAGES = 2000
START_ATTACKS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "cw": ("cw-batched", {}),
    "bim": ("bim", None),
}


@dataclass(frozen=True)
class Start:
    """Clean starting images, their labels and source indices, and the start attack's images."""

    x: np.ndarray
    y: np.ndarray
    indices: np.ndarray
    x_start: np.ndarray
    key: str


def starting_images(run: PipelineRun, name: str, n: int) -> tuple[np.ndarray, ...]:
    """(images, labels, indices) of the first ``n`` test-side images of network ``name``."""
    x, y, indices = run.test_images(name)
    clean = run.samples(name).clean
    split = Split(SPLIT_SEED, run.config.test_fraction, int(clean.indices.max()) + 1)
    rows = np.flatnonzero(split.is_test[indices])[:n]
    return x[rows], y[rows], indices[rows]


def start_set(run: PipelineRun, name: str, kind: str, eps: float | None, n: int) -> Start:
    """The start attack ``kind`` ('cw' or 'bim' at ``eps``) on the starting images (cached)."""
    x, y, indices = starting_images(run, name, n)
    attack, params = START_ATTACKS[kind]
    params = params if params is not None else {"eps": eps}
    found = adversarial.get_or_generate(
        run.dir.adaptive(name) / "starts",
        run.dir.model(name),
        x,
        y,
        indices,
        attack,
        params,
        seed=0,
        device=run.config.device,
        progress=run.progress,
    )
    return Start(x, y, indices, found.x_adv, str(found.manifest["key"]))


def build_attacker(run: PipelineRun, name: str, target: Target, *, surrogate: bool) -> Attacker:
    """The attacker's knowledge, all from the training side: clean reference images (starts of
    the black-box searches, feature scales) and, when asked, the surrogate distilled from the
    target's mean member margin on clean + attacked training rows (with its agreement)."""
    data = run.samples(name, target.spec.detector)  # in the columns the target reads
    split = Split(SPLIT_SEED, run.config.test_fraction, int(data.clean.indices.max()) + 1)
    rng = np.random.default_rng(SPLIT_SEED)
    clean = split.train(data.clean)
    reference = clean.subsample(REFERENCE_IMAGES, rng)
    served = target.detectors[0].serving_rows  # the columns the target's Guard computes
    attacker = Attacker(
        run.model(name), target, reference.images, served(reference), reference.predicted
    )
    if surrogate:
        attacked = equal_shares([split.train(a) for a in data.attacks.values()], seed=SPLIT_SEED)
        rows = concat([clean, attacked])
        features = served(rows)
        margins = target_margins(target, features, rows.predicted)
        classes = network_config(attacker.model).num_classes
        attacker.surrogate = distill(features, rows.predicted, margins, classes)
        attacker.surrogate_agreement = agreement(
            attacker.surrogate, features, rows.predicted, margins
        )
    return attacker


def target_member_margins(
    target: Target, features: np.ndarray, predicted: np.ndarray
) -> np.ndarray:
    """Every member's ``score - threshold`` (> 0: flagged) of feature rows, [N, members]."""
    device = target.guard.device
    with torch.inference_mode():
        margins = target.pool.margins(
            torch.from_numpy(features).to(device), torch.from_numpy(predicted).to(device)
        )
    return margins.cpu().numpy()


def target_margins(target: Target, features: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """The target's mean member ``score - threshold`` (> 0: flagged) of feature rows."""
    return target_member_margins(target, features, predicted).mean(axis=1)


def evasion_metrics(
    y: np.ndarray,
    start: tuple[np.ndarray, np.ndarray],
    final: tuple[np.ndarray, np.ndarray],
    attacked: np.ndarray,
) -> dict[str, Any]:
    """Counts and rates from (labels, flags) of the start images and of the final images (the
    attack's result on ``attacked`` rows, the start image elsewhere), for true labels ``y``.

    evasion_rate: among attacked rows (detected successful starts), the share whose final image
    fools the network and is not flagged; final_detection_rate: among the covered rows (every
    row outside the pool, plus the attacked ones) whose final image fools the network, the
    share flagged; start_detection_rate: the same for the start images."""
    start_labels, start_flagged = start
    final_labels, final_flagged = final
    success = start_labels != y
    pool = success & start_flagged
    covered = ~pool | attacked
    final_success = (final_labels != y) & covered
    evaded = (final_labels != y) & ~final_flagged & attacked
    n_attacked = int(attacked.sum())
    return {
        "n_start": len(y),
        "n_successful_start": int(success.sum()),
        "n_detected_successful": int(pool.sum()),
        "n_attacked": n_attacked,
        "n_evaded": int(evaded.sum()),
        "evasion_rate": float(evaded.sum() / n_attacked) if n_attacked else None,
        "start_detection_rate": float(start_flagged[success].mean()) if success.any() else None,
        "final_detection_rate": (
            float(final_flagged[final_success].mean()) if final_success.any() else None
        ),
    }


def perturbation_metrics(x: np.ndarray, x_final: np.ndarray) -> dict[str, float | None]:
    """Median and mean L2 and L∞ distances of ``x_final`` to the clean ``x``."""
    if not len(x):
        return {k: None for k in ("median_l2", "mean_l2", "median_linf", "mean_linf")}
    delta = (x_final - x).reshape(len(x), -1).astype(np.float64)
    l2, linf = np.linalg.norm(delta, axis=1), np.abs(delta).max(axis=1)
    return {
        "median_l2": float(np.median(l2)),
        "mean_l2": float(l2.mean()),
        "median_linf": float(np.median(linf)),
        "mean_linf": float(linf.mean()),
    }


def _attack_batches(
    out: Path, attacker: Attacker, attack: str, params: dict[str, Any], start: Start,
    rows: np.ndarray, batch_size: int,
) -> tuple[np.ndarray, float]:  # fmt: skip
    """The attack's images of ``rows`` and the seconds they took, batch by cached batch."""
    results, seconds = [], 0.0
    for b, first in enumerate(range(0, len(rows), batch_size)):
        part = rows[first : first + batch_size]
        path = out / f"batch-{b:04d}.npz"
        saved = artefacts.load_cache(path, ("rows", "x_adv", "seconds"))
        if saved is not None and np.array_equal(saved["rows"], part):
            results.append(saved["x_adv"])
            seconds += float(saved["seconds"])
            continue
        started = time.perf_counter()
        x_adv = run_adaptive(
            attack, attacker, start.x[part], start.x_start[part], start.y[part], params, seed=b
        )
        took = time.perf_counter() - started
        artefacts.save_npz(path, rows=part, x_adv=x_adv, seconds=np.array(took))
        results.append(x_adv)
        seconds += took
    empty = np.zeros((0, *start.x.shape[1:]), np.float32)
    return (np.concatenate(results) if results else empty), seconds


def run_attack(
    run: PipelineRun, name: str, target: Target, attacker: Attacker, attack: str,
    params: dict[str, Any] | None = None, *, n: int = 200, limit: int | None = None,
    batch_size: int = 10,
) -> dict[str, Any]:  # fmt: skip
    """Attack ``attack`` on network ``name``'s target: the row of :func:`evasion_metrics`,
    :func:`perturbation_metrics`, cost, budget and parameters."""
    spec = get_adaptive_spec(attack)
    resolved = spec.make_params(params).model_dump(mode="json")
    start = start_set(run, name, spec.start, resolved.get("eps"), n)
    start_verdict = target.flagged(start.x_start)
    pool = np.flatnonzero((start_verdict[0] != start.y) & start_verdict[1])
    rows = pool[:limit] if limit is not None else pool
    key = artefacts.sha256_json(
        {"attack": attack, "params": resolved, "start": start.key, "pool": pool.tolist()}
    )[:16]  # not the limit: a larger --limit reuses the batches already done
    out = run.dir.adaptive(name) / target.spec.label / f"{attack}-{key}"
    x_adv, seconds = _attack_batches(out, attacker, attack, resolved, start, rows, batch_size)
    x_final = start.x_start.copy()
    x_final[rows] = x_adv
    attacked = np.zeros(len(start.y), dtype=bool)
    attacked[rows] = True
    row = {
        "model": name,
        "target": target.spec.label,
        "attack": attack,
        "start_attack": START_ATTACKS[spec.start][0],
        "budget": _budget(resolved),
        **evasion_metrics(start.y, start_verdict, target.flagged(x_final), attacked),
        **perturbation_metrics(start.x[rows], x_adv),
        "start_median_l2": perturbation_metrics(start.x[rows], start.x_start[rows])["median_l2"],
        "seconds_per_image": seconds / len(rows) if len(rows) else None,
        "target_fpr": run.config.target_fpr,
        "thresholds": [c.threshold for c in target.calibrations],
        "calibrated_fpr": [c.achieved_fpr for c in target.calibrations],
        "params": resolved,
    }
    if attacker.surrogate is not None and attack.startswith("surrogate"):
        row["surrogate_agreement"] = attacker.surrogate_agreement
    if target.spec.members > 1 and len(rows):
        row["member_evasion_rate"] = member_evasion(attacker, x_adv, start.y[rows])
    parts = part_flags(attacker, start.x_start[rows], x_adv)
    if parts:
        row["parts"] = parts
    artefacts.write_json(out / ADAPTIVE_ROW_FILE, row)
    return row


def member_evasion(attacker: Attacker, x_adv: np.ndarray, y: np.ndarray) -> float:
    """The evasion rate a random draw gives in expectation: the share of (image, member) pairs
    where the image fools the network and the member passes it."""
    features, predicted = attacker.features(x_adv)
    passed = target_member_margins(attacker.target, features, predicted) <= 0
    return float(((predicted != y)[:, None] & passed).mean())


def part_flags(
    attacker: Attacker, x_start: np.ndarray, x_adv: np.ndarray
) -> dict[str, list[float]]:
    """Per part of a one-member target whose detector has parts (the ensemble): the share of
    the attacked start images and of their final images that the part alone flags at the
    target's threshold, ``{part: [start, final]}``; empty otherwise or without rows."""
    guard = attacker.target.guard
    if attacker.target.spec.members != 1 or not len(x_adv):
        return {}
    shares: dict[str, list[float]] = {}
    for images in (x_start, x_adv):
        for part, score in guard.part_scores(images).items():
            shares.setdefault(part, []).append(float(np.mean(score > guard.threshold)))
    return shares


def _budget(params: dict[str, Any]) -> str:
    if "eps" in params:
        return f"{params['norm']} eps={params['eps']:g}, {params['steps']} steps"
    if "max_eval" in params:
        return f"HSJ {params['max_iter']} it / {params['max_eval']} evals, {params['init']} start"
    return f"HSJ {params['hsj_max_iter']} it / {params['hsj_max_eval']} evals + L-BFGS"


def write_adaptive_rows(run: PipelineRun) -> list[dict[str, Any]]:
    """Refresh RUN/results.json's ``"adaptive"`` list from the rows on disk; returns it."""
    path = run.dir.results_file
    results = artefacts.read_json(path, what="results") if path.is_file() else {}
    results["adaptive"] = run.dir.adaptive_rows()
    artefacts.write_json(path, results)
    return results["adaptive"]


def adaptive_experiment(
    run: PipelineRun, name: str, spec: TargetSpec, attacks: Sequence[tuple[str, dict[str, Any]]],
    *, n: int = 200, limit: int | None = None, batch_size: int = 10,
) -> list[dict[str, Any]]:  # fmt: skip
    """Fit (or load) the target, then run each (attack, params) and record the rows."""
    target = fit_target(run, name, spec)
    white_box = any(a.startswith("surrogate") for a, _ in attacks)
    attacker = build_attacker(run, name, target, surrogate=white_box)
    rows = [
        run_attack(
            run, name, target, attacker, attack, params, n=n, limit=limit, batch_size=batch_size
        )  # fmt: skip
        for attack, params in attacks
    ]
    write_adaptive_rows(run)
    return rows
