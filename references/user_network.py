"""A user's network, trained the way a user would, outside lapguard: a torchvision ResNet-18 or a
small torchvision VisionTransformer on Fashion-MNIST as 3x32x32 colour images (grey copied to
three channels, stretched to 32x32, ImageNet normalization), with plain torch. It writes the
weights as a user ships them (``weights.safetensors`` and ``weights.pt``, a ``state_dict``) and
prints the ``lapguard import`` command that reads them; lapguard then protects the network
without knowing how it was trained.

    python -m references.user_network --arch resnet18 --epochs 1 --out networks/user-resnet18
    python -m references.user_network --arch vit --epochs 2 --out networks/user-vit
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torchvision
from safetensors.torch import save_file
from torch import nn
from torchvision.transforms import v2

#: The small ViT (as benchmarks/guard_cost.py measures it): 64 patches of 4x4, 6 blocks of 192.
VIT = {"image_size": 32, "patch_size": 4, "num_layers": 6, "num_heads": 3, "hidden_dim": 192,
       "mlp_dim": 768}  # fmt: skip
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def build(arch: str) -> tuple[nn.Module, list[str]]:
    """The untrained network and the ``lapguard import`` arguments that rebuild it."""
    if arch == "resnet18":
        return torchvision.models.resnet18(num_classes=10), ["torchvision:resnet18"]
    model = torchvision.models.VisionTransformer(**VIT, num_classes=10)
    return model, ["torchvision:VisionTransformer", *(f"--arg={k}={v}" for k, v in VIT.items())]


def data(root: Path, train: bool) -> torch.utils.data.Dataset:
    transform = v2.Compose([
        v2.Grayscale(3), v2.Resize((32, 32)), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])  # fmt: skip
    return torchvision.datasets.FashionMNIST(str(root), train=train, transform=transform)


def train(model: nn.Module, root: Path, epochs: int, batch_size: int, lr: float) -> None:
    loader = torch.utils.data.DataLoader(data(root, True), batch_size=batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * len(loader)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    model.train()
    for epoch in range(epochs):
        started, seen, correct = time.perf_counter(), 0, 0
        for x, y in loader:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            seen, correct = seen + len(y), correct + int((logits.argmax(1) == y).sum())
        took = time.perf_counter() - started
        print(f"epoch {epoch + 1}: train accuracy {correct / seen:.4f} ({took:.0f} s)")


@torch.no_grad()
def test_accuracy(model: nn.Module, root: Path) -> float:
    model.eval()
    loader = torch.utils.data.DataLoader(data(root, False), batch_size=500)
    correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in loader)
    return correct / len(loader.dataset)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=["resnet18", "vit"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--root", type=Path, default=Path("data"), help="holds FashionMNIST/raw")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=None, help="default: 2e-3 ResNet, 1e-3 ViT")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model, arch = build(args.arch)
    lr = args.lr or (2e-3 if args.arch == "resnet18" else 1e-3)
    train(model, args.root, args.epochs, args.batch_size, lr)
    print(f"test accuracy {test_accuracy(model, args.root):.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(args.out / "weights.safetensors"))
    torch.save(state, args.out / "weights.pt")
    classes = torchvision.datasets.FashionMNIST.classes
    print("import it with:")
    print(
        f"  lapguard import {' '.join(arch)} --weights {args.out / 'weights.safetensors'} "
        f"--input-size 32 --crop none --classes {' '.join(repr(c) for c in classes)} "
        f"--out {args.out / 'net'}"
    )


if __name__ == "__main__":
    main()
