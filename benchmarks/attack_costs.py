"""Success rate and cost of every attack on the quick Fashion-MNIST networks (vanilla and LAP).

Each attack runs on the first N test images of the seeded order (the same images for every
attack and network); sets go to a fresh temporary cache unless --cache is given, so the times are
generation times. Prints a markdown table. Run alone: other jobs on 2 cores distort timings.

    python -m benchmarks.attack_costs [--run runs/quick] [--n fgm=1000 cw=100 ...]
                                      [--param boundary.max_iter=1000 ...]
    python -m benchmarks.attack_costs --run RUN --small --cache DIR   # FGM only, on 8 images
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import small
from training.attacks.sets import get_or_generate
from training.data.network_images import attack_images
from training.rundir import RunDir

# (label, attack, parameter overrides, images). The seed's settings except where stated; the
# subset sizes keep the whole run near 20 minutes on 2 shared CPU cores (measured, light load: APGD
# ~0.12 s/image, CW ~1.4 s, DeepFool ~1.1 s, AutoAttack ~27 s, HopSkipJump ~10 s, Boundary
# ~15 s per 1000 iterations).
PLAN: list[tuple[str, str, dict[str, Any], int]] = [
    ("fgm", "fgm", {"eps": 0.03}, 1000),
    ("fgm", "fgm", {"eps": 0.1}, 1000),
    ("bim", "bim", {}, 1000),
    ("apgd", "apgd", {}, 1000),
    ("cw", "cw", {}, 20),
    ("deepfool", "deepfool", {}, 20),
    ("autoattack", "autoattack", {}, 4),
    ("hsj", "hsj", {}, 2),
    ("boundary", "boundary", {"max_iter": 500}, 2),  # 500 of the seed's 5000 iterations
]


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


#: ``--small`` runs FGM alone (milliseconds an image: what it checks is how a set is generated,
#: cached and summarized, not the attacks' costs), on :data:`SMALL_N` images each.
SMALL_ATTACKS, SMALL_N = ("fgm",), 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run", type=Path, default=Path("runs/quick"), help="run directory with models/"
    )
    parser.add_argument("--models", nargs="*", default=["vanilla", "lap"])
    parser.add_argument("--n", nargs="*", default=[], metavar="ATTACK=N", help="images per attack")
    parser.add_argument(
        "--param", nargs="*", default=[], metavar="ATTACK.KEY=VALUE", help="parameter override"
    )
    parser.add_argument(
        "--only", nargs="*", default=None, metavar="ATTACK", help="run only these attacks"
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help="cache folder (default: a fresh temporary one)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--small",
        action="store_true",
        help=f"seconds, not minutes: {', '.join(SMALL_ATTACKS)} on {SMALL_N} images each, 1 thread",
    )
    return small.parse(
        parser,
        argv,
        threads=small.threads_or_one,
        only=lambda args: [a for a in args.only or SMALL_ATTACKS if a in SMALL_ATTACKS],
        n=lambda args: [*args.n, *(f"{a}={SMALL_N}" for a in args.only)],
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    sizes = {k: int(v) for k, _, v in (item.partition("=") for item in args.n)}
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.param:
        target, _, raw = item.partition("=")
        attack, _, key = target.partition(".")
        overrides.setdefault(attack, {})[key] = _value(raw)
    plan = [
        (label, attack, {**params, **overrides.get(attack, {})}, sizes.get(attack, n))
        for label, attack, params, n in PLAN
        if args.only is None or attack in args.only
    ]

    cache = args.cache or Path(tempfile.mkdtemp(prefix="attack-costs-"))
    nets = {name: path for name, path in RunDir(args.run).networks().items() if name in args.models}
    rows = []
    started = time.perf_counter()
    for name, model_dir in nets.items():
        largest = max(n for *_, n in plan)
        x, y, indices = attack_images(model_dir, split="test", n=largest, seed=0)
        for label, attack, params, n in plan:
            adv = get_or_generate(
                cache / name,
                model_dir,
                x[:n],
                y[:n],
                indices[:n],
                attack,
                params,
                device=args.device,
                progress=False,
            )
            s = adv.summary()
            eps = adv.manifest["params"].get("eps", "-")
            shown = {k: v for k, v in params.items() if k != "eps"}
            rows.append(
                f"| {name} | {label}{' ' + json.dumps(shown) if shown else ''} | {eps} | {len(adv)} "
                f"| {s['clean_accuracy']:.3f} | {s['success_rate_on_correct']:.3f} | {s['success_rate']:.3f} "
                f"| {s['median_l2']:.3f} | {s['median_linf']:.4f} | {s['seconds_per_image']:.4f} |"
            )
            print(rows[-1], flush=True)
    print()
    print(
        "| network | attack | eps | n | clean acc. | success (orig. correct) | success (all) "
        "| median L2 | median Linf | s/image |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(
        f"\nmedians over successful samples; torch threads {torch.get_num_threads()}; device {args.device}; "
        f"total {time.perf_counter() - started:.0f} s; sets in {cache}"
    )


if __name__ == "__main__":
    main()
