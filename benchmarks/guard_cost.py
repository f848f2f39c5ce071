"""What the Guard costs on a user's network: Guard time / the network's plain forward time at
batch 32, for a torchvision ResNet-50 at 224x224 RGB (default-initialized weights: the cost does
not depend on them) and the small ViT the imported-network presets use (3x32x32), each imported
with ``lapguard import`` and guarded by an ensemble detector on the richest feature set the
default cost budget (1.10) offers there (declared, then measured: each candidate's cost is
printed).

For each network it writes a bundle (which records the ratio measured when it was written) and
then measures the served bundle's Guard again, interleaved with the plain forward pass; it prints
both ratios and how far apart they are. The detector is fitted on the network's features of
seeded uniform images and their noised copies: what it detects does not matter here, only what
it costs. Run it alone: other jobs on the same cores distort timings.

    python -m benchmarks.guard_cost [--networks resnet50 vit] [--rounds 15] [--threads N]
    python -m benchmarks.guard_cost --small
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from benchmarks import small
from detector.bundle import write_bundle
from detector.calibration import Calibration
from detector.cost import (
    DEFAULT_BUDGET,
    feature_costs,
    measure_cost,
    noise_batch,
    within_measured_budget,
)
from detector.features import FeatureSpec, extract_features
from detector.guard import Guard
from detector.networks import load
from detector.registry import get_detector
from training.cli.main import main as lapguard
from training.evaluation.protocols import Samples
from training.presets.pipelines import get_pipeline_preset

#: The small ViT of the imported-network presets: 64 patches of 4x4, 6 blocks of width 192.
SMALL_VIT = {"image_size": 32, "patch_size": 4, "num_layers": 6, "num_heads": 3, "hidden_dim": 192}
TINY_VIT = {"image_size": 32, "patch_size": 8, "num_layers": 2, "num_heads": 2, "hidden_dim": 32}
# name: (ARCH, builder arguments, input size) at full size, then under --small
NETWORKS = {
    "resnet50": ("torchvision:resnet50", {}, 224),
    "vit": ("torchvision:VisionTransformer", {**SMALL_VIT, "mlp_dim": 768, "num_classes": 10}, 32),
}
SMALL_NETWORKS = {
    "resnet50": ("torchvision:resnet18", {"num_classes": 10}, 64),
    "vit": ("torchvision:VisionTransformer", {**TINY_VIT, "mlp_dim": 64, "num_classes": 10}, 32),
}


def _imported(arch: str, arguments: dict, size: int, folder: Path) -> Path:
    """Default-initialized weights of ``arch`` saved as safetensors, imported with the CLI."""
    from detector.zoo import build_zoo_model

    torch.manual_seed(0)
    model = build_zoo_model(arch, arguments)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "weights.safetensors"))
    command = ["import", arch, "--weights", str(folder / "weights.safetensors")]
    command += [f"--arg={k}={v}" for k, v in arguments.items()]
    assert lapguard([*command, "--input-size", str(size), "--out", str(folder / "net")]) == 0
    return folder / "net"


def default_budget_features(network: Path) -> tuple[FeatureSpec, dict[str, float]]:
    """The richest candidate (most columns) the quick preset offers on ``network`` under the
    default budget, declared and measured as a pipeline offers them: the dearest feature set a
    default pipeline can ship; and each declared candidate's measured cost."""
    config = get_pipeline_preset("quick").on_network(network, budget=DEFAULT_BUDGET)
    declared = config.affordable_candidates()
    model = load(network)
    costs = feature_costs(model, declared, noise_batch(model.config.input_spec))  # type: ignore[union-attr]
    offered = within_measured_budget(declared, costs, DEFAULT_BUDGET)
    richest = max(offered, key=lambda spec: len(spec.names(8)))
    return richest, {spec.label(): cost for spec, cost in zip(declared, costs, strict=True)}


def _bundle(network_dir: Path, spec: FeatureSpec, batch: int, out: Path) -> Path:
    """An ensemble on ``spec`` fitted on uniform images vs their noised copies (as many as its
    Gaussian part needs), bundled with the cost measured as the pipeline measures it."""
    model: nn.Module = load(network_dir)
    shape = model.config.input_spec.shape  # type: ignore[union-attr]
    names = tuple(spec.names(len(spec.tap_names(model))))
    n_fit = 2 * len(names) + 16
    rng = np.random.default_rng(0)
    clean = rng.random((n_fit, *shape), dtype=np.float32)
    noisy = np.clip(clean + rng.normal(0, 0.3, clean.shape), 0, 1).astype(np.float32)
    sets = []
    for name, images in (("clean", clean), ("noise", noisy)):
        features, logits = extract_features(model, images, spec=spec)
        predicted = logits.argmax(1)
        sets.append(
            Samples(name, images, features, predicted, np.arange(n_fit), feature_names=names)
        )
    detector = get_detector("ensemble").fit_samples(*sets)
    calibration = Calibration.from_scores(detector.score_samples(sets[0]), 0.1)
    guard = Guard.from_run(network_dir, detector, calibration, features=spec, device="cpu")
    cost = measure_cost(guard, noise_batch(guard.input_spec, batch), budget=DEFAULT_BUDGET)
    return write_bundle(
        out,
        network_dir=network_dir,
        detector=detector,
        calibration=calibration,
        name=f"cost-{network_dir.parent.name}",
        dataset="random",
        features=spec,
        cost=cost,
    )


def measure(name: str, args: argparse.Namespace, folder: Path) -> None:
    arch, arguments, size = (SMALL_NETWORKS if args.small else NETWORKS)[name]
    network = _imported(arch, arguments, size, folder)
    spec, costs = default_budget_features(network)
    listed = ", ".join(f"{label} {cost:.3f}" for label, cost in costs.items())
    print(f"{name}: candidates' (forward + features) / plain forward: {listed}")
    bundle = _bundle(network, spec, args.batch, folder / "bundle")
    guard = Guard.from_bundle(bundle, device="cpu")
    assert guard.manifest is not None and guard.manifest.cost is not None
    recorded = guard.manifest.cost.ratio
    again = measure_cost(guard, noise_batch(guard.input_spec, args.batch), rounds=args.rounds)
    apart = abs(recorded - again.ratio) / again.ratio
    print(
        f"{name}: {arch} at {size}x{size}, features {spec.label()} ({len(guard.feature_names)} "
        f"columns), batch {args.batch}: Guard / plain forward {again.ratio:.3f} "
        f"(budget {DEFAULT_BUDGET}); bundle recorded {recorded:.3f}, {100 * apart:.1f}% apart"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", nargs="+", choices=list(NETWORKS), default=list(NETWORKS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timings per side")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--small", action="store_true", help="a ResNet-18 at 64x64 and a tiny ViT, batch 8"
    )
    args = small.parse(parser, argv, batch=8, rounds=3, one_torch_thread=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="lapguard-cost-") as tmp:
        for name in args.networks:
            (Path(tmp) / name).mkdir()
            measure(name, args, Path(tmp) / name)


if __name__ == "__main__":
    main()
