"""Cost of the transport features and of the detector, in one run, on resnet9_mnist.

Prints:
1. (forward + transport features) / (plain forward) time at batch 256 (target <= 1.03);
2. transport vs Mahalanobis feature extraction time on the same 1000 images (target >= 5x);
3. scikit-learn ``predict_proba`` (1 and 256 samples) vs the TensorForest, and the detector's
   share of the Guard's batch time at batch 256 (target <= 10%);
4. with ``--bundle B``: the same share for the detector a bundle ships (e.g. the quick preset's
   ensemble of forests + clean-only parts, on the feature set the run chose), and the bundle's
   Guard time over the network's plain forward (what the feature groups cost in all).

Repetitions of the things compared are interleaved and medians taken, so background load hits
both alike; still, run it alone: other jobs on the same cores distort timings. Uses the trained
network in runs/quick/models/lap (``--network``) when it exists, else default-initialized weights.
``--small`` runs in seconds on a small network (the smoke run's), for the tests.

    python -m benchmarks.feature_overhead [--repeats 15] [--threads N] [--device auto]
    python -m benchmarks.feature_overhead --small --network RUN/models/lap --bundle RUN/bundle
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks import small
from detector import networks
from detector.features import TransportFeatureExtractor, extract_features
from detector.forest import TransportDetector
from detector.guard import Guard
from detector.mahalanobis import MahalanobisDetector

TRAINED = Path("runs/quick/models/lap")


def _network(device: torch.device, trained: Path) -> tuple[torch.nn.Module, str]:
    if (trained / networks.WEIGHTS_FILE).is_file() and (trained / networks.CONFIG_FILE).is_file():
        return networks.load(trained, device=device), f"trained ({trained})"
    torch.manual_seed(0)
    config = networks.NetworkConfig(
        architecture="resnet9_mnist",
        class_names=[str(i) for i in range(10)],
        input_spec=networks.InputSpec(channels=1, height=28, width=28, mean=[0.2860], std=[0.3530]),
    )
    return networks.build_network(config).to(
        device
    ).eval(), f"default-initialized (no trained network in {trained})"


def _images(n: int, split: str) -> tuple[np.ndarray, np.ndarray, str]:
    try:
        from training.data.datasets import load_dataset, to_arrays

        x, y = to_arrays(load_dataset("fashion-mnist", split), n, seed=0)
        return x, y, "Fashion-MNIST"
    except Exception:  # noqa: BLE001 - any missing data falls back to noise, and says so
        rng = np.random.default_rng(0 if split == "train" else 1)
        return (
            rng.random((n, 1, 28, 28), dtype=np.float32),
            rng.integers(0, 10, n),
            "uniform noise (no data found)",
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _interleaved(
    functions: dict[str, Callable[[], object]], repeats: int, device: torch.device
) -> dict[str, tuple[float, float]]:
    """(median wall time, median CPU time of this process) of each function, the functions run
    in turn ``repeats`` times. CPU time is less distorted than wall time when other jobs share
    the cores (it does not count time spent descheduled)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in functions}
    for function in functions.values():  # warm-up
        function()
    for _ in range(repeats):
        for name, function in functions.items():
            _sync(device)
            wall, cpu = time.perf_counter(), time.process_time()
            function()
            _sync(device)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        for name, values in times.items()
    }


def _ratio(t: dict[str, tuple[float, float]], top: str, bottom: str) -> str:
    return f"wall {t[top][0] / t[bottom][0]:.3f}, CPU {t[top][1] / t[bottom][1]:.3f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--bundle", type=Path, default=None, help="also time this bundle's detector"
    )
    parser.add_argument(
        "--network", type=Path, default=TRAINED, help=f"a trained network (default {TRAINED})"
    )
    parser.add_argument("--images", type=int, default=1000, help="images of each split")
    parser.add_argument("--batch", type=int, default=256, help="the batch of [1], [3]-[5]")
    parser.add_argument("--trees", type=int, default=100, help="trees per forest of [3]-[4]")
    parser.add_argument(
        "--small",
        action="store_true",
        help="seconds, not minutes: 128 images, batch 64, 10 trees, 2 repeats, 1 thread",
    )
    return small.parse(
        parser, argv, images=128, batch=64, trees=10, repeats=2, threads=small.threads_or_one
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = networks.resolve_device(args.device)
    model, origin = _network(device, args.network)
    x_test, _, data = _images(args.images, "test")
    x_train, y_train, _ = _images(args.images, "train")
    print(
        f"device {device}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} cores; network resnet9_mnist {origin}; images: {data}"
    )
    batch = torch.from_numpy(x_test[: args.batch]).to(device)
    _forward_share(model, batch, args.repeats, device)
    _extraction(model, x_train, y_train, x_test, args.repeats, device)
    _forests(model, x_test, batch, args.trees, args.repeats, device)
    if args.bundle is not None:
        _bundle_share(args.bundle, x_test[: args.batch], args.repeats, device)


def _forward_share(
    model: torch.nn.Module, batch: torch.Tensor, repeats: int, device: torch.device
) -> None:
    """[1] Forward + features vs plain forward."""

    def plain() -> object:
        with torch.inference_mode():
            return model(batch)

    def with_features() -> object:
        with torch.inference_mode(), TransportFeatureExtractor(model) as fx:
            model(batch)
            return fx.features()

    t = _interleaved({"plain": plain, "features": with_features}, repeats, device)
    print(
        f"[1] batch {len(batch)}: plain forward {t['plain'][0] * 1e3:.1f} ms (CPU {t['plain'][1] * 1e3:.1f}), "
        f"forward + transport features {t['features'][0] * 1e3:.1f} ms (CPU {t['features'][1] * 1e3:.1f}); "
        f"ratio {_ratio(t, 'features', 'plain')} (target <= 1.03)"
    )


def _extraction(
    model: torch.nn.Module,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    repeats: int,
    device: torch.device,
) -> None:
    """[2] Transport vs Mahalanobis feature extraction on the same images."""
    mahalanobis = MahalanobisDetector().fit_clean(model, x_train, y_train)
    extraction = {
        "transport": lambda: extract_features(model, x_test, batch_size=256),
        "mahalanobis_eps0": lambda: mahalanobis.mahalanobis_features(model, x_test, 0.0),
        "mahalanobis_eps0.0014": lambda: mahalanobis.mahalanobis_features(model, x_test, 0.0014),
    }
    t = _interleaved(extraction, max(3, repeats // 5), device)
    print(
        f"[2] {len(x_test)} images ({len(mahalanobis.layer_dims_)} Mahalanobis layers): transport features "
        f"{t['transport'][0]:.2f} s (CPU {t['transport'][1]:.2f}); Mahalanobis with input "
        f"pre-processing (eps 0.0014) {t['mahalanobis_eps0.0014'][0]:.2f} s (CPU "
        f"{t['mahalanobis_eps0.0014'][1]:.2f}) = {_ratio(t, 'mahalanobis_eps0.0014', 'transport')} x "
        f"(target >= 5x); without pre-processing (eps 0) {t['mahalanobis_eps0'][0]:.2f} s = "
        f"{_ratio(t, 'mahalanobis_eps0', 'transport')} x"
    )


def _forests(
    model: torch.nn.Module,
    x_test: np.ndarray,
    batch: torch.Tensor,
    trees: int,
    repeats: int,
    device: torch.device,
) -> None:
    """[3] Forest inference: sklearn vs TensorForest; [4] the detector's share of the Guard."""
    features, logits = extract_features(model, x_test, batch_size=256)
    rng = np.random.default_rng(0)
    noisy = np.clip(x_test + rng.normal(0, 0.1, x_test.shape), 0, 1).astype(np.float32)
    noisy_features, noisy_logits = extract_features(model, noisy, batch_size=256)
    detector = TransportDetector(n_estimators=trees, class_conditional=True).fit(
        np.concatenate([features, noisy_features]),
        np.r_[np.zeros(len(features)), np.ones(len(noisy_features))].astype(int),
        np.concatenate([logits, noisy_logits]).argmax(1),
    )
    module = detector.to_torch().to(device)
    n = len(batch)
    f_n = torch.from_numpy(features[:n]).to(device)
    p_n = torch.from_numpy(logits[:n].argmax(1)).to(device)

    def tensor_forest(k: int) -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                return module(f_n[:k], p_n[:k])

        return run

    forest = detector.forest_
    assert forest is not None
    t = _interleaved(
        {
            "sk1": lambda: forest.predict_proba(features[:1]),
            "skn": lambda: forest.predict_proba(features[:n]),
            "sk_scoren": lambda: detector.score(features[:n], logits[:n].argmax(1)),
            "tf1": tensor_forest(1),
            "tfn": tensor_forest(n),
        },
        repeats,
        device,
    )
    n_forests = 1 + len(detector.class_forests_)
    ms = {name: wall * 1e3 for name, (wall, _) in t.items()}
    print(
        f"[3] forests: {n_forests} x {trees} trees (general + per class), deepest tree "
        f"{int(detector.arrays_['depth'][0])}; wall times: sklearn predict_proba (general forest "
        f"only) 1 sample {ms['sk1']:.1f} ms, {n} samples {ms['skn']:.1f} ms; sklearn "
        f"class-conditional score {n} {ms['sk_scoren']:.1f} ms; TensorForest class-conditional "
        f"1 sample {ms['tf1']:.2f} ms, {n} samples {ms['tfn']:.1f} ms"
    )

    guard = Guard.from_run(model, detector, 0.5, device=device)
    guard.warmup((n,))
    t = _interleaved(
        {"guard": lambda: guard.predict(batch), "detector": tensor_forest(n)}, repeats, device
    )
    print(
        f"[4] Guard.predict batch {n} {t['guard'][0] * 1e3:.1f} ms (CPU {t['guard'][1] * 1e3:.1f}), "
        f"detector module alone {t['detector'][0] * 1e3:.1f} ms (CPU {t['detector'][1] * 1e3:.1f}): "
        f"share wall {100 * t['detector'][0] / t['guard'][0]:.1f}%, "
        f"CPU {100 * t['detector'][1] / t['guard'][1]:.1f}% (target <= 10%)"
    )


def _bundle_share(bundle: Path, images: np.ndarray, repeats: int, device: torch.device) -> None:
    """[5] The shipped detector module's share of its own Guard's batch time (a batch of
    ``images``)."""
    guard = Guard.from_bundle(bundle, device=device)
    guard.warmup((len(images),))
    batch = torch.from_numpy(images).to(device)
    with torch.inference_mode(), guard._extractor as fx:
        logits = guard.model(batch)
        features, predicted = fx.features(), logits.argmax(1)

    def detector() -> object:
        with torch.inference_mode():
            return guard.detector_module(features, predicted)

    def plain() -> object:
        with torch.inference_mode():
            return guard.model(batch)

    t = _interleaved(
        {"guard": lambda: guard.predict(batch), "detector": detector, "plain": plain},
        repeats,
        device,
    )
    spec = guard.manifest.detector if guard.manifest is not None else None
    label = spec.feature_spec.label() if spec else "?"
    print(
        f"[5] bundle {bundle} ({spec.kind if spec else '?'}, {len(guard.feature_names)} features, "
        f"{label}): Guard.predict batch {len(images)} {t['guard'][0] * 1e3:.1f} ms, detector module "
        f"{t['detector'][0] * 1e3:.1f} ms: share wall {100 * t['detector'][0] / t['guard'][0]:.1f}%, "
        f"CPU {100 * t['detector'][1] / t['guard'][1]:.1f}% (target <= 10%); the network's plain "
        f"forward {t['plain'][0] * 1e3:.1f} ms: Guard / plain forward {_ratio(t, 'guard', 'plain')} "
        "(every feature group, the squeeze group's extra passes and the second network's pass "
        "included, and the detector)"
    )


if __name__ == "__main__":
    main()
