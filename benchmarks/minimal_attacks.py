"""ART's CW-L2, DeepFool and APGD against our batched torch code, on the same images of a network.

For each pair (``cw`` / ``cw-batched``, ``deepfool`` / ``deepfool-batched``), ART runs with the
seed's parameters and the batched code with the parameters the quick preset gives it (CW:
``CPU_CW_PARAMS``, fewer binary-search steps from a larger c; ``--seed-params`` for the seed's
too). APGD (``apgd`` / ``apgd-batched``) runs once per ε of the quick preset's APGD sets, both
sides with that set's parameters (the random starts differ: ART draws its own). All run
on the first N test images of the seeded order (those of :mod:`benchmarks.attack_costs`), through
:func:`training.attacks.registry.generate`, without any cache. Prints a markdown table: success
rate on originally correct images, median L2 over the fooled ones, s/image, and the batched /
ART ratios, with the bar of docs/decisions.md, "Batched CW and DeepFool" (success within 3 points,
median L2 within 15%); then how far the two sets of images are apart (max |pixel difference|) and
how many images each leaves on the decision boundary (|top-2 logit margin| < 1e-4, where float
rounding decides "fooled": DeepFool's ART-default overshoot of 1e-6 leaves almost every image
there). Run alone: other jobs on 2 cores distort timings.

    python -m benchmarks.minimal_attacks runs/quick/models/vanilla [--n 200]
    python -m benchmarks.minimal_attacks RUN/models/lap --small   # 2 images, a set a pair
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import small
from detector.networks import load
from training.attacks.registry import generate, predict_labels
from training.data.network_images import attack_images
from training.presets.pipelines import get_pipeline_preset

PAIRS = [("cw", "cw-batched"), ("deepfool", "deepfool-batched"), ("apgd", "apgd-batched")]
#: Pairs whose ART side runs with the batched side's parameters (an ε-bounded attack).
SHARED_PARAMS = {"apgd"}


def preset_params(attack: str, preset: str = "quick") -> list[dict[str, Any]]:
    """The parameters of each set pipeline preset ``preset`` runs ``attack`` in ([{}]: none)."""
    runs = [a for a in get_pipeline_preset(preset).attacks if a.attack == attack]
    return [dict(run.params) for run in runs] or [{}]


def _label(attack: str, params: dict[str, Any]) -> str:
    return attack + "".join(f", {k}={v}" for k, v in params.items())


def measure(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    attack: str,
    *,
    params: dict[str, Any] | None = None,
    batch_size: int | None,
    device: str,
) -> tuple[float, float, float, np.ndarray]:
    """(success rate on originally correct images, median L2 of the fooled ones, s/image, images)."""
    started = time.perf_counter()
    adv = generate(
        model, x, y, attack, params, batch_size=batch_size, device=device, progress=False
    )
    seconds = (time.perf_counter() - started) / len(x)
    correct = predict_labels(model, x, device=device) == y
    fooled = correct & (predict_labels(model, adv, device=device) != y)
    l2 = np.linalg.norm((adv.astype(np.float64) - x).reshape(len(x), -1), axis=1)
    rate = fooled.sum() / max(int(correct.sum()), 1)
    median = float(np.median(l2[fooled])) if fooled.any() else float("nan")
    return float(rate), median, seconds, adv


def on_boundary(model: torch.nn.Module, x: np.ndarray, adv: np.ndarray, tol: float = 1e-4) -> int:
    """How many of ``adv`` lie within ``tol`` (logits) of the boundary of the class of ``x``."""
    with torch.no_grad():
        predicted = model(torch.as_tensor(x)).argmax(1, keepdim=True)
        z = model(torch.as_tensor(adv)).double()
    own = z.gather(1, predicted)[:, 0]
    margin = z.scatter(1, predicted, float("-inf")).max(1).values - own
    return int((margin.abs() < tol).sum())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a trained network's directory")
    parser.add_argument("--n", type=int, default=200, help="images (the same for every attack)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--art-batch", type=int, default=None, help="ART's batch size")
    parser.add_argument("--batched-batch", type=int, default=None, help="our batch size")
    parser.add_argument(
        "--only", choices=[art for art, _ in PAIRS], default=None, help="one pair only"
    )
    parser.add_argument(
        "--seed-params",
        action="store_true",
        help="run the batched code with the seed's parameters too, not the quick preset's",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="seconds, not minutes: 2 images, the last parameter set of each pair, 1 thread",
    )
    return small.parse(parser, argv, n=2, threads=small.threads_or_one)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load(args.model_dir)
    x, y, _ = attack_images(args.model_dir, split="test", n=args.n, seed=0)
    print(
        "| attack | success | median L2 | s/image | success diff (pts) | L2 ratio | speed-up | bar |"
    )
    print("|---|---|---|---|---|---|---|---|")
    notes = []
    for art, ours in PAIRS if args.only is None else [p for p in PAIRS if p[0] == args.only]:
        sets = [{}] if args.seed_params else preset_params(ours)
        for params in sets[-1:] if args.small else sets:
            art_params = params if art in SHARED_PARAMS else {}
            a = measure(
                model, x, y, art, params=art_params, batch_size=args.art_batch, device=args.device
            )
            b = measure(
                model, x, y, ours, params=params, batch_size=args.batched_batch, device=args.device
            )
            points, ratio = 100 * (b[0] - a[0]), b[1] / a[1]
            ok = abs(points) <= 3 and abs(ratio - 1) <= 0.15
            print(f"| {_label(art, art_params)} | {a[0]:.3f} | {a[1]:.4f} | {a[2]:.4f} | | | | |")
            print(
                f"| {_label(ours, params)} | {b[0]:.3f} | {b[1]:.4f} | {b[2]:.4f} | {points:+.1f} "
                f"| {ratio:.3f} | {a[2] / b[2]:.1f}x | {'met' if ok else 'MISSED'} |",
                flush=True,
            )
            gap = float(np.abs(a[3] - b[3]).max())
            boundary = (on_boundary(model, x, a[3]), on_boundary(model, x, b[3]))
            notes.append(
                f"{_label(art, art_params)}: max |pixel difference| batched vs ART {gap:.2e}; on "
                f"the boundary (|margin| < 1e-4): ART {boundary[0]}/{len(x)}, batched "
                f"{boundary[1]}/{len(x)}"
            )
    print("\n" + "\n".join(notes))
    print(
        f"n={len(x)}; medians over fooled, originally correct images; "
        f"torch threads {torch.get_num_threads()}; device {args.device}"
    )


if __name__ == "__main__":
    main()
