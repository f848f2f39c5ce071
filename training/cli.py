"""The ``lapguard`` command line: the one module that parses arguments.

Every command imports its library code lazily, so ``lapguard serve``/``score`` work without the
training stack's heavy extras (ART, matplotlib). Library errors (LapguardError) are printed as one
clear line and exit with status 2; nothing half-done is left behind by the library code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from detector.errors import LapguardError

Handler = Callable[[argparse.Namespace], int]


# ---- data ------------------------------------------------------------------------------------
def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="lay out the embedded Fashion-MNIST (or download a data set)")
    p.add_argument("--root", type=Path, default=None, help="data root (default $LAPGUARD_DATA or ./data)")
    p.add_argument("--dataset", default="fashion-mnist", help="data set name (see --list)")
    p.add_argument("--download", action="store_true", help="download through torchvision (needs internet)")
    p.add_argument("--list", action="store_true", help="list the known data sets")
    p.set_defaults(handler=_run_data)


def _run_data(args: argparse.Namespace) -> int:
    from training.data import DATASETS, OOD_SETS, load_dataset, prepare_fashion_mnist

    if args.list:
        for name, info in sorted(DATASETS.items()):
            print(f"{name:15s} {info.channels}x{info.height}x{info.width}  {len(info.class_names)} classes")
        print(f"OOD sets: {', '.join(OOD_SETS)} (plus any data set above)")
        return 0
    if args.dataset == "fashion-mnist" and not args.download:
        raw = prepare_fashion_mnist(args.root)
        print(f"Fashion-MNIST ready in {raw}")
    for split in ("train", "test"):
        dataset = load_dataset(args.dataset, split, root=args.root, download=args.download)
        print(f"{args.dataset} {split}: {len(dataset)} images")
    return 0


# ---- train -----------------------------------------------------------------------------------
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a vanilla, LAP or RCE residual network")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", help="named preset (see --list-presets)")
    source.add_argument("--config", type=Path, help="TrainConfig JSON file")
    p.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    p.add_argument("--out", type=Path, help="output directory (default runs/<preset name>)")
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N (overrides the config)")
    p.add_argument("--epochs", type=int, default=None, help="override the number of epochs")
    p.add_argument("--seed", type=int, default=None, help="override the seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from training.config import read_train_config
    from training.presets import TRAIN_PRESETS, get_train_preset
    from training.trainer import train

    if args.list_presets:
        for name, preset in TRAIN_PRESETS.items():
            print(
                f"{name:36s} {preset.objective:8s} {preset.architecture:14s} {preset.dataset:14s} "
                f"epochs={preset.epochs} batch={preset.batch_size} lr={preset.lr}"
            )
        return 0
    if args.preset is None and args.config is None:
        raise LapguardError("train needs --preset NAME or --config FILE (see --list-presets)")
    config = get_train_preset(args.preset) if args.preset else read_train_config(args.config)
    updates = {k: v for k, v in (("device", args.device), ("epochs", args.epochs), ("seed", args.seed)) if v is not None}
    if updates:
        config = config.model_validate({**config.model_dump(), **updates})
    out = args.out or Path("runs") / config.name
    last = train(config, out, root=args.root, progress=not args.no_progress)
    print(json.dumps({"out": str(out), **last}, indent=2))
    return 0


# ---- attack (issue: attack generation) -------------------------------------------------------
# ---- fit / evaluate / report / pipeline (issue: detectors and evaluation) ---------------------
# ---- bundle / serve (issue: detection service) -----------------------------------------------
# ---- score (issue: batch scoring) -------------------------------------------------------------

PARSERS: list[Callable[[argparse._SubParsersAction], None]] = [_add_data, _add_train]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lapguard", description="Adversarial and OOD detection from residual-network transport dynamics."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except LapguardError as error:
        print(f"lapguard {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lapguard {args.command}: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
