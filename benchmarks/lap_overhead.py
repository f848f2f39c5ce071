"""Time of a LAP training epoch over a vanilla one, on the same data, in one run (target <= 1.05).

The residuals are already computed by the forward pass; LAP only adds sum(mean(r^2)) to the loss
and its backward. Epochs alternate (vanilla, LAP, vanilla, ...) and the medians are compared, so
background load affects both alike. Run alone: other jobs on 2 cores distort timings.

    python -m benchmarks.lap_overhead [--images 10000] [--repeats 3]
    python -m benchmarks.lap_overhead --small      # a narrow network, 128 images (the tests)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.utils.data import DataLoader

from benchmarks import small
from detector.networks import InputSpec, NetworkConfig, build_network, resolve_device
from training.data.datasets import dataset_info, load_dataset, subset
from training.trainer.initialization import init_weights
from training.trainer.loop import train_one_epoch
from training.trainer.losses import UzawaMultiplier


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10000, help="training images per epoch")
    parser.add_argument("--repeats", type=int, default=3, help="epochs of each objective")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--width", type=int, default=None, help="channels (default: resnet9's)")
    parser.add_argument("--depth", type=int, default=None, help="blocks (default: resnet9's)")
    parser.add_argument(
        "--small",
        action="store_true",
        help="seconds, not minutes: width 8, 2 blocks, 128 images, batch 64, one epoch each, "
        "1 thread",
    )
    return small.parse(parser, argv, images=128, repeats=1, batch_size=64, width=8, depth=2,
                       threads=small.threads_or_one)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    torch.manual_seed(0)
    info = dataset_info("fashion-mnist")
    data = subset(load_dataset("fashion-mnist", "train"), args.images, seed=0)
    # Materialize once so data loading is not part of what is compared.
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.tensor([int(data[i][1]) for i in range(len(data))])
    loader = DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=False
    )
    shape = {"width": args.width, "depth": args.depth}
    config = NetworkConfig(
        architecture="resnet9_mnist",
        arguments={name: value for name, value in shape.items() if value is not None},
        class_names=list(info.class_names),
        input_spec=InputSpec(**info.input_spec().model_dump()),
    )
    base = init_weights(build_network(config), "kaiming")

    times: dict[str, list[float]] = {"vanilla": [], "lap": []}
    for _ in range(args.repeats):
        for objective in ("vanilla", "lap"):
            model = copy.deepcopy(base).to(device)
            optimizer = torch.optim.SGD(
                model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4
            )
            multiplier = UzawaMultiplier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            train_one_epoch(
                model,
                loader,
                optimizer,
                objective,
                multiplier,
                device=device,
                grad_clip=5.0,
                progress=False,
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[objective].append(time.perf_counter() - start)

    vanilla, lap = statistics.median(times["vanilla"]), statistics.median(times["lap"])
    print(
        f"device: {device}, threads: {torch.get_num_threads()}, images/epoch: {len(data)}, "
        f"batch: {args.batch_size}, network: resnet9_mnist {config.arguments or 'as shipped'}"
    )
    print(
        f"vanilla epoch: median {vanilla:.2f}s  (all: {', '.join(f'{t:.2f}' for t in times['vanilla'])})"
    )
    print(f"LAP epoch:     median {lap:.2f}s  (all: {', '.join(f'{t:.2f}' for t in times['lap'])})")
    print(f"LAP / vanilla epoch time: {lap / vanilla:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
