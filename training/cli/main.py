"""The ``lapguard`` command line: the one module that parses arguments.

Each ``_run_*`` handler parses, then calls one library function and prints what it returns.
Every command imports its library code lazily, so ``lapguard serve``/``score`` work without the
training stack's heavy extras (ART, matplotlib). A command called with missing or conflicting
arguments raises ``UsageError``; every LapguardError is printed as one clear line and exits with
status 2 (like argparse's own usage errors); nothing half-done is left behind by the library code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence, Sized
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from detector.errors import ConfigError, LapguardError

Handler = Callable[[argparse.Namespace], int]


class UsageError(ConfigError):
    """A command was called with missing, malformed or conflicting arguments."""


def _print_lines(lines: Sequence[str]) -> int:
    print("\n".join(lines))
    return 0


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
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.cli.console import dataset_lines
    from training.data.datasets import load_dataset, prepare_fashion_mnist

    if args.list:
        return _print_lines(dataset_lines())
    if args.dataset == "fashion-mnist" and not args.download:
        print(f"Fashion-MNIST ready in {prepare_fashion_mnist(args.root)}")
    for split in ("train", "test"):
        dataset = load_dataset(args.dataset, split, root=args.root, download=args.download)
        assert isinstance(dataset, Sized)  # torchvision's data sets have a length
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
    p.add_argument(
        "--monitor",
        action="store_true",
        help="record per epoch the layer-wise W-distances (seed 000) and the ICS (seed 004) "
        "in metrics.jsonl and training_curve.png (default: the config's monitors)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.cli.console import train_preset_lines
    from training.cli.launch import is_main_process, resolve_train_config
    from training.trainer.loop import train

    if args.list_presets:
        return _print_lines(train_preset_lines())
    if args.preset is None and args.config is None:
        raise UsageError("train needs --preset NAME or --config FILE (see --list-presets)")
    overrides = {"device": args.device, "epochs": args.epochs, "seed": args.seed}
    if args.monitor:
        overrides["monitors"] = {}  # MonitorSettings' defaults
    config = resolve_train_config(preset=args.preset, config_file=args.config, overrides=overrides)
    out = args.out or Path("runs") / config.name
    last = train(config, out, root=args.root, progress=not args.no_progress)
    if is_main_process():  # under torchrun: one summary (rank 0's), not one per rank
        print(json.dumps({"out": str(out), **last}, indent=2))
    return 0


# ---- import (the user's own network) ---------------------------------------------------------
def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="make a network directory from your own torchvision/timm classifier and weights "
        "file (no training)",
        description="Writes OUT (model.safetensors + config.json), which attacks, detectors, "
        "bundles and the server read like a network lapguard trained. What is not given comes "
        "from the architecture (its input size, normalization and resize of other sizes, the "
        "weights' class count, the residual taps of its blocks) and is printed. Nothing is "
        "written on any error.",
    )
    p.add_argument(
        "architecture",
        metavar="ARCH",
        help="torchvision:NAME or timm:NAME, e.g. torchvision:resnet18",
    )
    p.add_argument(
        "--weights",
        type=Path,
        metavar="FILE",
        help="FILE.safetensors, or a state dict saved with torch.save(model.state_dict(), FILE)",
    )
    p.add_argument(
        "--out", type=Path, metavar="DIR", help="the network directory to write (new or empty)"
    )
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a builder argument (read as int, float, true/false, else string), e.g. "
        "image_size=32; repeatable",
    )
    p.add_argument("--channels", type=int, default=None, metavar="C", help="image channels")
    p.add_argument("--input-size", type=int, nargs="+", metavar="N", help="S (square) or H W")
    p.add_argument("--mean", type=float, nargs="+", metavar="M", help="one per channel, in [0, 1]")
    p.add_argument("--std", type=float, nargs="+", metavar="S", help="one per channel")
    p.add_argument(
        "--resize-to",
        type=int,
        default=None,
        metavar="N",
        help="uploads of another size: the shorter side to N, then the centre crop (default: "
        "the architecture's eval transform, e.g. torchvision's 256 then 224)",
    )
    p.add_argument(
        "--crop",
        choices=("center", "none"),
        default=None,
        help="center: resize the shorter side then crop the centre; none: stretch to the input "
        "size (default: the architecture's)",
    )
    p.add_argument("--classes", nargs="+", metavar="NAME", help="class names, in logit order")
    p.add_argument(
        "--num-classes",
        type=int,
        default=None,
        metavar="N",
        help="class count (names 0..N-1; default: the weights')",
    )
    p.add_argument(
        "--taps",
        nargs="+",
        metavar="PATTERN",
        help="glob patterns over module names whose outputs are the residual branches, e.g. "
        "'layer*.*.bn2' (default: the known taps of torchvision/timm ResNet, ViT, ConvNeXt blocks)",
    )
    p.set_defaults(handler=_run_import)


def _builder_value(raw: str) -> object:
    """An ``--arg`` value: true/false, an int, a float, else the string itself."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _builder_arguments(pairs: Sequence[str]) -> dict[str, object]:
    arguments: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--arg expects KEY=VALUE, got {pair!r}")
        arguments[key.strip()] = _builder_value(raw.strip())
    return arguments


def _input_size(values: Sequence[int] | None) -> tuple[int, int] | None:
    if values is None:
        return None
    if len(values) not in (1, 2):
        raise UsageError(f"--input-size takes S or H W, got {len(values)} numbers")
    return (values[0], values[-1])


def _run_import(args: argparse.Namespace) -> int:
    # lazy: like every command, this one loads only what it needs
    from detector.importer import ImportRequest, import_network

    if args.weights is None or args.out is None:
        raise UsageError("import needs --weights FILE and --out DIR")
    request = ImportRequest(
        architecture=args.architecture,
        weights=args.weights,
        out=args.out,
        arguments=_builder_arguments(args.arg),
        channels=args.channels,
        size=_input_size(args.input_size),
        mean=tuple(args.mean) if args.mean else None,
        std=tuple(args.std) if args.std else None,
        class_names=tuple(args.classes) if args.classes else None,
        num_classes=args.num_classes,
        taps=tuple(args.taps) if args.taps else None,
        resize_to=args.resize_to,
        crop=args.crop,
    )
    return _print_lines(import_network(request).lines())


# ---- attack -----------------------------------------------------------------------------------------
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
    _add_attack_engine_flags(p)
    _add_adaptive_flags(p)
    p.set_defaults(handler=_run_attack)


def _add_adaptive_flags(p: argparse.ArgumentParser) -> None:
    """`attack --adaptive`: attacks that know the detector (the registry's adaptive section)."""
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="--attack names an adaptive attack on the network + detector system (--list "
        "--adaptive lists them); --n is the number of test-side starting images; results go "
        "to RUN/adaptive/ and results.json's 'adaptive' rows",
    )
    p.add_argument(
        "--target",
        default="transport",
        help="with --adaptive: the attacked detector, fitted on the training side (default transport)",
    )
    p.add_argument(
        "--pool",
        type=int,
        default=1,
        help="with --adaptive: a pool of POOL detectors drawn at random per query (default 1)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="with --adaptive: attack at most LIMIT of the detected successful images",
    )


def _add_attack_engine_flags(p: argparse.ArgumentParser) -> None:
    """`attack`'s flags for sharding batches over Ray."""
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local (default) or ray: batches sharded over Ray workers, the same set as a "
        "local run (pip install 'lapguard[ray]')",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster address (HOST:6379 or auto; default: a local Ray)",
    )
    p.add_argument(
        "--ray-workers",
        type=int,
        default=None,
        help="Ray workers with --engine ray (default and most: one per CPU of the cluster, "
        "or one per GPU when it has GPUs)",
    )


def _attack_params(pairs: Sequence[str], eps: float | None) -> dict[str, object]:
    """``--param KEY=VALUE`` pairs (values read as JSON, else kept as strings) and ``--eps``."""
    params: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--param expects KEY=VALUE, got {pair!r}")
        try:
            params[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            params[key.strip()] = raw
    if eps is not None:
        params["eps"] = eps
    return params


def _attack_engine(args: argparse.Namespace) -> AbstractContextManager:
    """The Ray engine `attack --engine ray` asks for (a context that stops a local Ray), or
    an empty context for the local engine; conflicting flags are a UsageError."""
    if args.engine == "local":
        if args.ray_address is not None or args.ray_workers is not None:
            raise UsageError("--ray-address and --ray-workers need --engine ray")
        return nullcontext()
    if args.workers != 1:
        raise UsageError("--workers sets local processes; with --engine ray use --ray-workers")
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.attacks.ray_engine import RayEngine

    return RayEngine(address=args.ray_address, workers=args.ray_workers)


def _run_attack(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.attacks.sets import attack_run
    from training.cli.console import attack_lines, attack_table

    if args.adaptive:
        return _run_adaptive(args)
    if args.list:
        return _print_lines(attack_lines())
    if args.run is None or args.attack is None:
        raise UsageError("attack needs --run DIR and --attack NAME (see --list)")
    with _attack_engine(args) as engine:
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
            engine=engine,
        )
    return _print_lines(attack_table(sets, args.attack))


def _run_adaptive(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.adaptive.experiment import adaptive_experiment
    from training.adaptive.target import TargetSpec
    from training.cli.console import adaptive_attack_lines, adaptive_table
    from training.evaluation.context import PipelineRun

    if args.list:
        return _print_lines(adaptive_attack_lines())
    if args.run is None or args.attack is None:
        raise UsageError("attack --adaptive needs --run DIR and --attack NAME (see --list)")
    _check_adaptive_flags(args)
    run = PipelineRun.open(args.run, root=args.root, progress=not args.no_progress)
    spec = TargetSpec(args.target, args.pool)
    rows = []
    for name in [args.model] if args.model else run.config.network_names:
        rows += adaptive_experiment(
            run,
            name,
            spec,
            [(args.attack, _attack_params(args.param, args.eps))],
            n=args.n,
            limit=args.limit,
            batch_size=args.batch_size if args.batch_size is not None else 10,
        )
    return _print_lines(adaptive_table(rows))


def _check_adaptive_flags(args: argparse.Namespace) -> None:
    """Refuse what ``attack --adaptive`` would ignore or misread: the set store's flags (it
    attacks the test side of the run's own split, in one process, at seed 0) and a batch size or
    limit under 1."""
    ignored = {
        "--engine ray": args.engine != "local",
        "--workers": args.workers != 1,
        "--ray-address": args.ray_address is not None,
        "--ray-workers": args.ray_workers is not None,
        "--split": args.split != "test",
        "--seed": args.seed != 0,
    }
    given = [flag for flag, set_ in ignored.items() if set_]
    if given:
        raise UsageError(f"attack --adaptive does not take {', '.join(given)}")
    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")


# ---- pipeline / fit / evaluate / report / bundle ------------------------------------------------
def _add_pipeline(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pipeline",
        help="train -> attack -> evaluate -> fit -> report -> bundle, cached and resumable",
    )
    p.add_argument("--preset", help="smoke, quick, paper-... (see --list-presets)")
    p.add_argument("--out", type=Path, help="run directory (default runs/<preset>)")
    p.add_argument(
        "--network",
        type=Path,
        default=None,
        help="protect this network (a `lapguard import` directory) instead of training the "
        "preset's: its steps run on it alone, on the preset's data set through its input spec",
    )
    p.add_argument(
        "--cost-budget",
        type=float,
        default=None,
        metavar="RATIO",
        help="Guard time / the network's plain forward time the chosen features may cost "
        "(default with --network: 1.10; a preset's own otherwise); raise it knowingly",
    )
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--list-presets", action="store_true", help="print the pipeline presets and exit"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only check the preset: names, data on disk, one forward pass per network; "
        "writes nothing",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_run_pipeline)


def _run_pipeline(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.cli.console import pipeline_preset_lines, pipeline_summary
    from training.pipeline.steps import preset_config, run_preset

    if args.list_presets:
        return _print_lines(pipeline_preset_lines())
    if not args.preset:
        raise UsageError("pipeline needs --preset NAME (see --list-presets)")
    config = preset_config(
        args.preset, device=args.device, network=args.network, cost_budget=args.cost_budget
    )
    if args.check:
        # lazy: `lapguard serve` and `score` run without the training stack
        from training.pipeline.preflight import check_pipeline

        return _print_lines(check_pipeline(config, root=args.root).lines())
    done = run_preset(config, args.out, root=args.root, progress=not args.no_progress)
    return _print_lines(pipeline_summary(config.name, done.run, done.seconds, done.results))


def detector_choices() -> list[str]:
    """The names ``lapguard fit --detector`` offers: the registered detectors that can ship."""
    # lazy: the registry loads torch, which `lapguard --help` does not need
    from detector.registry import list_detectors

    return list_detectors(servable=True)


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
        "--detector",
        default=None,
        choices=detector_choices(),
        help="a servable detector (default: the run config's deploy_detector)",
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
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.pipeline.steps import fit_run

    calibration = fit_run(
        args.run, detector=args.detector, root=args.root, progress=not args.no_progress
    )
    print(json.dumps(calibration, indent=2))
    return 0


def _run_evaluate(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.cli.console import detection_lines
    from training.pipeline.steps import evaluate_run

    result = evaluate_run(args.run, root=args.root, progress=not args.no_progress)
    return _print_lines(detection_lines(result["detection"]))


def _run_report(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.pipeline.steps import report_run

    print(report_run(args.run, root=args.root, progress=not args.no_progress))
    return 0


def _run_bundle(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.evaluation.deployable import write_run_bundle

    print(write_run_bundle(args.run, args.out))
    return 0


# ---- diagnose (network dynamics) --------------------------------------------------------------
def _add_diagnose(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="network dynamics of a run: line shape, OT score, layer-wise W-distances (seeds 000-004)",
    )
    p.add_argument("--run", type=Path, required=True, help="run directory holding models/<name>/")
    p.add_argument(
        "--preset",
        default=None,
        help="train the preset's networks into RUN first and measure the seeds' claims "
        "(preset: diagnose)",
    )
    p.add_argument("--model", default=None, help="only models/<MODEL> (default: every network)")
    p.add_argument("--n", type=int, default=1000, help="test images per set (default 1000)")
    p.add_argument("--attacks", action="store_true", help="also the run's cached adversarial sets")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_run_diagnose)


def _run_diagnose(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.cli.console import diagnose_lines
    from training.diagnostics.diagnose import DiagnoseOptions, diagnose_run, run_diagnose_preset
    from training.reporting.report import refresh_report

    if args.preset is not None:
        # lazy: `lapguard serve` and `score` run without the training stack
        from training.presets.pipelines import get_diagnose_preset

        if args.model or args.attacks or args.n != 1000:
            raise UsageError("--preset sets the networks and images; drop --model/--attacks/--n")
        config = get_diagnose_preset(args.preset)
        if args.device != "auto":
            config = config.model_copy(update={"device": args.device})
        result = run_diagnose_preset(
            config, args.run, root=args.root, progress=not args.no_progress
        )
        refresh_report(args.run)
        return _print_lines(diagnose_lines(result))
    result = diagnose_run(
        args.run,
        model=args.model,
        options=DiagnoseOptions(n=args.n, attacks=args.attacks),
        root=args.root,
        device=args.device,
        progress=not args.no_progress,
    )
    refresh_report(args.run)
    return _print_lines(diagnose_lines(result))


# ---- demo ------------------------------------------------------------------------------------
def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="serve a bundle on 127.0.0.1 at once (the smoke preset's, built in ~1 min) while "
        "the quick pipeline runs in the background, then switch to the quick bundle",
        description="Prints the page's address, runs (or reuses) the --first-preset pipeline and "
        "serves its bundle while the --preset pipeline runs in a subprocess (log and "
        "progress.json in its run directory); when that succeeds, the server switches to its "
        "bundle by itself. A finished --preset run is served directly. Ctrl-C stops both; "
        "running the command again resumes the background run.",
    )
    p.add_argument("--preset", default="quick", help="the final pipeline preset (default quick)")
    p.add_argument(
        "--out", type=Path, default=None, help="its run directory (default runs/<preset>)"
    )
    p.add_argument(
        "--first-preset",
        default="smoke",
        help="the preset served while --preset is built (default smoke; the same as --preset: "
        "that run is made or reused, then served, nothing runs in the background)",
    )
    p.add_argument(
        "--first-out",
        type=Path,
        default=None,
        help="its run directory (default runs/<first preset>)",
    )
    p.add_argument("--root", type=Path, default=None, help="data root")
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    p.add_argument(
        "--no-serve",
        action="store_true",
        help="run (or reuse) the --preset pipeline here, write its demo images, print the "
        "commands; do not serve",
    )
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    # lazy: `lapguard serve` and `score` run without the training stack
    from training.cli.demo import DemoOptions, run_demo

    options = DemoOptions(
        preset=args.preset,
        first_preset=args.first_preset,
        out=args.out,
        first_out=args.first_out,
        root=args.root,
        port=args.port,
        serve=not args.no_serve,
    )
    run_demo(options, say=lambda line: print(line, flush=True))
    return 0


# ---- serve (detection service) --------------------------------------------------------
def _add_target_fpr(p: argparse.ArgumentParser) -> None:
    """``--target-fpr``, the bundle's operating point ``serve`` and ``score`` flag at."""
    p.add_argument(
        "--target-fpr",
        type=float,
        default=None,
        help="flag at the bundle's operating point for this target FPR (one of its manifest's "
        "operating_points, e.g. 0.01; default: the target it was calibrated for)",
    )


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a bundle over HTTP: /v1/predict, KServe v2, /metrics (and KServe v2 over gRPC)",
        epilog="Every setting also reads LAPGUARD_<NAME> (e.g. LAPGUARD_API_KEY, LAPGUARD_MAX_BODY_BYTES).",
    )
    p.add_argument(
        "--bundle", type=Path, default=None, help="bundle directory (default $LAPGUARD_BUNDLE)"
    )
    p.add_argument("--host", default=None, help="interface (default $LAPGUARD_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default $LAPGUARD_PORT or 8000)")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the Open Inference Protocol over gRPC on this port (default "
        "$LAPGUARD_GRPC_PORT, else off; needs the grpc extra)",
    )
    p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N (default auto)")
    _add_target_fpr(p)
    p.add_argument("--max-batch-size", type=int, default=None, help="most images per forward pass")
    p.add_argument("--max-wait-ms", type=float, default=None, help="longest wait to fill a batch")
    p.add_argument("--max-queue", type=int, default=None, help="most images waiting before 429")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="threads of the forward pass (default: cores)",
    )
    p.add_argument(
        "--log-level", default=None, choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(handler=_run_serve)


SERVE_FLAGS = (
    "bundle",
    "host",
    "port",
    "grpc_port",
    "device",
    "target_fpr",
    "max_batch_size",
    "max_wait_ms",
    "max_queue",
    "torch_threads",
    "log_level",
)


def _run_serve(args: argparse.Namespace) -> int:
    # lazy: only this command needs the serving stack
    from service.server import serve
    from service.settings import load_settings

    serve(load_settings(**{name: getattr(args, name) for name in SERVE_FLAGS}))
    return 0


# ---- score (batch scoring) -------------------------------------------------------------
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
    _add_target_fpr(p)
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
    if args.dataset is None:
        if args.n is not None:
            raise ConfigError("--n limits --dataset; give --dataset NAME")
        return []
    if args.n is not None and args.n < 1:
        raise ConfigError(f"--n must be positive, got {args.n}")
    # lazy: only this command needs the serving stack and the data sets
    from service.batch import dataset_input
    from training.data.datasets import load_dataset

    dataset = load_dataset(args.dataset, args.split, root=args.root)
    return [dataset_input(f"{args.dataset}:{args.split}", dataset, args.n)]


def _run_score(args: argparse.Namespace) -> int:
    # lazy: only this command needs the serving stack
    from service.batch import ScoreRequest, score

    flags = (
        *("out", "bundle", "url", "engine", "batch_size", "workers", "device", "target_fpr"),
        *("ray_address", "concurrency", "retries", "timeout", "api_key", "retry_errors"),
    )
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
    _add_import,
    _add_train,
    _add_attack,
    _add_pipeline,
    _add_steps,
    _add_diagnose,
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
