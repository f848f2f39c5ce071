"""The ``lapguard`` command line: the one module that parses arguments.

Every command imports its library code lazily, so ``lapguard serve``/``score`` work without the
training stack's heavy extras (ART, matplotlib). Library errors (LapguardError) are printed as one
clear line and exit with status 2; nothing half-done is left behind by the library code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from detector.errors import LapguardError

Handler = Callable[[argparse.Namespace], int]


# ---- data ------------------------------------------------------------------------------------
def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="lay out the embedded Fashion-MNIST (or download a data set)")
    p.add_argument(
        "--root", type=Path, default=None, help="data root (default $LAPGUARD_DATA or ./data)"
    )
    p.add_argument("--dataset", default="fashion-mnist", help="data set name (see --list)")
    p.add_argument(
        "--download", action="store_true", help="download through torchvision (needs internet)"
    )
    p.add_argument("--list", action="store_true", help="list the known data sets")
    p.set_defaults(handler=_run_data)


def _run_data(args: argparse.Namespace) -> int:
    from training.data import DATASETS, OOD_SETS, load_dataset, prepare_fashion_mnist

    if args.list:
        for name, info in sorted(DATASETS.items()):
            print(
                f"{name:15s} {info.channels}x{info.height}x{info.width}  {len(info.class_names)} classes"
            )
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
    updates = {
        k: v
        for k, v in (("device", args.device), ("epochs", args.epochs), ("seed", args.seed))
        if v is not None
    }
    if updates:
        config = config.model_validate({**config.model_dump(), **updates})
    out = args.out or Path("runs") / config.name
    last = train(config, out, root=args.root, progress=not args.no_progress)
    if (
        os.environ.get("RANK", "0") == "0"
    ):  # under torchrun: one summary (rank 0's), not one per rank
        print(json.dumps({"out": str(out), **last}, indent=2))
    return 0


# ---- attack (issue: attack generation) -------------------------------------------------------
def _add_attack(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "attack", help="generate (or load cached) adversarial sets against a run's networks"
    )
    p.add_argument("--run", type=Path, help="run directory holding models/<name>/")
    p.add_argument("--attack", help="attack name (see --list)")
    p.add_argument(
        "--n",
        type=int,
        default=1000,
        help="first N images of a seeded order of the split (default 1000)",
    )
    p.add_argument("--eps", type=float, default=None, help="override the attack's eps")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a parameter (value read as JSON, else as a string); repeatable",
    )
    p.add_argument(
        "--split", default="test", choices=["train", "test"], help="data split (default test)"
    )
    p.add_argument(
        "--model", default=None, help="attack only models/<MODEL> (default: every network)"
    )
    p.add_argument(
        "--workers", type=int, default=1, help="worker processes (useful for hsj/boundary)"
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="images per batch (default per attack)"
    )
    p.add_argument("--seed", type=int, default=0, help="attack seed (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--list", action="store_true", help="print the registered attacks with their defaults"
    )
    p.set_defaults(handler=_run_attack)


def _attack_params(pairs: Sequence[str], eps: float | None) -> dict[str, object]:
    from detector.errors import ConfigError

    params: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--param expects KEY=VALUE, got {pair!r}")
        try:
            params[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            params[key.strip()] = raw
    if eps is not None:
        params["eps"] = eps
    return params


def _run_attack(args: argparse.Namespace) -> int:
    from detector.errors import ConfigError
    from training.adversarial import attack_run
    from training.attacks import attack_defaults, get_attack_spec, list_attacks

    if args.list:
        for name in list_attacks():
            spec = get_attack_spec(name)
            defaults = " ".join(f"{k}={v}" for k, v in attack_defaults(name).items())
            print(f"{name:11s} {spec.kind:10s} {spec.summary}\n{'':11s} {defaults}")
        return 0
    if args.run is None or args.attack is None:
        raise ConfigError("attack needs --run DIR and --attack NAME (see --list)")
    sets = attack_run(
        args.run,
        args.attack,
        _attack_params(args.param, args.eps),
        n=args.n,
        split=args.split,
        model=args.model,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        workers=args.workers,
        root=args.root,
        progress=not args.no_progress,
    )
    header = (
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
    rows = []
    for name, adv in sets.items():
        s = adv.summary()
        rows.append(
            (
                name,
                args.attack,
                str(len(adv)),
                f"{s['success_rate']:.3f}",
                f"{s['success_rate_on_correct']:.3f}",
                f"{s['median_l2']:.4f}",
                f"{s['median_linf']:.4f}",
                f"{s['seconds_per_image']:.4f}",
                f"{adv.path}{' (cached)' if adv.from_cache else ''}",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print("(median L2/Linf over successful samples; s/image = generation wall time / n)")
    return 0


# ---- pipeline / fit / evaluate / report / bundle ------------------------------------------------
def _add_pipeline(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pipeline",
        help="train -> attack -> evaluate -> fit -> report -> bundle, cached and resumable",
    )
    p.add_argument("--preset", help="smoke, quick, ... (see --list-presets)")
    p.add_argument("--out", type=Path, help="run directory (default runs/<preset>)")
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--list-presets", action="store_true", help="print the pipeline presets and exit"
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_run_pipeline)


def _run_pipeline(args: argparse.Namespace) -> int:
    from training.presets.pipelines import PIPELINE_PRESETS, get_pipeline_preset

    if args.list_presets:
        for name, preset in PIPELINE_PRESETS.items():
            attacks = ", ".join(f"{a.key}(n={a.n})" for a in preset.attacks)
            print(
                f"{name:8s} networks={list(preset.models.values())} detectors={preset.detectors} attacks: {attacks}"
            )
        return 0
    if not args.preset:
        raise LapguardError("pipeline needs --preset NAME (see --list-presets)")
    from training.pipeline import run_pipeline

    config = get_pipeline_preset(args.preset)
    if args.device:
        config = config.model_copy(update={"device": args.device})
    run = args.out or Path("runs") / config.name
    started = time.perf_counter()
    results = run_pipeline(config, run, root=args.root, progress=not args.no_progress)
    print(
        f"pipeline {config.name} finished in {time.perf_counter() - started:.0f}s: {run / 'report.md'}, bundle in {run / 'bundle'}"
    )
    for name, model in results["models"].items():
        print(f"  {name}: test accuracy {model['test_accuracy']:.4f}")
    return 0


def _add_run_step(
    sub: argparse._SubParsersAction, name: str, help_text: str
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text)
    p.add_argument("--run", type=Path, required=True, help="pipeline run directory")
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--no-progress", action="store_true")
    return p


def _add_steps(sub: argparse._SubParsersAction) -> None:
    p = _add_run_step(
        sub, "fit", "fit the deployable detector of a run and calibrate its threshold"
    )
    p.add_argument(
        "--detector", default="transport", choices=["transport", "mahalanobis", "nss", "quantile"]
    )
    p.set_defaults(handler=_run_fit)
    _add_run_step(
        sub, "evaluate", "run the seen/unseen/OOD detection protocols of a run"
    ).set_defaults(handler=_run_evaluate)
    _add_run_step(sub, "report", "write report.md, figures and results.json of a run").set_defaults(
        handler=_run_report
    )
    p = _add_run_step(sub, "bundle", "write the deployable bundle of a run")
    p.add_argument("--out", type=Path, default=None, help="bundle directory (default RUN/bundle)")
    p.set_defaults(handler=_run_bundle)


def _run_fit(args: argparse.Namespace) -> int:
    from training.pipeline import fit_deployable, read_pipeline_config

    if args.detector != "transport":
        raise LapguardError(
            f"{args.detector} is evaluated by `lapguard evaluate`; the deployable detector is transport"
        )
    out = fit_deployable(
        read_pipeline_config(args.run), args.run, root=args.root, progress=not args.no_progress
    )
    print(json.dumps(json.loads((out / "detector.json").read_text())["calibration"], indent=2))
    return 0


def _run_evaluate(args: argparse.Namespace) -> int:
    from training.pipeline import evaluate, read_pipeline_config

    result = evaluate(
        read_pipeline_config(args.run), args.run, root=args.root, progress=not args.no_progress
    )
    for row in result["detection"]:
        print(
            f"{row['model']:8s} {row['detector']:12s} {row['setting']:7s} {row['train_attack']:>12s} -> {row['test_attack']:12s} "
            f"accuracy {row['accuracy']:.4f} ± {row['accuracy_std']:.4f}  auroc {row['auroc']:.4f}"
        )
    return 0


def _run_report(args: argparse.Namespace) -> int:
    from training.pipeline import generate_attacks, read_pipeline_config, write_results
    from training.report import write_report

    config = read_pipeline_config(args.run)
    write_results(
        config,
        args.run,
        generate_attacks(config, args.run, root=args.root, progress=not args.no_progress),
    )
    print(write_report(args.run))
    return 0


def _run_bundle(args: argparse.Namespace) -> int:
    from training.pipeline import write_run_bundle

    print(write_run_bundle(args.run, args.out))
    return 0


# ---- demo ------------------------------------------------------------------------------------
def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="run (or reuse) the quick pipeline, then serve its bundle on 127.0.0.1"
    )
    p.add_argument("--preset", default="quick", help="pipeline preset (default quick)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/<preset>)")
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--no-serve",
        action="store_true",
        help="prepare everything, print the commands, do not serve",
    )
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from training.demo import write_demo_samples
    from training.pipeline import run_pipeline
    from training.presets.pipelines import get_pipeline_preset

    config = get_pipeline_preset(args.preset)
    run = args.out or Path("runs") / config.name
    run_pipeline(config, run, root=args.root)
    samples = write_demo_samples(config, run, run / "demo", root=args.root)
    url = f"http://127.0.0.1:{args.port}"
    print(
        f"\nreport: {run / 'report.md'}\nbundle: {run / 'bundle'}\n\nOnce the server says it is ready, try:"
    )
    for kind, path in samples.items():
        print(f"  curl -s -F files=@{path} {url}/v1/predict    # {kind} image")
    print(f"  curl -s {url}/readyz;  curl -s {url}/metrics | head\n")
    if args.no_serve:
        return 0
    from service.server import serve
    from service.settings import load_settings

    serve(load_settings(bundle=run / "bundle", host="127.0.0.1", port=args.port))
    return 0


# ---- serve (issue: detection service) --------------------------------------------------------
def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a bundle over HTTP: /v1/predict, KServe v2, /metrics",
        epilog="Every setting also reads LAPGUARD_<NAME> (e.g. LAPGUARD_API_KEY, LAPGUARD_MAX_BODY_BYTES).",
    )
    p.add_argument(
        "--bundle", type=Path, default=None, help="bundle directory (default $LAPGUARD_BUNDLE)"
    )
    p.add_argument("--host", default=None, help="interface (default $LAPGUARD_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default $LAPGUARD_PORT or 8000)")
    p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--max-batch-size", type=int, default=None, help="most images per forward pass")
    p.add_argument("--max-wait-ms", type=float, default=None, help="longest wait to fill a batch")
    p.add_argument("--max-queue", type=int, default=None, help="most images waiting before 429")
    p.add_argument(
        "--log-level", default=None, choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from service.server import serve
    from service.settings import load_settings

    flags = (
        "bundle",
        "host",
        "port",
        "device",
        "max_batch_size",
        "max_wait_ms",
        "max_queue",
        "log_level",
    )
    serve(load_settings(**{name: getattr(args, name) for name in flags}))
    return 0


# ---- score (issue: batch scoring) -------------------------------------------------------------
def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="score image files, folders, arrays or a data set into JSONL/CSV (resumable)",
        description="One output row per input: path (files) or index (arrays, data sets), then "
        "label, class_name, confidence, flagged, score, threshold; or error. Re-running the same "
        "command resumes an interrupted run.",
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="image files, folders (recursive), .npy/.npz arrays",
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="bundle directory, scored here (default $LAPGUARD_BUNDLE)",
    )
    target.add_argument(
        "--url", default=None, help="score on a running server instead, e.g. http://127.0.0.1:8000"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results.jsonl"),
        help="output file (default results.jsonl)",
    )
    p.add_argument(
        "--format",
        choices=["jsonl", "csv"],
        default=None,
        help="default: csv for a .csv --out, else jsonl",
    )
    _add_score_engine_flags(p)
    _add_score_dataset_flags(p)
    p.add_argument(
        "--retry-errors",
        action="store_true",
        help="score again the inputs whose rows hold an error",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_run_score)


def _add_score_engine_flags(p: argparse.ArgumentParser) -> None:
    """`score`'s flags for the engines: local, Ray and --url."""
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="images per forward pass (default 256), or per request with --url (default 32)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="data-loading processes, or Ray actors with --engine ray (default 2)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local (default) or ray (pip install 'lapguard[ray]')",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster address (HOST:6379 or auto; default: a local Ray)",
    )
    p.add_argument(
        "--concurrency", type=int, default=4, help="requests in flight with --url (default 4)"
    )
    p.add_argument(
        "--retries",
        type=int,
        default=5,
        help="retries of a request answered 429/503 or not connected (default 5)",
    )
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per request with --url (default 60)"
    )
    p.add_argument("--api-key", default=None, help="API key for --url (default $LAPGUARD_API_KEY)")


def _add_score_dataset_flags(p: argparse.ArgumentParser) -> None:
    """`score`'s flags naming a data set to score."""
    p.add_argument(
        "--dataset", default=None, help="also score a data set by name (see `lapguard data --list`)"
    )
    p.add_argument(
        "--split", default="test", choices=["train", "test"], help="data set split (default test)"
    )
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--n", type=int, default=None, help="only the first N images of the data set")


def _score_dataset(args: argparse.Namespace) -> list:
    """The data set named by --dataset (its first --n images) as a batch-scoring input."""
    from detector.errors import ConfigError

    if args.dataset is None:
        if args.n is not None:
            raise ConfigError("--n limits --dataset; give --dataset NAME")
        return []
    if args.n is not None and args.n < 1:
        raise ConfigError(f"--n must be positive, got {args.n}")
    from service.batch import dataset_input
    from training.data import load_dataset

    dataset = load_dataset(args.dataset, args.split, root=args.root)
    return [dataset_input(f"{args.dataset}:{args.split}", dataset, args.n)]


def _run_score(args: argparse.Namespace) -> int:
    from service.batch import ScoreRequest, score

    flags = ("out", "bundle", "url", "engine", "batch_size", "workers", "device", "ray_address")
    flags += ("concurrency", "retries", "timeout", "api_key", "retry_errors")
    request = ScoreRequest(
        inputs=[*args.inputs, *_score_dataset(args)],
        fmt=args.format,
        progress=not args.no_progress,
        **{name: getattr(args, name) for name in flags},
    )
    print(score(request))
    return 0


PARSERS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_data,
    _add_train,
    _add_attack,
    _add_pipeline,
    _add_steps,
    _add_demo,
    _add_serve,
    _add_score,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lapguard",
        description="Adversarial and OOD detection from residual-network transport dynamics.",
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
        print(
            f"lapguard {args.command}: interrupted; re-run the same command to resume",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
